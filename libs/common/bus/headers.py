"""Every NATS header the bus writes or reads, named once, and the trace they carry.

- ``traceparent`` on every message (OpenTelemetry), so a consumer joins the producer's
  trace;
- ``Nats-Msg-Id`` on a publish that must not duplicate (deduped within the stream's
  window);
- ``Nats-Expected-Last-Subject-Sequence`` for compare-and-set: ``0`` stores only on an
  empty subject (``publish_once``, a KV create), ``n`` only over revision ``n``; the
  server refuses otherwise with one of ``WRONG_LAST``;
- ``Status`` (and ``Description``) on the server's own replies: 404/408 end a pull
  request, 100 is an idle heartbeat, 503 means no responders.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from tandem.common import tracing

MSG_ID = "Nats-Msg-Id"
TRACEPARENT = "traceparent"
EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
STATUS = "Status"
DESCRIPTION = "Description"
WRONG_LAST = (10071, 10164)  # JetStream's "wrong last sequence" error codes


def build(msg_id: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The headers of one publish: the current trace, ``msg_id`` if given, ``extra``."""
    hdrs = {TRACEPARENT: tracing.traceparent()}
    if msg_id is not None:
        hdrs[MSG_ID] = msg_id
    if extra:
        hdrs.update(extra)
    return hdrs


def attach_remote(tp: str | None) -> Any:
    """Make the producer's ``traceparent`` the current context (not recording); the token
    to detach it, or None when there is none or it does not parse."""
    if not tp:
        return None
    parts = tp.split("-")
    if len(parts) != 4:
        return None
    try:
        ctx = SpanContext(int(parts[1], 16), int(parts[2], 16), True, TraceFlags(int(parts[3], 16)))
    except ValueError:
        return None
    return otel_context.attach(trace.set_span_in_context(NonRecordingSpan(ctx)))
