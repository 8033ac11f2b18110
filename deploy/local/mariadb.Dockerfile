# The stack's MariaDB without an image registry: Debian 12's (10.11, the version docker-compose.yml names),
# with the part of the official image's interface the stack uses (the MARIADB_DATABASE / _USER /
# _PASSWORD / _RANDOM_ROOT_PASSWORD variables on a new volume, server options as the command,
# healthcheck.sh --connect --innodb_initialized), on the base made by deploy/local/images.sh.
ARG BASE=localhost/redpacket-base:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends mariadb-server \
 && rm -rf /var/lib/apt/lists/* /var/lib/mysql/* \
 && mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld /var/lib/mysql
COPY mariadb-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
COPY mariadb-healthcheck.sh /usr/local/bin/healthcheck.sh
USER mysql
EXPOSE 3306
ENTRYPOINT ["docker-entrypoint.sh"]
CMD []
