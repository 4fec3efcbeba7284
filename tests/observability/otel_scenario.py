"""Run in a child process by the tracing tests, so the OpenTelemetry SDK's global providers never
leak into the rest of the suite: ``python otel_scenario.py MODE META_SERVER SUBJECT``.

MODE ``trace``: an application span sends one message due in 0.5 s; the listener fails it twice
(each retry due 0.3 s later, so the delay server holds it each time) and handles it the third
time, inside a span of its own. Prints the finished spans as one JSON list.

MODE ``dead``: an application span sends one message; the listener fails it until it is a dead
letter (two attempts), the scenario resends it (``qmq resend-dead``) and the listener handles the
resent copy. Prints the finished spans.

MODE ``blocking``: the same through the blocking SDK (``send``, ``send_async``, a plain handler
run in the listener thread pool); prints the spans.

MODE ``metrics``: sends 20 messages, fails one attempt, handles the rest; prints the metrics
the SDK's in-memory reader collected as ``{name: [{attributes, value | count | sum}]}``.

MODE ``plain`` (OpenTelemetry installed, no SDK configured) and ``absent`` (its import made to
fail): one message sent and handled; prints ``{properties, otel_modules}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

MODE, META_SERVER, SUBJECT = sys.argv[1:4]

if MODE == "absent":
    # as if the otel extra were not installed: every import of opentelemetry fails
    for name in ("opentelemetry", "opentelemetry.trace", "opentelemetry.metrics"):
        sys.modules[name] = None  # type: ignore[assignment]

exporter: Any = None
reader: Any = None
if MODE in ("trace", "blocking", "dead"):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
elif MODE == "metrics":
    from opentelemetry import metrics
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

from qmq.aio import Consumer, Producer, ReceivedMessage  # noqa: E402  (after the providers)


async def trace_run() -> None:
    from opentelemetry import trace

    app = trace.get_tracer("app")
    attempts: list[int] = []
    done = asyncio.Event()
    async with Consumer(app_code="otel", meta_server=META_SERVER) as consumer:

        @consumer.listener(SUBJECT, "g", start_from="earliest", retry_backoff=[0.3], max_retries=5)
        async def handle(m: ReceivedMessage) -> None:
            attempts.append(m.times)
            if len(attempts) < 3:
                raise RuntimeError(f"attempt {len(attempts)} fails on purpose")
            with app.start_as_current_span("app work"):
                pass
            done.set()

        async with Producer(app_code="otel", meta_server=META_SERVER) as producer:
            with app.start_as_current_span("app request"):
                m = producer.generate_message(SUBJECT)
                m.set_delay(0.5)
                await producer.send(m)
        await asyncio.wait_for(done.wait(), 30)
    print(json.dumps(_finished_spans()))


def _finished_spans() -> list[dict[str, Any]]:
    return [
        {
            "name": s.name,
            "kind": s.kind.name,
            "trace_id": f"{s.context.trace_id:032x}",
            "span_id": f"{s.context.span_id:016x}",
            "parent_id": f"{s.parent.span_id:016x}" if s.parent is not None else None,
            "attributes": dict(s.attributes or {}),
            "status": s.status.status_code.name,
            "start_ns": s.start_time,
            "end_ns": s.end_time,
        }
        for s in exporter.get_finished_spans()
    ]


def blocking_run() -> None:
    """The blocking SDK: send() and send_async() in the caller's span, a plain handler in the pool."""
    import threading

    from opentelemetry import trace

    import qmq

    app = trace.get_tracer("app")
    handled = threading.Event()
    seen: list[str] = []
    with qmq.Producer(app_code="otel", meta_server=META_SERVER) as producer:
        with app.start_as_current_span("app request"):
            producer.send(producer.generate_message(SUBJECT))
            producer.send_async(producer.generate_message(SUBJECT)).result(30)
        with qmq.Consumer(app_code="otel", meta_server=META_SERVER) as consumer:

            @consumer.listener(SUBJECT, "g", start_from="earliest")
            def handle(m: qmq.ReceivedMessage) -> None:
                with app.start_as_current_span("app work"):
                    seen.append(m.message_id)
                if len(seen) == 2:
                    handled.set()

            assert handled.wait(30)
    print(json.dumps(_finished_spans()))


