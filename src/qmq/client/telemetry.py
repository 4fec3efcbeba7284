"""OpenTelemetry traces and metrics of the SDK, when the application has OpenTelemetry.

With the ``otel`` extra (``opentelemetry-api``) installed and an SDK configured by the
application (a TracerProvider and/or a MeterProvider set as the global ones), the producer
makes a span of kind PRODUCER per send and the listeners a span of kind CONSUMER per handled
message (one per delivery: a retried message has one per attempt), following OpenTelemetry's
messaging semantic conventions. The send's context travels in the message as the W3C
``traceparent`` / ``tracestate`` properties; every path that moves a message keeps its
properties (delay, retry, dead letter, resend, the gateway), so the process span of any
attempt is a child of the send that made the message.

Without OpenTelemetry installed this module imports nothing of it and ``enabled`` stays False.
Installed, the global providers are looked at when a producer or listener starts and then once
a second on its event loop until the application has set them; until then a send or a handled
message pays one test of the module global ``enabled``, and spans and metrics begin within a
second of the application setting its providers.

Metric names (documented in docs/observability.md) follow the semantic conventions where they
name one (``messaging.client.*``, ``messaging.process.duration``), ``qmq.*`` otherwise.
"""

from __future__ import annotations

import asyncio
import re
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol

from qmq import __version__
from qmq.common.errors import AlreadyProcessedError, InvalidMessageError

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    INSTALLED = True
except ImportError:  # the otel extra is not installed: the SDK runs without telemetry
    INSTALLED = False

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import Counter, Histogram, Meter, Observation
    from opentelemetry.trace import Span, Tracer

    from qmq.client.message import Message

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
SYSTEM: Final = "qmq"
_SCOPE: Final = "qmq"
_POLL_S: Final = 1.0
# what a property may hold to be passed on as an HTTP header: printable ASCII, bounded
_HEADER_VALUE: Final = re.compile(r"[\x20-\x7e]{1,512}")
# Latency buckets in seconds: from a fraction of a millisecond (a sync flush) to a slow handler.
_SECONDS_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class BufferSource(Protocol):
    """What a producer shows of its send buffer and retries (``Producer``)."""

    @property
    def buffered(self) -> int: ...
    @property
    def buffered_bytes(self) -> int: ...
    @property
    def frame_retries(self) -> int: ...


class InFlightSource(Protocol):
    """What a listener shows of the messages it holds (``Listener``)."""

    subject: str
    group: str

    @property
    def in_flight(self) -> int: ...


class _Instruments:
    """The SDK's metric instruments, made once the application has a MeterProvider."""

    def __init__(self, meter: Meter) -> None:
        self.operation_duration: Histogram = meter.create_histogram(
            "messaging.client.operation.duration",
            unit="s",
            description="Time from a send to the broker's answer (stored or failed)",
            explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
        )
        self.sent: Counter = meter.create_counter(
            "messaging.client.sent.messages",
            unit="{message}",
            description="Messages sent, by outcome: error.type is set on those that failed",
        )
        self.process_duration: Histogram = meter.create_histogram(
            "messaging.process.duration",
            unit="s",
            description="Time a listener's handler took on one message",
            explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
        )
        self.consumed: Counter = meter.create_counter(
            "messaging.client.consumed.messages",
            unit="{message}",
            description="Messages handed to a listener's handler, by outcome (qmq.outcome)",
        )
        meter.create_observable_up_down_counter(
            "qmq.producer.buffer.messages",
            callbacks=[_buffer_messages],
            unit="{message}",
            description="Messages in producers' send buffers (queued or in flight)",
        )
        meter.create_observable_up_down_counter(
            "qmq.producer.buffer.bytes",
            callbacks=[_buffer_bytes],
            unit="By",
            description="Encoded bytes in producers' send buffers",
        )
        meter.create_observable_counter(
            "qmq.producer.retries",
            callbacks=[_retries],
            unit="{frame}",
            description="Frames producers sent again after a failure that may pass",
        )
        meter.create_observable_up_down_counter(
            "qmq.consumer.in_flight",
            callbacks=[_in_flight],
            unit="{message}",
            description="Messages a listener holds: queued for its handlers or being handled",
        )
        meter.create_observable_gauge(
            "qmq.consumer.lag",
            callbacks=[_lag],
            unit="{message}",
            description="Messages of a subject its consumer group has not pulled yet (all broker groups)",
        )


