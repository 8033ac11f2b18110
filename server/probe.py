"""A health check's question to a process of this machine (``serve --check``, ``worker --check``): where
to ask it, and asking it directly."""

from __future__ import annotations

import urllib.error
import urllib.request


def own_url(host: str, port: int, path: str) -> str:
    """The URL at which a process of this machine listening on ``host``:``port`` answers ``path`` (a health
    check's): a wildcard address is asked on loopback, an IPv6 one in brackets."""
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}{path}" if ":" in host else f"http://{host}:{port}{path}"


def ask_own(url: str, timeout: float) -> tuple[int, str]:
    """GET ``url`` of this machine (``own_url``) directly, never through the HTTP proxy the environment may
    name (a container is often given the host's); its status and body. Raises ``OSError`` if nothing
    answers."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as r:
            return int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:  # an answer all the same (a 503 says what is wrong)
        return e.code, e.read().decode(errors="replace")
