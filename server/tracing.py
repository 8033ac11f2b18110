"""OpenTelemetry traces of the money's moves, off and costing nothing unless configured.

On when the standard environment asks for traces: ``OTEL_TRACES_EXPORTER`` (``otlp`` or ``console``) or an
OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), and not
``OTEL_SDK_DISABLED=true``. The OTLP exporter is the SDK's over HTTP/protobuf, reading its own variables
(endpoint, headers, timeout, ``OTEL_BSP_*``, ``OTEL_TRACES_SAMPLER``, ``OTEL_SERVICE_NAME``). A variable
this module cannot honour (a gRPC protocol, an exporter it does not know) or the packages missing
(``pip install 'redpacket[tracing]'``) is refused at start-up in one line (``TracingError``).

Off, every call here is a test of ``ON`` and a return: the hot path builds no span, no context, no
string. On, a grab's trace runs from the hub's frame through its Redis call; the credit record the
script writes carries the Redis span's context (W3C ``traceparent``) to the worker, whose credit and
ledger transaction are its children, and whose webhook delivery is the credit's child (the context
kept in Redis for a day under the event's key, ``keys.trace_of``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

ON = False
_tracer: Any = None
_provider: Any = None

EXPORTERS = ("otlp", "console", "none")
# How long a money move's span is kept for its webhook delivery to join (``keys.trace_of``).
KEPT_SECONDS = 86_400


class TracingError(ValueError):
    """The environment asks for traces this process cannot send (one line: what, and what to do)."""


def wanted(env: Mapping[str, str]) -> bool:
    """Whether the standard variables in ``env`` ask for traces."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def check(env: Mapping[str, str]) -> None:
    """Refuse what this module cannot do as asked, before anything starts."""
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter and exporter not in EXPORTERS:
        raise TracingError(f"OTEL_TRACES_EXPORTER is otlp, console or none (got {exporter!r})")
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(name, "").strip()
        if protocol and protocol != "http/protobuf":
            raise TracingError(f"{name}: traces are sent as http/protobuf (got {protocol!r})")
    if not wanted(env):
        return
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise TracingError(
            "the environment asks for traces (OTEL_*), and the OpenTelemetry packages are not installed:"
            " pip install 'redpacket[tracing]'"
        ) from None


def configure(service: str, env: Mapping[str, str] | None = None) -> bool:
    """Start sending traces if the environment asks (``check`` first); whether it does. Once a process,
    in the process that sends (a supervisor's children configure their own)."""
    env = os.environ if env is None else env
    check(env)
    if not wanted(env) or ON:
        return ON
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    exporter: SpanExporter
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or service})
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    use(provider)
    return True


def use(provider: Any) -> None:
    """Trace with this SDK ``TracerProvider`` (``configure``'s, or a test's); None: off again."""
    global ON, _tracer, _provider
    _provider = provider
    _tracer = None if provider is None else provider.get_tracer("redpacket")
    ON = provider is not None


def shutdown() -> None:
    """Send what is buffered (a stopping process), within the SDK's own bound."""
    if _provider is not None:
        _provider.shutdown()


_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()


def maybe(name: str, kind: str = "internal", **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """``span`` when tracing, else a context that does nothing and gives None (for a path that is not hot:
    a hot one tests ``ON`` itself and calls nothing)."""
    return span(name, kind, **attributes) if ON else _OFF


async def keep(redis: Any, key: str, parent: str | None = None) -> None:
    """Keep the current span (or ``parent``) under ``key`` (``keys.trace_of``: a money move's) for the
    webhook delivery of its event to join."""
    await redis.set(key, parent or traceparent(), ex=KEPT_SECONDS)


async def kept(redis: Any, key: str) -> str:
    """The span ``keep`` kept under ``key`` ('' when none, or gone)."""
    found = await redis.get(key)
    return found.decode() if isinstance(found, bytes) else (found or "")


@contextlib.contextmanager
def span(name: str, kind: str = "internal", parent: str | None = None, **attributes: Any) -> Iterator[Any]:
    """A span around the block, the current one's child (or ``parent``'s, a ``traceparent``); the span is
    given to the block (for more attributes). Only under ``if tracing.ON``: off it is not called."""
    from opentelemetry.trace import SpanKind, Status, StatusCode

    context = _context_of(parent) if parent else None
    with _tracer.start_as_current_span(
        name, context=context, kind=getattr(SpanKind, kind.upper()), attributes=_attrs(attributes)
    ) as s:
        try:
            yield s
        except BaseException as e:
            s.set_status(Status(StatusCode.ERROR, type(e).__name__))
            raise


def recorded(
    name: str, parent: str, start_ns: int, end_ns: int, kind: str = "internal", **attributes: Any
) -> str:
    """A span that already happened (a worker's batch: one transaction for many traces), the child of
    ``parent`` (a ``traceparent``); returns its own ``traceparent`` (for its children)."""
    from opentelemetry.trace import SpanKind

    s = _tracer.start_span(
        name,
        context=_context_of(parent),
        kind=getattr(SpanKind, kind.upper()),
        attributes=_attrs(attributes),
        start_time=start_ns,
    )
    s.end(end_time=end_ns)
    return _traceparent_of(s.get_span_context())


def traceparent() -> str:
    """The current span as a W3C ``traceparent`` ('' when none)."""
    from opentelemetry import trace

    return _traceparent_of(trace.get_current_span().get_span_context())


def current_ids() -> tuple[str, str] | None:
    """The current trace and span ids in hex (a log line's), or None."""
    if not ON:
        return None
    from opentelemetry import trace

    c = trace.get_current_span().get_span_context()
    return (f"{c.trace_id:032x}", f"{c.span_id:016x}") if c.is_valid else None


def _traceparent_of(c: Any) -> str:
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}" if c.is_valid else ""


def _context_of(parent: str) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": parent})


def _attrs(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k if "." in k else f"redpacket.{k}": v for k, v in attributes.items() if v is not None}
