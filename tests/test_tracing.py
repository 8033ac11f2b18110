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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
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
from tests.hubtools import HubUnderTest, eventually, hub_in_process, make_room, redpacket_up
from tests.repofiles import ROOT
from tests.webhooktools import SECRET, Receiver, receiving
from worker.webhooks import Dispatcher


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        yield exporter
    finally:
        tracing.use(None)


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
            room = await make_room(h, 1)
            grabber_id, grabber_token = room.members[0]
            sender = await h.client(room.admin_token, "json")
            grabber = await h.client(grabber_token, "json")
            sent = await sender.request("send", group=room.group, total=300, count=2)
            packet = int(sent["packet_id"])
            got = await grabber.request("grab", group=room.group, packet=packet)
            await sender.close()
            await grabber.close()
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
    event_id = delivered.attributes["redpacket.event_id"]  # type: ignore[index]
    assert receiver.traceparents[event_id] == tracing._traceparent_of(delivered.context)

    send = _one(spans, "send", packet_id=packet, user_id=room.admin)
    _child(spans, send, "ledger send transaction")
    _child(spans, send, "redis publish", packet_id=packet)
    _child(spans, send, "webhook delivery", event_type="packet.sent")
    assert send.context.trace_id != grab.context.trace_id  # one trace per money move


async def test_off_nothing_is_carried_and_nothing_recorded(hub_settings: Settings) -> None:
    assert not tracing.ON
    async with hub_in_process(hub_settings) as h:
        room = await make_room(h, 1)
        sender = await h.client(room.admin_token, "json")
        grabber = await h.client(room.members[0][1], "json")
        sent = await sender.request("send", group=room.group, total=300, count=2)
        await grabber.request("grab", group=room.group, packet=sent["packet_id"])
        await sender.close()
        await grabber.close()
        entries = await h.core.redis.xrange(keys.outbox_for(GroupId(room.group)))
        assert [sorted(f) for _, f in entries] == [[b"c"]]  # the grab's arguments as before: no trace
        assert await h.core.redis.keys(keys.trace_of("send", int(sent["packet_id"]))) == []


def test_what_the_standard_variables_ask_for_is_checked_first() -> None:
    assert not tracing.wanted({})
    assert tracing.wanted({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.wanted({"OTEL_TRACES_EXPORTER": "console"})
    assert not tracing.wanted(
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    )
    assert not tracing.wanted({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})
    for env, said in (
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "otlp, console or none"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http/protobuf"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "http/protobuf"),
    ):
        with pytest.raises(tracing.TracingError, match=said):
            tracing.check(env)
    tracing.check({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_TRACES_EXPORTER": "otlp"})


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


TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


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
    }
    said: list[str] = []
    try:
        with redpacket_up(tmp_path, env=env, said=said) as (url, _):
            h = HubUnderTest(url, Settings())
            room = await make_room(h, 1)
            sender = await h.client(room.admin_token, "json")
            grabber = await h.client(room.members[0][1], "json")
            sent = await sender.request("send", group=room.group, total=300, count=2)
            await grabber.request("grab", group=room.group, packet=sent["packet_id"])
            await sender.close()
            await grabber.close()
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