async def metrics_run() -> None:
    from qmq.client import lag_watch

    lag_watch.LAG_REFRESH_S = 0.2  # the consumer's lag is asked for five times a second here
    handled = 0
    done = asyncio.Event()
    failed_once = False
    async with Consumer(app_code="otel", meta_server=META_SERVER) as consumer:

        @consumer.listener(SUBJECT, "g", start_from="earliest", retry_backoff=[0.05])
        async def handle(m: ReceivedMessage) -> None:
            nonlocal handled, failed_once
            if not failed_once:
                failed_once = True
                raise RuntimeError("the first attempt fails on purpose")
            handled += 1
            if handled == 20:
                done.set()

        async with Producer(app_code="otel", meta_server=META_SERVER) as producer:
            await asyncio.gather(*(producer.send(producer.generate_message(SUBJECT)) for _ in range(20)))
        await asyncio.wait_for(done.wait(), 30)
        # the consumer is still open: its lag and in-flight gauges are read now, once its lag
        # watch has seen every message pulled
        for _ in range(100):
            data = reader.get_metrics_data()
            if _lag_points(data) == [0]:
                break
            await asyncio.sleep(0.1)  # the lag watch's next refresh
    out: dict[str, list[dict[str, Any]]] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points = out.setdefault(metric.name, [])
                for p in metric.data.data_points:
                    point: dict[str, Any] = {"attributes": dict(p.attributes or {}), "unit": metric.unit}
                    for field in ("value", "count", "sum"):
                        if hasattr(p, field):
                            point[field] = getattr(p, field)
                    points.append(point)
    print(json.dumps(out))


def _lag_points(data: Any) -> list[Any]:
    return [
        p.value
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for metric in sm.metrics
        if metric.name == "qmq.consumer.lag"
        for p in metric.data.data_points
        if dict(p.attributes).get("messaging.destination.name") == SUBJECT
    ]


async def late_run() -> None:
    """The application sets its TracerProvider after its producer started: spans begin within the
    SDK's poll period. Prints ``{"untraced_first": bool, "sends_until_traced": n}``."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    late = InMemorySpanExporter()
    async with Producer(app_code="otel", meta_server=META_SERVER) as producer:
        first = producer.generate_message(SUBJECT)
        await producer.send(first)
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(late))
        trace.set_tracer_provider(provider)
        sends = 0
        while not late.get_finished_spans() and sends < 100:
            await producer.send(producer.generate_message(SUBJECT))
            sends += 1
            await asyncio.sleep(0.1)  # the pace of the sends, until the SDK's once-a-second poll sees the provider
    print(json.dumps({"untraced_first": first.get_property("traceparent") is None, "sends_until_traced": sends}))


async def dead_run() -> None:
    import subprocess

    from opentelemetry import trace

    app = trace.get_tracer("app")
    resent = False
    done = asyncio.Event()

    def qmq_cli(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "qmq", *args, "--meta-server", META_SERVER],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout

    async with Consumer(app_code="otel", meta_server=META_SERVER) as consumer:

        @consumer.listener(SUBJECT, "g", start_from="earliest", retry_backoff=[0], max_retries=1)
        async def handle(m: ReceivedMessage) -> None:
            if not resent:
                raise RuntimeError("fails until it is a dead letter")
            done.set()

        async with Producer(app_code="otel", meta_server=META_SERVER) as producer:
            with app.start_as_current_span("app request"):
                m = producer.generate_message(SUBJECT)
                await producer.send(m)
        for _ in range(300):  # the listener's second failure makes the dead letter
            listed = await asyncio.to_thread(qmq_cli, "dead-letters", SUBJECT, "--group", "g", "--json")
            if m.message_id in listed:
                break
            await asyncio.sleep(0.1)  # polling the broker's own record
        resent = True
        await asyncio.to_thread(qmq_cli, "resend-dead", SUBJECT, "--group", "g", "--message-id", m.message_id)
        await asyncio.wait_for(done.wait(), 30)
    print(json.dumps(_finished_spans()))


async def plain_run() -> None:
    got: list[dict[str, Any]] = []
    done = asyncio.Event()
    async with Consumer(app_code="otel", meta_server=META_SERVER) as consumer:

        @consumer.listener(SUBJECT, "g", start_from="earliest")
        async def handle(m: ReceivedMessage) -> None:
            got.append({k: v for k, v in m.properties.items() if isinstance(v, str)})
            done.set()

        async with Producer(app_code="otel", meta_server=META_SERVER) as producer:
            await producer.send(producer.generate_message(SUBJECT))
        await asyncio.wait_for(done.wait(), 30)
    otel = sorted(name for name, mod in sys.modules.items() if name.startswith("opentelemetry") and mod is not None)
    print(json.dumps({"properties": got[0], "otel_modules": otel}))


if MODE == "blocking":
    blocking_run()
else:
    runs = {
        "trace": trace_run,
        "dead": dead_run,
        "metrics": metrics_run,
        "plain": plain_run,
        "absent": plain_run,
        "late": late_run,
    }
    asyncio.run(runs[MODE]())