class _State:
    """What this process has seen of the application's providers (they are global)."""

    def __init__(self) -> None:
        self.tracer: Tracer | None = None
        self.instruments: _Instruments | None = None
        self.producers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.listeners: weakref.WeakSet[Any] = weakref.WeakSet()
        self.lags: dict[tuple[str, str], int] = {}
        self.polling: asyncio.TimerHandle | None = None
        self.polling_loop: asyncio.AbstractEventLoop | None = None

    def poll(self) -> None:
        """Look at the global providers; set ``enabled`` once either is the application's."""
        global enabled
        if self.tracer is None and not isinstance(_trace.get_tracer_provider(), _trace.ProxyTracerProvider):
            self.tracer = _trace.get_tracer(_SCOPE, __version__)
        if self.instruments is None and _metrics_configured():
            self.instruments = _Instruments(_metrics.get_meter(_SCOPE, __version__))
        enabled = self.tracer is not None or self.instruments is not None

    def poll_while_clients(self) -> None:
        """Poll now, and every second on the running loop while clients live and a provider is
        still missing (an application may set its providers after making its clients)."""
        self.poll()
        if self.tracer is not None and self.instruments is not None:
            return
        if self.polling is not None and self.polling_loop is not None and not self.polling_loop.is_closed():
            return  # a loop polls already (one that closed polls no more: this one takes over)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.polling_loop = loop
        self.polling = loop.call_later(_POLL_S, self._again)

    def _again(self) -> None:
        self.polling = None
        if self.producers or self.listeners:
            self.poll_while_clients()


_state = _State()
enabled = False
"""Whether the application has configured a TracerProvider or a MeterProvider: the one test a
send or a handled message makes (a module global, read without a call)."""


def _metrics_configured() -> bool:
    from opentelemetry.metrics import _internal as metrics_internal

    # the API's proxy stands in until the application sets a MeterProvider
    return not isinstance(_metrics.get_meter_provider(), metrics_internal._ProxyMeterProvider)


def watch_producer(producer: BufferSource) -> None:
    """Count ``producer``'s buffer and retries in the observable metrics while it lives (on its
    event loop: the providers are looked at from there)."""
    if INSTALLED:
        _state.producers.add(producer)
        _state.poll_while_clients()


def watch_listener(listener: InFlightSource) -> None:
    """Count ``listener``'s messages in flight while it lives (on its event loop)."""
    if INSTALLED:
        _state.listeners.add(listener)
        _state.poll_while_clients()


def set_lag(subject: str, group: str, lag: int | None) -> None:
    """The latest lag of ``group`` on ``subject`` (None: no longer known, drop it)."""
    if lag is None:
        _state.lags.pop((subject, group), None)
    else:
        _state.lags[(subject, group)] = lag


def lag_wanted() -> bool:
    """Whether anyone reads the lag metric (a MeterProvider is configured)."""
    return INSTALLED and _state.instruments is not None


# --- sends ---------------------------------------------------------------------------------


class SendRecord:
    """One send being traced or measured, ended by ``finish``."""

    __slots__ = ("attributes", "span", "start_s")

    def __init__(self, span: Span | None, attributes: dict[str, Any], start_s: float) -> None:
        self.span = span
        self.attributes = attributes
        self.start_s = start_s

    def finish(self, error: BaseException | None) -> None:
        duration_s = time.perf_counter() - self.start_s
        span = self.span
        if span is not None:
            if error is not None:
                span.record_exception(error)
                span.set_status(_trace.Status(_trace.StatusCode.ERROR, str(error)))
                span.set_attribute("error.type", type(error).__name__)
            span.end()
        instruments = _state.instruments
        if instruments is not None:
            attributes = self.attributes
            if error is not None:
                attributes = {**attributes, "error.type": type(error).__name__}
            instruments.operation_duration.record(duration_s, attributes)
            instruments.sent.add(1, attributes)

    def finish_future(self, fut: Any) -> None:
        """A done callback: the future of the send resolved."""
        if fut.cancelled():
            self.finish(_Cancelled("the send was cancelled"))
        else:
            self.finish(fut.exception())


class _Cancelled(Exception):
    pass


def begin_send(message: Message) -> SendRecord:
    """Start the PRODUCER span of sending ``message`` and write its context into the message's
    ``traceparent``/``tracestate`` properties. The span's parent is the current span, else the
    context the message already carries (a gateway request's ``traceparent``)."""
    subject = message.subject
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "send",
        "messaging.destination.name": subject,
    }
    span = None
    tracer = _state.tracer
    if tracer is not None:
        parent: Context | None = None
        if not _trace.get_current_span().get_span_context().is_valid:
            parent = context_of(message.get_property)
        span = tracer.start_span(
            f"send {subject}",
            context=parent,
            kind=_trace.SpanKind.PRODUCER,
            attributes={
                **attributes,
                "messaging.operation.type": "send",
                "messaging.message.id": message.message_id,
                "messaging.batch.message_count": 1,
            },
        )
        carrier: dict[str, str] = {}
        _W3C.inject(carrier, _trace.set_span_in_context(span))
        try:
            for key, value in carrier.items():
                message.set_property(key, value)
        except InvalidMessageError:  # the message has the most properties it may: sent untraced
            span.set_attribute("qmq.context_dropped", True)
    return SendRecord(span, attributes, time.perf_counter())


