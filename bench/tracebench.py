"""``redpacket bench tracing``: what tracing costs a grab's hub side, in this process's CPU. The hub's own
path (``server.tracing``: the share drawn before any span, two spans for a grab drawn) beside the stock
OpenTelemetry SDK used as its documentation shows (``start_as_current_span`` nested, the SDK's sampler
deciding), each with a batch processor whose exporter drops what it is given (the export's encoding and
sending are the exporter's, not measured here). Pure CPU: no services."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, ParentBasedTraceIdRatio, Sampler

from bench.report import report
from server import tracing


class _Dropped(SpanExporter):
    def export(self, spans: Any) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _provider(sampler: Sampler) -> TracerProvider:
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(_Dropped()))
    return provider


def _cpu_us(step: Callable[[], object], n: int) -> float:
    for _ in range(n // 10):
        step()
    start = time.process_time()
    for _ in range(n):
        step()
    return round((time.process_time() - start) / n * 1e6, 3)


def _hub_grab() -> None:
    """The tracing a grab goes through on the hub, as server.hub.requests and server.money.grabs do it."""
    if tracing.ON and tracing.draw():
        with tracing.span("grab", "server", packet_id=9, group_id=501, user_id=1002):
            if tracing.ON and tracing.recording():
                with tracing.span("redis grab.lua", "client", packet_id=9, user_id=1002):
                    tracing.traceparent()
    elif tracing.ON and tracing.recording():  # (a step of a move not drawn: never true)
        tracing.traceparent()


def _stock(provider: TracerProvider) -> Callable[[], None]:
    tracer = provider.get_tracer("bench")

    def grab() -> None:
        with tracer.start_as_current_span("grab", attributes={"packet_id": 9, "user_id": 1002}):
            with tracer.start_as_current_span("redis grab.lua", attributes={"packet_id": 9}):
                pass

    return grab


def bench_tracing(n: int = 20_000, plot: Path | None = None) -> dict[str, Any]:
    figures: dict[str, Any] = {"grabs": n}
    tracing.use(None)
    figures["hub_off_cpu_us_per_grab"] = _cpu_us(_hub_grab, n * 10)
    for name, share in (("all", 1.0), ("1pct", 0.01)):
        provider = _provider(ParentBased(ALWAYS_ON))
        tracing.use(provider, share)
        figures[f"hub_{name}_cpu_us_per_grab"] = _cpu_us(_hub_grab, n)
        tracing.use(None)
        provider.shutdown()
        stock = _provider(ALWAYS_ON if share >= 1 else ParentBasedTraceIdRatio(share))
        figures[f"stock_sdk_{name}_cpu_us_per_grab"] = _cpu_us(_stock(stock), n)
        stock.shutdown()
        figures[f"ratio_{name}"] = round(
            figures[f"hub_{name}_cpu_us_per_grab"] / figures[f"stock_sdk_{name}_cpu_us_per_grab"], 3
        )
    return report("tracing", figures, plot, heading="tracing benchmark (CPU µs a grab's spans, this process)")
