# One image for the hub and the worker: the project installed once, when the image is built (never at
# container start). docker-compose.yml runs it as `redpacket serve` and `redpacket worker`.
#
# BASE: any Debian-like image with python3 (3.11 or later) and its venv module. The official Python image
# by default; an air-gapped machine builds on a base made from Debian's own packages instead
# (docs/operations.md, "Without an image registry"):
#   docker build --build-arg BASE=localhost/redpacket-base:bookworm -t redpacket:latest .
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A container's loopback is reached by nobody: listen on its network (docker run -p 8000:8000 works).
ENV REDPACKET_HOST=0.0.0.0
# The project lives in its own virtualenv: the same on a base whose Python the system manages (Debian's
# python3 refuses `pip install` into it) and on the official image.
RUN python3 -m venv /opt/redpacket
ENV PATH=/opt/redpacket/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md ./
COPY server server
COPY worker worker
COPY lua lua
COPY web web
COPY clients/js clients/js
# The Python client's package: the hub reads the protocol's names and the fair split from it.
COPY clients/python/redpacket_client clients/python/redpacket_client
COPY docs/openapi.json docs/openapi.json
# The system only: the benchmarks' and the load tool's packages (the `tools` extra) stay out of the image.
RUN pip install .
RUN useradd --system --uid 10001 --no-create-home redpacket
USER redpacket

EXPOSE 8000 9108
# The hub's /healthz, asked on this container's own port (Redis and the database reached). A worker's
# container checks `redpacket worker --check` instead (docker-compose.yml says so for its service).
HEALTHCHECK --interval=10s --timeout=6s --start-period=30s --retries=3 CMD ["redpacket", "serve", "--check"]
# Exec form: redpacket is PID 1 and gets SIGTERM itself (the hub drains, the worker stops cleanly).
CMD ["redpacket", "serve"]
