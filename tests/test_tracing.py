"""OpenTelemetry traces of the money's moves (``server.tracing``), recorded by the SDK's in-memory exporter:
a grab is one tree from the hub's socket through Redis to the worker's credit, its ledger transaction
and the webhook delivery of its event; a send likewise. Off, nothing is carried."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

# (The exporter imported here, first: server.tracing.check imports it too, and CPython 3.11 has been seen
# failing a first import under way beside threads of the tests before (KeyError in importlib's module lock).)
import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from redis.asyncio import Redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server import tracing
from server.ids import GroupId
from server.logformat import JsonLines
from server.settings import Settings
from server.store import keys
from tests.books import run_worker
from tests.hubtools import HubUnderTest, Room, eventually, free_port, hub_in_process, make_room, redpacket_up
from tests.repofiles import ROOT
from tests.test_hostile import _answer
from tests.webhooktools import SECRET, Receiver, receiving
from worker.webhooks import Dispatcher


@pytest.fixture
def provider() -> TracerProvider:
    return TracerProvider()


@pytest.fixture
def exported(provider: TracerProvider) -> Iterator[InMemorySpanExporter]:
    """Every span the SDK ends, kept in memory; tracing on for the test."""
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        yield exporter
    finally:
        tracing.use(None)


async def _send_and_grab(h: HubUnderTest) -> tuple[Room, dict[str, Any], dict[str, Any]]:
    """A room of an admin and one member; the admin sends a packet of two shares, the member grabs one
    (over websockets, as clients do): the room, the send's reply and the grab's."""
    room = await make_room(h, 1)
    sender = await h.client(room.admin_token, "json")
    grabber = await h.client(room.members[0][1], "json")
    sent = await sender.request("send", group=room.group, total=300, count=2)
    got = await grabber.request("grab", group=room.group, packet=sent["packet_id"])
    await sender.close()
    await grabber.close()
    return room, sent, got


def _one(spans: list[ReadableSpan], name: str, **attributes: Any) -> ReadableSpan:
    found = [
        s
        for s in spans
        if s.name == name
        and all((s.attributes or {}).get(f"redpacket.{k}") == v for k, v in attributes.items())
    ]
    assert len(found) == 1, (name, attributes, [(s.name, dict(s.attributes or {})) for s in spans])
    return found[0]


def _child(spans: list[ReadableSpan], parent: ReadableSpan, name: str, **attributes: Any) -> ReadableSpan:
    child = _one(
        [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id],
        name,
        **attributes,
    )
    assert child.context.trace_id == parent.context.trace_id
    return child


async def test_a_grab_and_a_send_are_each_one_tree_from_the_socket_to_the_webhook(
    hub_settings: Settings, exported: InMemorySpanExporter
) -> None:
    async with receiving(Receiver()) as receiver:
        settings = hub_settings.replace(
            webhook_urls=receiver.url, webhook_secret=SECRET, webhook_retry_ms=20, webhook_timeout_ms=400
        )
        async with hub_in_process(settings) as h:
            room, sent, got = await _send_and_grab(h)
            grabber_id, packet = room.members[0][0], int(sent["packet_id"])
            # The credit record in the outbox carries the Redis span to the worker.
            entries = await h.core.redis.xrange(keys.outbox_for(GroupId(room.group)))
            assert [sorted(f) for _, f in entries] == [[b"c", b"t"]]
            assert await run_worker(h.core) == 1  # the worker's credit drain, in this process
            async with httpx.AsyncClient() as http:
                dispatcher = Dispatcher(h.core, client=http)
                while await dispatcher.round():
                    pass
    spans = list(exported.get_finished_spans())
    grab = _one(spans, "grab", packet_id=packet, user_id=grabber_id, outcome="won")
    redis = _child(spans, grab, "redis grab.lua", packet_id=packet, user_id=grabber_id)
    assert redis.attributes is not None and redis.attributes["db.system"] == "redis"
    credit = _child(
        spans, redis, "credit", packet_id=packet, user_id=grabber_id, seq=got["seq"], outcome="credited"
    )
    ledger = _child(spans, credit, "ledger credit transaction")
    assert ledger.attributes is not None and ledger.attributes["db.system"] == "mysql"
    delivered = _child(spans, credit, "webhook delivery", event_type="share.credited")
    # The receiver was told the delivery's span (a backend that traces joins the same trace).
    event_id = int(str((delivered.attributes or {})["redpacket.event_id"]))
    assert receiver.traceparents[event_id] == tracing.traceparent_of(delivered.context)

    send = _one(spans, "send", packet_id=packet, user_id=room.admin)
    _child(spans, send, "ledger send transaction")
    _child(spans, send, "redis publish", packet_id=packet)
    _child(spans, send, "webhook delivery", event_type="packet.sent")
    assert send.context.trace_id != grab.context.trace_id  # one trace per money move


async def test_off_nothing_is_carried_and_nothing_recorded(hub_settings: Settings) -> None:
    assert not tracing.ON
    # (Webhook URLs: a send traced would keep its context for their deliveries.)
    settings = hub_settings.replace(webhook_urls="https://backend.example/hooks", webhook_secret=SECRET)
    async with hub_in_process(settings) as h:
        room, sent, _ = await _send_and_grab(h)
        entries = await h.core.redis.xrange(keys.outbox_for(GroupId(room.group)))
        assert [sorted(f) for _, f in entries] == [[b"c"]]  # the grab's arguments as before: no trace
        assert await h.core.redis.keys(keys.trace_of("send", int(sent["packet_id"]))) == []


async def test_a_move_not_drawn_makes_no_span_and_carries_nothing(
    hub_settings: Settings, provider: TracerProvider, exported: InMemorySpanExporter
) -> None:
    """OTEL_TRACES_SAMPLER's share is drawn before any span is made: at 0, tracing on costs a grab a
    flag test and a random number, and its credit record carries no context."""
    tracing.use(provider, 0.0)
    async with hub_in_process(hub_settings) as h:
        room, _, _ = await _send_and_grab(h)
        entries = await h.core.redis.xrange(keys.outbox_for(GroupId(room.group)))
        assert [sorted(f) for _, f in entries] == [[b"c"]]
    assert exported.get_finished_spans() == ()


async def test_keeping_a_context_never_fails_nor_waits(exported: InMemorySpanExporter) -> None:
    """A Redis that refuses connections, and one that takes them and never answers: keeping a span's
    context for a webhook delivery gives up within its bound, and reading one finds none; neither raises
    into the money move it follows."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()  # never answers; until the client goes
        finally:
            writer.close()

    mute = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        for port in (1, mute.sockets[0].getsockname()[1]):
            redis = Redis(host="127.0.0.1", port=port, socket_timeout=30, socket_connect_timeout=30)
            with tracing.span("send"):
                started = time.monotonic()
                await tracing.keep(redis, "anything")
                assert await tracing.kept(redis, "anything") == ""
                assert time.monotonic() - started < 5 * tracing.KEEP_SECONDS, port
            await redis.aclose()
    finally:
        mute.close()
        await mute.wait_closed()


