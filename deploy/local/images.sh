#!/bin/sh
# The base image of a machine that reaches no image registry, made from Debian's own packages (what an
# air-gapped site does; the development machines here too): Debian 12 (minbase) with Python 3.11 and its
# venv module, trusting what this machine trusts (its CA bundle and pip's `cert`, so a TLS-inspecting
# proxy in front of PyPI is trusted inside the builds too). Every image deploy/local/compose.yml builds
# starts from it.
#   deploy/local/images.sh base        # localhost/redpacket-base:bookworm (about 30 s; again: replaced)
# Needs mmdebstrap and podman (or docker: set ENGINE=docker), and a Debian mirror (MIRROR, by default
# deb.debian.org; SECURITY, its security archive): the base takes bookworm's updates and security fixes,
# and so does every image built on it.
set -eu
ENGINE=${ENGINE:-podman}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=${SECURITY:-http://deb.debian.org/debian-security}
TAG=${REDPACKET_LOCAL_BASE:-localhost/redpacket-base:bookworm}
case "${1:-}" in
base)
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$work/pip.conf"
    mmdebstrap --quiet --variant=minbase --include=ca-certificates,python3,python3-venv \
        --customize-hook="upload /etc/ssl/certs/ca-certificates.crt /usr/local/share/ca-certificates/site.crt" \
        --customize-hook="upload $work/pip.conf /etc/pip.conf" \
        --customize-hook='chroot "$1" update-ca-certificates' \
        bookworm "$work/base.tar" "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
        "deb $SECURITY bookworm-security main"
    "$ENGINE" import --change 'CMD ["/bin/sh"]' "$work/base.tar" "$TAG" >/dev/null
    echo "$TAG"
    ;;
*)
    echo "usage: $0 base" >&2
    exit 2
    ;;
esac
