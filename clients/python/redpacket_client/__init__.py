"""The Python client of a redpacket hub (docs/integration.md, "The Python client"; the protocol:
docs/protocol.md). It needs only ``websockets`` and ``msgpack``, never the server.

- ``RedPacketClient``: what an app uses — one logical connection that reconnects, syncs again and
  checks finished packets (``verify``).
- ``HubClient``: one connection, as the hub speaks it (tests, benchmarks, tools).
- ``HubError``: an error reply, with the protocol's stable ``code``.
- ``fairness``: the provably fair split, recomputed from a packet's revealed seed (``verify``).
"""

from redpacket_client.connection import HubClient, HubError
from redpacket_client.fairness import Verdict, verify
from redpacket_client.reconnecting import RedPacketClient

__all__ = ["HubClient", "HubError", "RedPacketClient", "Verdict", "verify"]