def test_what_the_standard_variables_ask_for_is_checked_first() -> None:
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "console"})
    assert not tracing.wanted(
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    )
    assert not tracing.wanted({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    for env, said in (
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "otlp, console, both"),
        ({"OTEL_TRACES_EXPORTER": "otlp,none"}, "otlp, console, both"),
        ({**on, "OTEL_TRACES_SAMPLER": "xray"}, "OTEL_TRACES_SAMPLER is one of"),
        ({**on, "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"}, "0 to 1"),
        ({**on, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf"),
        ({**on, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "http/protobuf"),
    ):
        with pytest.raises(tracing.TracingError, match=said):
            tracing.check(env)
    tracing.check({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_TRACES_EXPORTER": "otlp,console"})
    tracing.check({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_SAMPLER": "xray"})  # nothing asks for traces
    assert (
        tracing.rate({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"})
        == 0.25
    )
    assert tracing.rate({}) == 1.0 and tracing.rate({"OTEL_TRACES_SAMPLER": "always_off"}) == 0.0
    assert tracing.sampled("00-0bf6079d8b5196e954ec6f18f6e0f1f5-5e887f18f78cc810-03")
    assert not tracing.sampled("00-0bf6079d8b5196e954ec6f18f6e0f1f5-5e887f18f78cc810-02")


def test_a_json_line_carries_the_span_it_was_written_in(exported: InMemorySpanExporter) -> None:
    formatter = JsonLines()
    record = logging.LogRecord("redpacket.test", logging.WARNING, __file__, 1, "paid %d", (7,), None)
    assert "trace_id" not in json.loads(formatter.format(record))  # outside any span
    with tracing.span("credit") as span:
        line = json.loads(formatter.format(record))
    context = span.get_span_context()
    assert line["trace_id"] == f"{context.trace_id:032x}" and line["span_id"] == f"{context.span_id:016x}"
    assert (line["level"], line["logger"], line["message"]) == ("WARNING", "redpacket.test", "paid 7")
    assert line["time"].endswith("Z")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        failed = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "RuntimeError: boom" in json.loads(formatter.format(failed))["exception"]


# A log line as text: ours ("2026-12-07 21:43:03,445 INFO server…: …"), or uvicorn's own ("WARNING:  …").
LEVEL = "(DEBUG|INFO|WARNING|ERROR|CRITICAL)"
TEXT_LINE = re.compile(rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}} {LEVEL} |{LEVEL}:\s)")


async def test_up_sends_a_grabs_whole_trace_over_otlp_and_logs_json_lines(tmp_path: Path) -> None:
    """The standard variables alone: `redpacket up` (a hub and a worker in one process) sends the grab's
    spans to an OTLP/HTTP receiver (a stock Starlette app here), the worker's credit the child of the
    grab's Redis call; and with REDPACKET_LOG_FORMAT=json every log line it writes is a JSON object."""
    recipe = (ROOT / "docs" / "operations.md").read_text().split("## Logs and traces", 1)[1]
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 redpacket up" in recipe  # (another port here)
    bodies: list[bytes] = []

    async def collect(request: Request) -> Response:
        bodies.append(await request.body())
        return Response(b"", media_type="application/x-protobuf")

    app = Starlette(routes=[Route("/v1/traces", collect, methods=["POST"])])
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sock.getsockname()[1]}",
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "hub-under-test",
        "REDPACKET_LOG_FORMAT": "json",
        # The operations listener too (its own uvicorn server, whose records must be JSON lines as well).
        "REDPACKET_METRICS_PORT": str(ops := free_port()),
    }
    said: list[str] = []
    try:
        with redpacket_up(tmp_path, env=env, said=said) as (url, _):
            h = HubUnderTest(url, Settings())
            await _send_and_grab(h)
            # uvicorn's own warning on the operations listener: a websocket upgrade it does not serve.
            upgrade = b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
            await _answer("127.0.0.1", ops, upgrade)
            await eventually(lambda: any('"logger": "uvicorn' in line for line in said), timeout=30)
            wanted = {"grab", "redis grab.lua", "credit", "ledger credit transaction"}
            await eventually(lambda: wanted <= {s.name for s in _spans(bodies)}, timeout=60)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
    spans = {s.name: s for s in _spans(bodies) if s.name in wanted}
    assert spans["redis grab.lua"].parent_span_id == spans["grab"].span_id
    assert spans["credit"].parent_span_id == spans["redis grab.lua"].span_id
    assert spans["ledger credit transaction"].parent_span_id == spans["credit"].span_id
    assert len({s.trace_id for s in spans.values()}) == 1
    request = ExportTraceServiceRequest.FromString(bodies[0])
    names = {
        a.value.string_value
        for r in request.resource_spans
        for a in r.resource.attributes
        if a.key == "service.name"
    }
    assert names == {"hub-under-test"}
    logged = [line for line in said if line.startswith("{")]
    assert logged and all(json.loads(line)["level"] for line in logged)
    assert not [line for line in said if TEXT_LINE.match(line)], said


def _spans(bodies: list[bytes]) -> list[Any]:
    return [
        s
        for body in list(bodies)
        for r in ExportTraceServiceRequest.FromString(body).resource_spans
        for scope in r.scope_spans
        for s in scope.spans
    ]
