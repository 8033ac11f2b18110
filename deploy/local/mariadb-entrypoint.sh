#!/bin/sh
# A new volume: the system tables, then the database and the user the environment names, made by a
# server that listens on no port; then the server itself, with the command's options. A volume that
# holds a database already is started as it is; one that holds anything else is refused, never written.
# root (and mysql, the health check's) log in only by the socket, as the OS user of the same name: no
# root password exists to keep (MARIADB_RANDOM_ROOT_PASSWORD is what that gives here).
set -eu
datadir=/var/lib/mysql
if [ ! -d "$datadir/mysql" ]; then
    if [ -n "$(ls -A "$datadir")" ]; then
        echo "$datadir holds files but no database: refusing to initialise over them" >&2
        exit 1
    fi
    : "${MARIADB_DATABASE:?}" "${MARIADB_USER:?}" "${MARIADB_PASSWORD:?}"
    case "$MARIADB_DATABASE$MARIADB_USER$MARIADB_PASSWORD" in
        *\'*|*\\*|*\`*) echo "MARIADB_DATABASE, _USER and _PASSWORD may not hold ' \\ or \`" >&2; exit 1 ;;
    esac
    # A half-made volume is not left behind to be started later as if it were whole: whatever ends the
    # initialisation early (a failure, or a stop: this script is PID 1 meanwhile) empties it again.
    trap 'kill "${pid:-}" 2>/dev/null || true; wait || true; rm -rf "$datadir"/* "$datadir"/.[!.]* || true' EXIT
    trap 'exit 1' TERM INT
    mariadb-install-db --datadir="$datadir" --auth-root-authentication-method=socket \
        --auth-root-socket-user=mysql --skip-test-db >/dev/null
    mariadbd --datadir="$datadir" --skip-networking --socket=/run/mysqld/init.sock &
    pid=$!
    i=0
    until mariadb-admin --socket=/run/mysqld/init.sock ping >/dev/null 2>&1; do
        i=$((i + 1)); [ "$i" -lt 60 ] || { echo "mariadb did not start to initialise" >&2; exit 1; }
        sleep 1
    done
    # (In GRANT a database name's _ is a wildcard: escaped, the grant is for this database alone.)
    grant_db=$(printf '%s' "$MARIADB_DATABASE" | sed 's/_/\\_/g')
    mariadb --socket=/run/mysqld/init.sock <<SQL
CREATE DATABASE IF NOT EXISTS \`$MARIADB_DATABASE\`;
CREATE USER '$MARIADB_USER'@'%' IDENTIFIED BY '$MARIADB_PASSWORD';
GRANT ALL ON \`$grant_db\`.* TO '$MARIADB_USER'@'%';
FLUSH PRIVILEGES;
SQL
    mariadb-admin --socket=/run/mysqld/init.sock shutdown
    wait "$pid" || true
    trap - EXIT TERM INT
fi
exec mariadbd --datadir="$datadir" --bind-address=0.0.0.0 "$@"
