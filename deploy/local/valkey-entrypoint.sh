#!/bin/sh
# As the official redis image: a server started without a configuration file (no *.conf first argument)
# listens to the container's network without protected mode (the compose network is its protection; no
# port is published); one given a file keeps what the file says.
set -eu
if [ "${1:-}" = "redis-server" ]; then
    shift
    case "${1:-}" in
        *.conf) exec redis-server "$@" ;;
        *) exec redis-server --protected-mode no "$@" ;;
    esac
fi
exec "$@"
