#!/bin/sh
# A new volume: the system tables, then the database and the user the environment names, made by a
# server that listens on no port; then the server itself, with the command's options. A volume that
# holds a database already is started as it is. root (and mysql, the health check's) log in only by the
# socket, as the OS user of the same name: no root password exists to keep (MARIADB_RANDOM_ROOT_PASSWORD).
set -eu
datadir=/var/lib/mysql
if [ ! -d "$datadir/mysql" ]; then
    : "${MARIADB_DATABASE:?}" "${MARIADB_USER:?}" "${MARIADB_PASSWORD:?}"
    case "$MARIADB_DATABASE$MARIADB_USER$MARIADB_PASSWORD" in
        *\'*|*\\*|*\`*) echo "MARIADB_DATABASE, _USER and _PASSWORD may not hold ' \\ or \`" >&2; exit 1 ;;
    esac
    # A half-made volume is not left behind to be started later as if it were whole.
    trap 'kill ${pid:-} 2>/dev/null; wait; rm -rf "$datadir"/* "$datadir"/.[!.]*' EXIT
    mariadb-install-db --datadir="$datadir" --auth-root-authentication-method=socket \
        --auth-root-socket-user=mysql --skip-test-db >/dev/null
    mariadbd --datadir="$datadir" --skip-networking --socket=/run/mysqld/init.sock &
    pid=$!
    i=0
    until mariadb-admin --socket=/run/mysqld/init.sock ping >/dev/null 2>&1; do
        i=$((i + 1)); [ "$i" -lt 60 ] || { echo "mariadb did not start to initialise" >&2; exit 1; }
        sleep 1
    done
    mariadb --socket=/run/mysqld/init.sock <<SQL
CREATE DATABASE IF NOT EXISTS \`$MARIADB_DATABASE\`;
CREATE USER '$MARIADB_USER'@'%' IDENTIFIED BY '$MARIADB_PASSWORD';
GRANT ALL ON \`$MARIADB_DATABASE\`.* TO '$MARIADB_USER'@'%';
FLUSH PRIVILEGES;
SQL
    mariadb-admin --socket=/run/mysqld/init.sock shutdown
    wait "$pid" || true
    trap - EXIT
fi
exec mariadbd --datadir="$datadir" --bind-address=0.0.0.0 "$@"
