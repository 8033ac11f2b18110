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

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Mapping
from typing import Any, Literal

from redis.asyncio import Redis

from server.errors import RedPacketError

log = logging.getLogger(__name__)

ON = False
# The share of money moves traced (``OTEL_TRACES_SAMPLER``, ``_ARG``), decided here before any span is
# made: a move not drawn costs a flag test and a random number. The spans of a move drawn are all kept,
# and the worker's follow the flag its context carries.
RATE = 1.0
_tracer: Any = None
_provider: Any = None
_kinds: dict[str, Any] = {}
_current: Any = None
_otel: dict[str, Any] = {}  # the API's functions, looked up once (``use``)

# What ``OTEL_TRACES_SAMPLER`` may name (the SDK's own names): its share of money moves traced.
SAMPLERS = {
    "always_on": 1.0,
    "parentbased_always_on": 1.0,
    "always_off": 0.0,
    "parentbased_always_off": 0.0,
    "traceidratio": None,  # OTEL_TRACES_SAMPLER_ARG, 0 to 1 (1 when absent)
    "parentbased_traceidratio": None,
}

EXPORTERS = ("otlp", "console", "none")
# How long a sampled money move's span is kept (``keys.trace_of``, only with webhook URLs) for its webhook
# delivery to join: a delivery later than that (a receiver down for longer) starts a trace of its own.
KEPT_SECONDS = 600
# The longest keeping or reading one of them may take: then it is not kept (or not found).
KEEP_SECONDS = 0.2

Kind = Literal["internal", "server", "client", "consumer", "producer"]


class TracingError(ValueError):
    """The environment asks for traces this process cannot send (one line: what, and what to do)."""


def _named(env: Mapping[str, str]) -> list[str]:
    return [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]


def exporters(env: Mapping[str, str]) -> list[str]:
    """The exporters the environment asks for (``OTEL_TRACES_EXPORTER``, a comma-separated list; ``otlp``
    when it names none and an OTLP endpoint is set); [] for none."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = _named(env)
    if named:
        return [e for e in named if e != "none"]
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return ["otlp"] if endpoint else []


def wanted(env: Mapping[str, str]) -> bool:
    """Whether the standard variables in ``env`` ask for traces."""
    return bool(exporters(env))


def check(env: Mapping[str, str]) -> None:
    """Refuse what this module cannot do as asked, before anything starts (nothing, when nothing asks
    for traces)."""
    named = _named(env)
    if any(e not in EXPORTERS for e in named) or ("none" in named and len(named) > 1):
        raise TracingError(
            "OTEL_TRACES_EXPORTER is otlp, console, both (otlp,console), or none"
            f" (got {env.get('OTEL_TRACES_EXPORTER')!r})"
        )
    if not wanted(env):
        return
    rate(env)
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = env.get(name, "").strip()
        if protocol and protocol != "http/protobuf":
            raise TracingError(f"{name}: traces are sent as http/protobuf (got {protocol!r})")
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise TracingError(
            "the environment asks for traces (OTEL_*), and the OpenTelemetry packages are not installed:"
            " pip install 'redpacket[tracing]'"
        ) from None


def rate(env: Mapping[str, str]) -> float:
    """The share of money moves ``OTEL_TRACES_SAMPLER`` (and its ``_ARG``) asks to trace."""
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if sampler not in SAMPLERS:
        raise TracingError(f"OTEL_TRACES_SAMPLER is one of {', '.join(SAMPLERS)} (got {sampler!r})")
    fixed = SAMPLERS[sampler]
    if fixed is not None:
        return fixed
    arg = env.get("OTEL_TRACES_SAMPLER_ARG", "1").strip()
    try:
        share = float(arg)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise TracingError(f"OTEL_TRACES_SAMPLER_ARG is a share of traces, 0 to 1 (got {arg!r})")
    return share


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
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased

    name = env.get("OTEL_SERVICE_NAME") or service
    # The share is drawn here (``draw``); the SDK keeps what was drawn, and a worker's span follows its
    # parent's flag.
    sampler = ParentBased(ALWAYS_ON)
    provider = TracerProvider(resource=Resource.create({"service.name": name}), sampler=sampler)
    for chosen in exporters(env):
        exporter: SpanExporter
        if chosen == "console":
            exporter = ConsoleSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    use(provider, rate(env))
    return True


def use(provider: Any, share: float = 1.0) -> None:
    """Trace ``share`` of the money moves with this SDK ``TracerProvider`` (``configure``'s, or a test's);
    None: off again."""
    global ON, RATE, _tracer, _provider, _kinds, _current
    from opentelemetry.context import attach, detach
    from opentelemetry.trace import SpanKind, Status, StatusCode, get_current_span, set_span_in_context

    _provider = provider
    _tracer = None if provider is None else provider.get_tracer("redpacket")
    _kinds = {k.name.lower(): k for k in SpanKind}
    _current = get_current_span
    _otel.update(
        attach=attach,
        detach=detach,
        set_span_in_context=set_span_in_context,
        Status=Status,
        ERROR=StatusCode.ERROR,
    )
    RATE = share
    ON = provider is not None


def draw() -> bool:
    """Whether the money move starting now is traced (``RATE`` of them; only under ``if tracing.ON``)."""
    return RATE >= 1.0 or random.random() < RATE


def recording() -> bool:
    """Whether a span being recorded is current (a money move drawn): its steps make spans of their own."""
    return bool(_current().is_recording())


def shutdown() -> None:
    """Send what is buffered (a stopping process), within the SDK's own bound."""
    if _provider is not None:
        _provider.shutdown()


