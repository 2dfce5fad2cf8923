"""OpenTelemetry tracing, with context carried in NATS headers as ``traceparent``.

Every published message carries a ``traceparent``: the current span's when there is
one, else a fresh root context, so a consumer can always join the producer's trace.
Spans are exported over OTLP/HTTP only when an endpoint is configured.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_configured = False


def configure(service: str, otlp_endpoint: str | None = None) -> None:
    """Install the SDK tracer provider once; add an OTLP exporter if asked."""
    global _configured
    if _configured:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(resource=Resource.create({"service.name": f"tandem-{service}"}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        endpoint = otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    _configured = True


def shutdown() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def tracer(name: str = "tandem") -> trace.Tracer:
    return trace.get_tracer(name)


def traceparent() -> str:
    """The W3C traceparent for a message published now.

    Uses the current span when it is valid; otherwise mints a sampled root context
    (cheaper than starting a span, which matters on the publish hot path).
    """
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"
    return f"00-{random.getrandbits(128):032x}-{random.getrandbits(64) or 1:016x}-01"


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The parent context carried by a message's headers (empty if none)."""
    if not headers:
        return otel_context.Context()
    return _propagator.extract(carrier=dict(headers))


def trace_id(headers: Mapping[str, str] | None) -> str | None:
    """The hex trace id in a message's ``traceparent``, or None."""
    tp = (headers or {}).get("traceparent", "")
    parts = tp.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def remote_span(traceparent_value: str) -> Any:
    """A non-recording span for a traceparent string, usable as a parent context."""
    parts = traceparent_value.split("-")
    ctx = SpanContext(
        trace_id=int(parts[1], 16), span_id=int(parts[2], 16), is_remote=True,
        trace_flags=TraceFlags(int(parts[3], 16)),
    )
    return trace.set_span_in_context(NonRecordingSpan(ctx))


def recording() -> bool:
    """True when spans are exported somewhere (an OTLP endpoint is configured).

    Without an exporter, consumers only carry the incoming trace context forward,
    which costs far less than building a span per message.
    """
    provider = trace.get_tracer_provider()
    processor = getattr(provider, "_active_span_processor", None)
    return bool(getattr(processor, "_span_processors", ()))


def span_between(name: str, start: float, end: float, attributes: dict[str, Any] | None = None,
                 kind: trace.SpanKind = trace.SpanKind.INTERNAL) -> None:
    """Record a finished span from wall-clock times (``time.time()`` seconds), as a child
    of the current span: for phases measured first and reported after (queue wait,
    batching). Costs nothing unless spans are exported."""
    if not recording():
        return
    span = tracer().start_span(name, kind=kind, attributes=attributes or {},
                               start_time=int(start * 1e9))
    span.end(end_time=int(max(end, start) * 1e9))


def new_trace(name: str, attributes: dict[str, Any] | None = None) -> Any:
    """A root span in a fresh trace (a context manager), whatever the current context:
    one trace per unit of work that has no caller, such as a training restart cycle."""
    return tracer().start_as_current_span(name, context=otel_context.Context(),
                                          attributes=attributes or {})


@contextlib.contextmanager
def server_span(name: str, headers: Mapping[str, str] | None,
                attributes: dict[str, Any] | None = None) -> Iterator[Any]:
    """A SERVER span around one request served (current within the block), joining the
    caller's trace from its ``traceparent`` header when it sent one: what the request
    publishes then descends from it. Yields None, and builds nothing, unless spans are
    exported."""
    if not recording():
        yield None
        return
    with tracer().start_as_current_span(name, context=extract(headers),
                                        kind=trace.SpanKind.SERVER,
                                        attributes=attributes or {}) as span:
        yield span


def fail(span: Any, error: BaseException | str) -> None:
    """Mark ``span`` (None: no span, nothing to mark) as failed: status ERROR with a
    description, and the exception as an event when ``error`` is one. For an outcome
    caught and settled rather than raised through the span, which OpenTelemetry would
    otherwise leave UNSET."""
    if span is None or not span.is_recording():
        return
    if isinstance(error, BaseException):
        span.record_exception(error)
        description = f"{type(error).__name__}: {error}"
    else:
        description = error
    span.set_status(Status(StatusCode.ERROR, description[:500]))