def context_of(get_property: Callable[[str], Any]) -> Context | None:
    """The trace context a message carries in its properties, or None."""
    traceparent = get_property(TRACEPARENT)
    if not isinstance(traceparent, str):
        return None
    carrier = {TRACEPARENT: traceparent}
    tracestate = get_property(TRACESTATE)
    if isinstance(tracestate, str):
        carrier[TRACESTATE] = tracestate
    return _W3C.extract(carrier)


def trace_headers(properties: Mapping[str, Any]) -> dict[str, str]:
    """The ``traceparent``/``tracestate`` headers of an HTTP request made for a message: the
    current span's context when there is one (a push delivery inside its process span), else
    the message's own."""
    out: dict[str, str] = {}
    if INSTALLED and _trace.get_current_span().get_span_context().is_valid:
        _W3C.inject(out)
        return out
    for key in (TRACEPARENT, TRACESTATE):
        value = properties.get(key)
        if isinstance(value, str) and _HEADER_VALUE.fullmatch(value):
            out[key] = value
    return out


# --- handling ------------------------------------------------------------------------------


def wrap_handler(
    handler: Callable[[Any], Awaitable[object]], subject: str, group: str
) -> Callable[[Any], Awaitable[object]]:
    """``handler`` inside a CONSUMER span and the handle metrics, once telemetry is configured
    (until then one test of ``enabled`` a message). Returned as it is without OpenTelemetry."""
    if not INSTALLED:
        return handler
    base = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "process",
        "messaging.destination.name": subject,
        "messaging.consumer.group.name": group,
    }

    async def handle(m: Any) -> object:
        if not enabled:
            return await handler(m)
        tracer = _state.tracer
        start_s = time.perf_counter()
        span = None
        error: BaseException | None = None
        if tracer is not None:
            span = tracer.start_span(
                f"process {subject}",
                context=context_of(m.get_property),
                kind=_trace.SpanKind.CONSUMER,
                attributes={
                    **base,
                    "messaging.operation.type": "process",
                    "messaging.message.id": m.message_id,
                    "messaging.qmq.message.attempt": m.times,
                    "messaging.message.body.size": len(m.body),
                },
            )
        try:
            if span is None:
                return await handler(m)
            with _trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                return await handler(m)
        except BaseException as exc:
            error = exc
            raise
        finally:
            _finish_handle(span, base, start_s, error)

    return handle


def _finish_handle(span: Span | None, base: dict[str, Any], start_s: float, error: BaseException | None) -> None:
    duration_s = time.perf_counter() - start_s
    outcome = "handled" if error is None or isinstance(error, AlreadyProcessedError) else "failed"
    if span is not None:
        if outcome == "failed" and error is not None:
            span.record_exception(error)
            span.set_status(_trace.Status(_trace.StatusCode.ERROR, str(error)))
            span.set_attribute("error.type", type(error).__name__)
        span.end()
    instruments = _state.instruments
    if instruments is not None:
        attributes = {**base, "qmq.outcome": outcome}
        if outcome == "failed" and error is not None:
            attributes["error.type"] = type(error).__name__
        instruments.process_duration.record(duration_s, attributes)
        instruments.consumed.add(1, attributes)


# --- observable callbacks ------------------------------------------------------------------


def _observations(values: Iterable[tuple[int, dict[str, Any]]]) -> list[Observation]:
    return [_metrics.Observation(v, a) for v, a in values]


def _buffer_messages(_options: Any) -> list[Observation]:
    return _observations([(sum(p.buffered for p in list(_state.producers)), {"messaging.system": SYSTEM})])


def _buffer_bytes(_options: Any) -> list[Observation]:
    return _observations([(sum(p.buffered_bytes for p in list(_state.producers)), {"messaging.system": SYSTEM})])


def _retries(_options: Any) -> list[Observation]:
    return _observations([(sum(p.frame_retries for p in list(_state.producers)), {"messaging.system": SYSTEM})])


def _in_flight(_options: Any) -> list[Observation]:
    totals: dict[tuple[str, str], int] = {}
    for listener in list(_state.listeners):
        key = (listener.subject, listener.group)
        totals[key] = totals.get(key, 0) + listener.in_flight
    return _observations(
        (n, {"messaging.system": SYSTEM, "messaging.destination.name": s, "messaging.consumer.group.name": g})
        for (s, g), n in totals.items()
    )


def _lag(_options: Any) -> list[Observation]:
    return _observations(
        (n, {"messaging.system": SYSTEM, "messaging.destination.name": s, "messaging.consumer.group.name": g})
        for (s, g), n in list(_state.lags.items())
    )


if INSTALLED:
    _W3C = TraceContextTextMapPropagator()
