"""OpenTelemetry traces of the SDK, read with the SDK's in-memory exporter in a child process (so
its global providers stay out of the rest of the suite): one trace from an application's span
through a send, a delay, two failed attempts and their retries, to the handler's own span; through
a dead letter and its resend; the
gateway keeps a request's traceparent; without OpenTelemetry nothing is imported."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from qmq.aio import Consumer, ReceivedMessage
from qmq.client.telemetry import trace_headers
from qmq.testing import ReadyProcess

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent


def scenario(mode: str, meta_server: str, subject: str) -> Any:
    done = subprocess.run(
        [sys.executable, str(HERE / "otel_scenario.py"), mode, meta_server, subject],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_one_trace_from_the_send_through_a_delay_and_two_retries_to_the_handler(
    meta_server: str, subject: str
) -> None:
    spans = scenario("trace", meta_server, subject)
    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    assert {s["trace_id"] for s in spans} == {spans[0]["trace_id"]}, "every span is of one trace"
    [request] = by_name["app request"]
    [send] = by_name[f"send {subject}"]
    assert send["kind"] == "PRODUCER"
    assert send["parent_id"] == request["span_id"]
    assert send["attributes"]["messaging.system"] == "qmq"
    assert send["attributes"]["messaging.destination.name"] == subject
    assert send["attributes"]["messaging.operation.type"] == "send"
    assert send["attributes"]["messaging.batch.message_count"] == 1
    message_id = send["attributes"]["messaging.message.id"]
    processes = sorted(by_name[f"process {subject}"], key=lambda s: s["start_ns"])
    assert [p["attributes"]["messaging.qmq.message.attempt"] for p in processes] == [1, 2, 3]
    for p in processes:
        assert p["kind"] == "CONSUMER"
        assert p["parent_id"] == send["span_id"], "each attempt is a child of the send"
        assert p["attributes"]["messaging.message.id"] == message_id
        assert p["attributes"]["messaging.consumer.group.name"] == "g"
    assert [p["status"] for p in processes] == ["ERROR", "ERROR", "UNSET"]
    assert processes[0]["attributes"]["error.type"] == "RuntimeError"
    # the delay (0.5 s) and each retry's back-off (0.3 s) passed between the attempts
    assert processes[0]["start_ns"] - send["start_ns"] >= 450_000_000
    assert processes[1]["start_ns"] - processes[0]["end_ns"] >= 250_000_000
    [work] = by_name["app work"]
    assert work["parent_id"] == processes[2]["span_id"], "the handler runs inside its process span"


@pytest.mark.timeout(120)
def test_a_dead_letter_resent_is_handled_in_the_trace_of_its_send(meta_server: str, subject: str) -> None:
    spans = scenario("dead", meta_server, subject)
    [send] = [s for s in spans if s["name"] == f"send {subject}"]
    processes = sorted((s for s in spans if s["name"] == f"process {subject}"), key=lambda s: s["start_ns"])
    assert [p["status"] for p in processes] == ["ERROR", "ERROR", "UNSET"], "two failures, then the resent copy"
    for p in processes:
        assert p["trace_id"] == send["trace_id"], "the context came through the dead letter and the resend"
        assert p["parent_id"] == send["span_id"]
        assert p["attributes"]["messaging.message.id"] == send["attributes"]["messaging.message.id"]


@pytest.mark.timeout(120)
def test_the_blocking_sdk_traces_in_the_callers_span_and_its_handlers_run_in_theirs(
    meta_server: str, subject: str
) -> None:
    spans = scenario("blocking", meta_server, subject)
    [request] = [s for s in spans if s["name"] == "app request"]
    sends = [s for s in spans if s["name"] == f"send {subject}"]
    processes = {s["span_id"]: s for s in spans if s["name"] == f"process {subject}"}
    works = [s for s in spans if s["name"] == "app work"]
    assert len(sends) == 2
    assert len(processes) == 2
    assert len(works) == 2
    assert all(s["parent_id"] == request["span_id"] for s in sends), "send and send_async, in the caller's span"
    assert {p["parent_id"] for p in processes.values()} == {s["span_id"] for s in sends}
    assert all(w["parent_id"] in processes for w in works), "the pool thread runs in the process span"


@pytest.mark.timeout(120)
def test_a_provider_set_after_the_producer_started_is_used_within_a_second_or_so(
    meta_server: str, subject: str
) -> None:
    out = scenario("late", meta_server, subject)
    assert out["untraced_first"]
    assert 1 <= out["sends_until_traced"] < 100


@pytest.mark.timeout(120)
def test_installed_without_an_sdk_nothing_is_added_to_a_message(meta_server: str, subject: str) -> None:
    out = scenario("plain", meta_server, subject)
    assert "traceparent" not in out["properties"]
    assert out["otel_modules"], "the API is imported when installed"


@pytest.mark.timeout(120)
def test_without_opentelemetry_nothing_of_it_is_imported_and_messages_flow(meta_server: str, subject: str) -> None:
    out = scenario("absent", meta_server, subject)
    assert out["otel_modules"] == []
    assert "traceparent" not in out["properties"]


@pytest.mark.timeout(120)
async def test_the_gateway_keeps_a_requests_traceparent_on_the_message(
    shared_standalone: ReadyProcess, meta_server: str, subject: str
) -> None:
    traceparent = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
    async with aiohttp.ClientSession() as http:
        answer = await http.post(
            f"{shared_standalone.gateway}/v1/subjects/{subject}/messages",
            json={"body": "hello"},
            headers={"traceparent": traceparent, "tracestate": "vendor=1"},
        )
        assert answer.status == 200, await answer.text()
    async with Consumer(app_code="otel", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, "g", "earliest")
        got: list[ReceivedMessage] = []
        for _ in range(10):
            got += await pull.pull(10, 2_000)
            if got:
                break
        [m] = got
        assert m.get_property("traceparent") == traceparent
        assert m.get_property("tracestate") == "vendor=1"
        # a push delivery of it passes the same context on (no span is current here)
        assert trace_headers(m.properties) == {"traceparent": traceparent, "tracestate": "vendor=1"}
        await m.ack()


def test_trace_headers_pass_on_only_printable_bounded_values() -> None:
    assert trace_headers({"traceparent": "00-ab\r\nX-Evil: 1"}) == {}
    assert trace_headers({"traceparent": "x" * 600}) == {}
    assert trace_headers({"traceparent": b"00-raw"}) == {}
