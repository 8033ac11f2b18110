"""The hub's frames below ASGI (``server.hub.wire``) and a connection's send queues (``hub.Connection``)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import cast

import pytest
from websockets.frames import Frame, Opcode

from server.hub import protocol
from server.hub.connection import Connection
from server.hub.frames import data_frame
from server.hub.hub import Hub
from server.hub.metrics import HubMetrics
from server.hub.wire import HubWebSocket


@pytest.mark.parametrize("size", [0, 1, 125, 126, 65535, 65536, 70000])
def test_a_frame_framed_once_is_what_websockets_would_send(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    assert data_frame(payload) == Frame(Opcode.BINARY, payload).serialize(mask=False, extensions=[])
    text = "红" * (size // 3)
    assert data_frame(text) == Frame(Opcode.TEXT, text.encode()).serialize(mask=False, extensions=[])


class _Wire:
    """A socket whose transport takes frames or does not (``writable_now``)."""

    def __init__(self) -> None:
        self.writable_now = True
        self.plain = True
        self.written: list[bytes] = []

    def frame(self, payload: bytes | str) -> bytes:
        return data_frame(payload)

    def write(self, raw: bytes) -> None:
        self.written.append(raw)


def _connection(queue_frames: int) -> tuple[Connection, _Wire]:
    settings = SimpleNamespace(send_queue_frames=queue_frames)
    hub = SimpleNamespace(
        id="abcdef012345", serial=itertools.count(1), core=SimpleNamespace(settings=settings)
    )
    hub.metrics = HubMetrics()
    wire = _Wire()
    dialect = protocol.DIALECTS[protocol.SUBPROTOCOL_JSON]
    return Connection(cast(Hub, hub), cast(HubWebSocket, wire), 7, dialect), wire


def _said(wire: _Wire) -> list[str]:
    return [raw[2:].decode() for raw in wire.written]  # short JSON frames: a 2-byte header


async def test_frames_go_straight_out_while_the_socket_takes_them() -> None:
    conn, wire = _connection(8)
    conn.push('"e1"')
    conn.reply({"r": 1})
    conn.push('"e2"')
    assert _said(wire) == ['"e1"', '{"r":1}', '"e2"']
    assert conn.waiting() == 0


async def test_a_slow_socket_gets_replies_first_and_events_in_order() -> None:
    conn, wire = _connection(8)
    wire.writable_now = False
    conn.push('"e1"')
    conn.push('"e2"')
    conn.reply({"r": 1})
    conn.send({"sync": "after its events"})  # a sync's reply keeps its place among the events
    conn.push('"e3"')
    conn.reply({"r": 2})
    assert wire.written == [] and conn.waiting() == 6
    wire.writable_now = True
    conn.on_writable()
    assert _said(wire) == ['{"r":1}', '{"r":2}', '"e1"', '"e2"', '{"sync":"after its events"}', '"e3"']
    assert conn.waiting() == 0


async def test_a_socket_too_slow_for_its_queue_is_closed_and_sent_nothing_more() -> None:
    conn, wire = _connection(3)
    wire.writable_now = False
    for i in range(3):
        conn.push(f'"e{i}"')
    assert not conn.closing
    conn.push('"one too many"')
    assert conn.closing and conn.close_code == protocol.CLOSE_SLOW_CONSUMER
    assert conn.ended.done()
    conn.push('"after"')
    conn.reply({"r": 1})
    wire.writable_now = True
    conn.on_writable()
    assert _said(wire) == ['"e0"', '"e1"', '"e2"', '"one too many"']
