"""Server spans: what a broker or a delay server did with a traced message, as OpenTelemetry
spans, when its config turns them on (``trace_spans = true``; off by default).

A message carries its producer's trace context in its ``traceparent``/``tracestate``
properties (qmq.client.telemetry). A server with spans on makes, for each message of a send
frame that carries one whose sampled flag is set (and that the ``trace_sample_ratio`` keeps,
decided by trace id, so every server keeps or drops the same traces):

- a broker: ``store SUBJECT`` (kind SERVER) from the frame's arrival to its answer — the
  write, the fsync under ``flush = "sync"``, the slave's copy;
- a delay server: ``schedule SUBJECT`` (kind SERVER) from arrival to the answer, and at the
  due time ``fire SUBJECT`` (kind PRODUCER) from the hand-over to the broker's answer.

Each is a child of the producer's send span, so a trace shows send, schedule, fire, store
and the consumer's process spans together. Messages without a trace context make no span:
a server with spans on pays one search of each frame's bytes for the property's name.

The spans go to an OTLP/HTTP collector (``trace_endpoint``; empty: the exporter's default and
``OTEL_EXPORTER_OTLP_*`` environment variables) from a background thread with a bounded queue
(spans beyond it are dropped, never waited for). It needs the ``otel-server`` extra
(``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http``); without it a server with
spans on refuses to start, naming the extra.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

from qmq.common.errors import ConfigError
from qmq.protocol.message import ScannedMessage, decode_message, decode_properties

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

_NEEDLE: Final = b"traceparent"
_QUEUE_MAX: Final = 4096  # spans waiting for export; more are dropped
_REPEAT_S: Final = 60.0  # at most one "queue full" line this often
_EXTRA_HINT: Final = "install the otel-server extra (pip install 'qmq[otel-server]') or set trace_spans = false"


class ServerTracing:
    """The spans of one server; ``None`` stands for spans off (see ``server_tracing``)."""

    def __init__(self, provider: TracerProvider, role: str) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._tracer: Tracer = provider.get_tracer("qmq.server")
        self._trace = trace
        self._w3c = TraceContextTextMapPropagator()
        self.role = role

    # -- making spans ------------------------------------------------------------------------

    def spans_of_frame(self, operation: str, body: bytes, scanned: Sequence[ScannedMessage]) -> list[Span]:
        """A SERVER span for each message of a send frame that carries a sampled context."""
        if _NEEDLE not in body:
            return []
        spans = []
        for m in scanned:
            span = self._span_of(operation, body, m.pos, m.length, self._trace.SpanKind.SERVER)
            if span is not None:
                spans.append(span)
        return spans

    def span_of_message(self, operation: str, encoded: bytes) -> Span | None:
        """A PRODUCER span for one encoded message handed on (a delay server's hand-over)."""
        if _NEEDLE not in encoded:
            return None
        return self._span_of(operation, encoded, 0, len(encoded), self._trace.SpanKind.PRODUCER)

    def _span_of(self, operation: str, buf: bytes, pos: int, length: int, kind: Any) -> Span | None:
        try:
            fields = decode_message(buf, pos, length)
            props = decode_properties(fields.properties_raw)
        except Exception:  # a message the store refuses for its own reasons: no span for it
            return None
        traceparent = props.get("traceparent")
        if not isinstance(traceparent, str):
            return None
        carrier = {"traceparent": traceparent}
        tracestate = props.get("tracestate")
        if isinstance(tracestate, str):
            carrier["tracestate"] = tracestate
        parent = self._w3c.extract(carrier)
        if not self._trace.get_current_span(parent).get_span_context().is_valid:
            return None
        attributes: dict[str, Any] = {
            "messaging.system": "qmq",
            "messaging.operation.name": operation,
            "messaging.destination.name": fields.subject,
            "messaging.message.id": fields.message_id,
            "messaging.qmq.message.attempt": fields.times,
            "messaging.message.body.size": len(fields.body),
        }
        if fields.deliver_at_ms:
            due = datetime.fromtimestamp(fields.deliver_at_ms / 1000, UTC)
            attributes["messaging.qmq.deliver_at"] = due.isoformat(timespec="milliseconds")
        span = self._tracer.start_span(
            f"{operation} {fields.subject}", context=parent, kind=kind, attributes=attributes
        )
        if not span.is_recording():  # not sampled: nothing to end later
            return None
        return span

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's own timeout) and stop."""
        try:
            self._provider.shutdown()
        except Exception:  # a collector gone away: the spans are lost, the server stops anyway
            log.warning("exporting the last spans failed", exc_info=True)


def end_spans(spans: Sequence[Span], error: str | None = None) -> None:
    """End ``spans``; ``error`` marks them failed with that text."""
    for span in spans:
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


def server_tracing(enabled: bool, sample_ratio: float, endpoint: str, role: str, instance: str) -> ServerTracing | None:
    """The spans of a server whose config says ``trace_spans = enabled``; None when off.

    Raises ConfigError when spans are on and the ``otel-server`` extra is missing.
    """
    if not enabled:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
    except ImportError as exc:
        raise ConfigError(
            f"trace_spans = true needs OpenTelemetry's SDK and OTLP exporter ({exc}); {_EXTRA_HINT}"
        ) from None
    # Only messages whose producer's span was sampled, then thinned by trace id: a message with
    # no context (a root) makes no span at all.
    ratio = TraceIdRatioBased(sample_ratio)
    sampler = ParentBased(root=ALWAYS_OFF, remote_parent_sampled=ratio, remote_parent_not_sampled=ALWAYS_OFF)
    resource = Resource.create({"service.name": f"qmq-{role}", "service.instance.id": instance})
    provider = TracerProvider(sampler=sampler, resource=resource)
    exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=_QUEUE_MAX, schedule_delay_millis=1000))
    # the SDK warns once per span dropped from a full queue: a collector gone away must not
    # flood the server's log, so at most one such line a minute passes
    logging.getLogger("opentelemetry.sdk._shared_internal").addFilter(_OncePerMinute())
    return ServerTracing(provider, role)


class _OncePerMinute(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self._last_s = -_REPEAT_S

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Queue full"):
            return True
        now_s = time.monotonic()
        if now_s - self._last_s < _REPEAT_S:
            return False
        self._last_s = now_s
        return True
