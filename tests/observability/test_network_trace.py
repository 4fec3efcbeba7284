"""`qmq trace MESSAGE_ID --meta-server URL`: each broker group tells what its files hold of a
message (TRACE), with no data directory and no Spark — stored, pulled by which consumer,
acknowledged, retried with the handler's error, dead-lettered, resent."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from qmq.aio import Consumer, Producer, ReceivedMessage
from qmq.broker.trace import id_time_ms
from qmq.testing import ReadyProcess

pytestmark = pytest.mark.integration


def run_qmq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qmq", *args], capture_output=True, text=True, timeout=60, check=False)


def trace(meta_server: str, message_id: str, *more: str) -> subprocess.CompletedProcess[str]:
    return run_qmq("trace", message_id, "--meta-server", meta_server, *more)


@pytest.mark.timeout(120)
async def test_a_failed_message_is_traced_from_its_store_through_its_retry_to_the_dead_letters(
    shared_standalone: ReadyProcess, subject: str
) -> None:
    meta = shared_standalone.meta_server
    attempts: list[int] = []
    handled = asyncio.Event()
    async with Producer(app_code="tracer", meta_server=meta) as producer:
        failing = producer.generate_message(subject)
        fine = producer.generate_message(subject)
        await producer.send(failing)
        await producer.send(fine)
    async with Consumer(app_code="tracer", meta_server=meta, consumer_id="c-trace") as consumer:

        @consumer.listener(subject, "billing", start_from="earliest", max_retries=1, retry_backoff=[0])
        async def handle(m: ReceivedMessage) -> None:
            if m.message_id == failing.message_id:
                attempts.append(m.times)
                if len(attempts) == 2:
                    handled.set()
                raise RuntimeError(f"card declined #{len(attempts)}")

        await asyncio.wait_for(handled.wait(), 60)
        await consumer.flush_acks()
        # the dead letter is written once the second failure is settled: wait for it in the trace
        for _ in range(100):
            done = await asyncio.to_thread(trace, meta, failing.message_id, "--json")
            assert done.returncode == 0, done.stderr
            doc = json.loads(done.stdout)
            if any(e["event"] == "dead_lettered" for e in doc["events"]):
                break
            await asyncio.sleep(0.2)  # polling the brokers' own record
    assert doc["message_id"] == failing.message_id
    assert doc["subject"] == subject
    assert doc["stored"]["subject"] == subject
    assert doc["stored"]["at"].endswith("Z")
    events = doc["events"]
    kinds = [e["event"] for e in events]
    assert "retried" in kinds
    assert "dead_lettered" in kinds
    [retried] = [e for e in events if e["event"] == "retried"]
    assert (retried["group"], retried["attempt"]) == ("billing", 2)
    assert "card declined #1" in retried["error"]
    [dead] = [e for e in events if e["event"] == "dead_lettered"]
    assert dead["group"] == "billing"
    assert "card declined #2" in dead["error"]
    # each failed delivery is a nack: by which consumer, which attempt, the handler's error
    nacked = [e for e in events if e["event"] == "nacked"]
    assert [(e["attempt"], e["group"], e["consumer_id"]) for e in nacked] == [
        (1, "billing", "c-trace"),
        (2, "billing", "c-trace"),
    ]
    assert "card declined #1" in nacked[0]["error"]
    assert "card declined #2" in nacked[1]["error"]
    assert kinds.index("nacked") < kinds.index("retried") < kinds.index("dead_lettered"), kinds
    pulled = [e for e in events if e["event"] == "pulled"]
    assert {e["consumer_id"] for e in pulled} == {"c-trace"}
    assert all(e["at"].endswith("Z") for e in pulled), "the action log tells when"
    assert {e["subject"] for e in pulled} == {subject, f"%RETRY%{subject}%billing"}, "both copies were pulled"
    # a resent dead letter: "resent" (when, which group) after the dead letter, which is removed
    resend = await asyncio.to_thread(
        run_qmq, "resend-dead", subject, "--group", "billing", "--message-id", failing.message_id, "--meta-server", meta
    )
    assert resend.returncode == 0, resend.stderr
    assert "resent 1 dead letter" in resend.stdout
    done = trace(meta, failing.message_id, "--json")
    assert done.returncode == 0, done.stderr
    events = json.loads(done.stdout)["events"]
    kinds = [e["event"] for e in events]
    assert kinds.count("resent") == 1, kinds
    assert kinds.count("retried") == 1, kinds  # the resent copy is not one more failed attempt
    [resent] = [e for e in events if e["event"] == "resent"]
    [dead] = [e for e in events if e["event"] == "dead_lettered"]
    assert resent["group"] == "billing"
    assert resent["at"] >= dead["at"], (dead, resent)
    assert kinds.index("resent") > kinds.index("dead_lettered"), kinds
    assert dead["removed"]
    text = trace(meta, failing.message_id)
    assert any(line.strip().startswith("resent") and "group billing" in line for line in text.stdout.splitlines())
    # the message that was handled: pulled and acknowledged; as text too
    done = trace(meta, fine.message_id)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"message {fine.message_id}"
    assert any(line.strip().startswith("stored") and subject in line for line in lines)
    assert any(line.strip().startswith("pulled") and "consumer c-trace" in line for line in lines)
    assert any(line.strip().startswith("acked") and "group billing" in line for line in lines)
    done = trace(meta, fine.message_id, "--json")
    events = json.loads(done.stdout)["events"]
    [pull] = [e for e in events if e["event"] == "pulled"]
    [ack] = [e for e in events if e["event"] == "acked"]
    assert pull["at"] <= ack["at"], (pull, ack)


def test_an_unknown_id_is_said_to_be_held_nowhere(shared_standalone: ReadyProcess) -> None:
    done = trace(shared_standalone.meta_server, "no-such-message-id")
    assert done.returncode == 0, done.stderr
    assert "no broker group holds it" in done.stdout


def test_the_time_in_an_sdk_id_is_read() -> None:
    assert id_time_ms("261124183137632.7357e9.5634.1") == 1_795_545_097_632
    assert id_time_ms("order-42") is None
    assert id_time_ms("999999999999999.x") is None