_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()


def maybe(
    name: str, kind: Kind = "internal", root: bool = False, **attributes: Any
) -> contextlib.AbstractContextManager[Any]:
    """``span`` when tracing and this step is in a money move drawn (``root``: the move itself, drawn
    now), else a context that does nothing and gives None (for a path that is not hot: a hot one tests
    ``ON`` itself and calls nothing)."""
    if ON and (draw() if root else recording()):
        return span(name, kind, **attributes)
    return _OFF


def sampled(parent: str) -> bool:
    """Whether a ``traceparent`` is of a span the sampler kept (bit 0 of its flags; bit 1 says the trace
    id is random, W3C Trace Context level 2)."""
    try:
        return bool(int(parent[-2:], 16) & 1)
    except ValueError:
        return False


async def keep(redis: Redis, key: str) -> None:
    """Keep the current span under ``key`` (``keys.trace_of``: a money move's) for the webhook delivery of
    its event to join, if it is sampled (``keep_many``)."""
    await keep_many(redis, {key: traceparent()})


async def keep_many(redis: Redis, contexts: Mapping[str, str], seconds: float = KEEP_SECONDS) -> None:
    """Keep each sampled span (a ``traceparent``) under its key, in one round trip. Whatever goes wrong
    (Redis away, a cluster's slot moving, no answer within ``seconds``) is said at debug level: not kept,
    the delivery then starts a trace of its own, and the money move it follows goes on."""
    chosen = {key: parent for key, parent in contexts.items() if sampled(parent)}
    if not chosen:
        return
    try:
        async with asyncio.timeout(seconds), redis.pipeline(transaction=False) as pipe:
            for key, parent in chosen.items():
                pipe.set(key, parent, ex=KEPT_SECONDS)
            await pipe.execute()
    except Exception as e:
        log.debug("trace context not kept (%r)", e)


async def kept(redis: Redis, key: str) -> str:
    """The span ``keep`` kept under ``key``; '' when none, gone, or not read within ``KEEP_SECONDS``."""
    try:
        async with asyncio.timeout(KEEP_SECONDS):
            found = await redis.get(key)
    except Exception as e:
        log.debug("trace context not read (%r)", e)
        return ""
    return found.decode() if isinstance(found, bytes) else (found or "")


def span(name: str, kind: Kind = "internal", parent: str | None = None, **attributes: Any) -> _Span:
    """A span around the block, the current one's child (or ``parent``'s, a ``traceparent``); the span is
    given to the block (for more attributes). Only under ``if tracing.ON``: off it is not called."""
    context = _context_of(parent) if parent else None
    return _Span(_tracer.start_span(name, context=context, kind=_kinds[kind], attributes=_attrs(attributes)))


class _Span:
    """The span current for the block, ended with it: an exception that is not one of our refusals
    (``RedPacketError``: an answer, not a failure, its code the span's ``redpacket.outcome``) marks it an
    error and is recorded on it; a cancel does not. The SDK's ``start_as_current_span`` without its layers
    of generators; the context is given back even if ending the span fails."""

    __slots__ = ("span", "token")

    def __init__(self, span: Any) -> None:
        self.span = span
        self.token: Any = None

    def __enter__(self) -> Any:
        self.token = _otel["attach"](_otel["set_span_in_context"](self.span))
        return self.span

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _: Any) -> None:
        try:
            if isinstance(error, Exception) and not isinstance(error, RedPacketError):
                self.span.record_exception(error)
                self.span.set_status(_otel["Status"](_otel["ERROR"], type(error).__name__))
            self.span.end()
        finally:
            _otel["detach"](self.token)


def recorded(
    name: str, parent: str, start_ns: int, end_ns: int, kind: Kind = "internal", **attributes: Any
) -> str:
    """A span that already happened (a worker's batch: one transaction for many traces), the child of
    ``parent`` (a ``traceparent``); returns its own ``traceparent`` (for its children)."""
    s = _tracer.start_span(
        name,
        context=_context_of(parent),
        kind=_kinds[kind],
        attributes=_attrs(attributes),
        start_time=start_ns,
    )
    s.end(end_time=end_ns)
    return traceparent_of(s.get_span_context())


def traceparent() -> str:
    """The current span as a W3C ``traceparent`` ('' when none)."""
    return traceparent_of(_current().get_span_context())


def current_ids() -> tuple[str, str] | None:
    """The current trace and span ids in hex (a log line's), or None."""
    if not ON:
        return None
    from opentelemetry import trace

    c = trace.get_current_span().get_span_context()
    return (f"{c.trace_id:032x}", f"{c.span_id:016x}") if c.is_valid else None


def traceparent_of(c: Any) -> str:
    """A span context as a W3C ``traceparent`` ('' for an invalid one)."""
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}" if c.is_valid else ""


def _context_of(parent: str) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": parent})


def _attrs(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k if "." in k else f"redpacket.{k}": v for k, v in attributes.items() if v is not None}
