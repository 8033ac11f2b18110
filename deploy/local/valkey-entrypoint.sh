#!/bin/sh
# As the official redis image: a server started without a configuration file listens to the container's
# network without protected mode (the compose network is its protection; no port is published).
set -eu
if [ "${1:-}" = "redis-server" ]; then
    shift
    exec redis-server --protected-mode no "$@"
fi
exec "$@"
