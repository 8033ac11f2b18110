# The stack's balancer without an image registry: Debian 12's HAProxy (2.6), reading its configuration
# where the official image does, on the base made by deploy/local/images.sh.
ARG BASE=localhost/redpacket-base:bookworm
FROM ${BASE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends haproxy \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /usr/local/etc/haproxy
# Unprivileged, as the official image runs it (the package made the user; 8000 needs no privilege).
USER haproxy
EXPOSE 8000
CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]
