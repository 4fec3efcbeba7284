"""HTTP push through real servers: `qmq push add` (the command), the gateway of a standalone
holding the leases, and a real aiohttp receiver. Delivery with every header and a signature the
receiver verifies, retry after a 500, dead letters after the retries, bounded concurrency and
rate, a slow endpoint that does not stall another subscription, and `qmq push list`/`remove`."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import Iterator
from datetime import datetime

import pytest
from pushhelpers import Delivery, push_add, qmq_push, remove_every_subscription, running_receiver, wait_settled

from qmq.aio import Producer
from qmq.cli.admin import ask_every_broker
from qmq.gateway.push import PushService
from qmq.protocol.codes import RequestCode
from qmq.testing import ReadyProcess, running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def push_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadyProcess]:
    """A standalone of these tests alone: its gateway takes every push subscription of its meta server."""
    with running_standalone(tmp_path_factory.mktemp("push") / "qmq-data") as proc:
        yield proc


@pytest.fixture
def meta_server(push_standalone: ReadyProcess) -> Iterator[str]:
    yield push_standalone.meta_server
    remove_every_subscription(push_standalone.meta_server)


def _group() -> str:
    return f"push-{uuid.uuid4().hex[:8]}"


async def _send(meta_server: str, subject: str, n: int, body: bytes | str = "hello") -> list[str]:
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        messages = []
        for i in range(n):
            m = producer.generate_message(subject)
            m.body = body if n == 1 else f"{body}-{i}"
            messages.append(m)
        await asyncio.gather(*(producer.send(m) for m in messages))
    return [m.message_id for m in messages]


async def _dead_letters(meta_server: str, subject: str, group: str) -> int:
    answers = await ask_every_broker(meta_server, RequestCode.DEAD_LETTERS, {"subject": subject, "group": group})
    return sum(h["total"] for h in answers.values() if isinstance(h, dict))


async def test_delivers_with_every_header_and_a_signature_the_receiver_verifies(meta_server: str, subject: str) -> None:
    group = _group()
    async with running_receiver() as rx:
        push_add(subject, group, rx.url, "--secret", "k3y-s3cret", meta_server=meta_server)
        # Sent after `push add` returned and before any gateway runs the subscription: delivered.
        async with Producer(app_code="shop", meta_server=meta_server) as producer:
            m = producer.generate_message(subject)
            m.body = '{"order": 42, "name": "caf\u00e9"}'
            m.set_property("region", "eu")
            m.set_property("raw", b"\x00\xff")
            m.add_tag("vip")
            await producer.send(m)
            binary = producer.generate_message(subject)
            binary.body = b"\xff\xfe\x00"
            await producer.send(binary)
        await rx.wait_until("two deliveries", lambda: len(rx.ok()) == 2)
    by_id = {d.message_id: d for d in rx.ok()}
    assert set(by_id) == {m.message_id, binary.message_id}
    d = by_id[m.message_id]
    h = d.headers
    expected = "sha256=" + hmac.new(b"k3y-s3cret", d.body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(h["x-qmq-signature"], expected)
    assert h["x-qmq-message-id"] == m.message_id
    assert h["x-qmq-subject"] == subject
    assert h["x-qmq-group"] == group
    assert h["x-qmq-attempt"] == "1"
    assert h["content-type"] == "application/json"
    assert h["ce-specversion"] == "1.0"
    assert h["ce-id"] == m.message_id
    assert h["ce-source"] == f"/qmq/subjects/{subject}"
    assert h["ce-type"] == "io.qmq.message"
    assert datetime.fromisoformat(h["ce-time"]).timestamp() * 1000 == pytest.approx(m.created_ms, abs=1)
    assert d.doc == {
        "message_id": m.message_id,
        "subject": subject,
        "group": group,
        "times": 1,
        "created_ms": m.created_ms,
        "properties": {"region": "eu", "raw": {"base64": base64.b64encode(b"\x00\xff").decode()}},
        "tags": ["vip"],
        "body": '{"order": 42, "name": "caf\u00e9"}',
    }
    assert by_id[binary.message_id].doc["body_base64"] == base64.b64encode(b"\xff\xfe\x00").decode()
    assert "body" not in by_id[binary.message_id].doc


async def test_latest_starts_when_push_add_returns_and_earliest_takes_the_backlog(
    meta_server: str, subject: str
) -> None:
    latest, earliest = _group(), _group()
    before = await _send(meta_server, subject, 3, "before")
    async with running_receiver() as rx_latest, running_receiver() as rx_earliest:
        push_add(subject, latest, rx_latest.url, meta_server=meta_server)
        push_add(subject, earliest, rx_earliest.url, "--from", "earliest", meta_server=meta_server)
        after = await _send(meta_server, subject, 2, "after")
        await rx_earliest.wait_until("five deliveries", lambda: len(rx_earliest.ok()) == 5)
        await wait_settled(meta_server, subject, latest)
    assert sorted(d.message_id for d in rx_latest.ok()) == sorted(after)
    assert sorted(d.message_id for d in rx_earliest.ok()) == sorted(before + after)


async def test_a_500_is_retried_with_the_back_off_then_acknowledged(meta_server: str, subject: str) -> None:
    group = _group()

    async def fail_first(d: Delivery) -> int:
        return 500 if d.headers["x-qmq-attempt"] == "1" else 204

    async with running_receiver(fail_first) as rx:
        push_add(subject, group, rx.url, "--retry-backoff", "0.5", meta_server=meta_server)
        (message_id,) = await _send(meta_server, subject, 1)
        await rx.wait_until("a delivery answered 204", lambda: len(rx.ok()) == 1)
    assert [(d.message_id, d.headers["x-qmq-attempt"], d.status) for d in rx.deliveries] == [
        (message_id, "1", 500),
        (message_id, "2", 204),
    ]
    assert await _dead_letters(meta_server, subject, group) == 0


async def test_a_delivery_always_refused_ends_in_the_dead_letters(meta_server: str, subject: str) -> None:
    group = _group()

    async def refuse(_d: Delivery) -> int:
        return 503

    async with running_receiver(refuse) as rx:
        push_add(subject, group, rx.url, "--max-retries", "2", "--retry-backoff", "0.2", meta_server=meta_server)
        (message_id,) = await _send(meta_server, subject, 1)
        await rx.wait_until("three attempts", lambda: len(rx.deliveries) == 3)
        deadline = time.monotonic() + 30
        while await _dead_letters(meta_server, subject, group) != 1:
            assert time.monotonic() < deadline, "the message never reached the dead letters"
            await asyncio.sleep(0.1)  # polling the broker's dead letters, bounded by the deadline
    assert [d.headers["x-qmq-attempt"] for d in rx.deliveries] == ["1", "2", "3"]
    assert {d.message_id for d in rx.deliveries} == {message_id}
    answers = await ask_every_broker(meta_server, RequestCode.DEAD_LETTERS, {"subject": subject, "group": group})
    letters = [letter for h in answers.values() if isinstance(h, dict) for letter in h["letters"]]
    assert [letter["message_id"] for letter in letters] == [message_id]
    assert "answered HTTP 503" in letters[0]["error"]


async def test_an_answer_later_than_the_timeout_is_a_failure(meta_server: str, subject: str) -> None:
    group = _group()
    first_answered = asyncio.Event()

    async def slow_first(d: Delivery) -> int:
        if d.headers["x-qmq-attempt"] == "1":
            await asyncio.sleep(2)  # an endpoint slower than --timeout-ms 300
            first_answered.set()
        return 200

    async with running_receiver(slow_first) as rx:
        push_add(subject, group, rx.url, "--timeout-ms", "300", "--retry-backoff", "0", meta_server=meta_server)
        (message_id,) = await _send(meta_server, subject, 1)
        await rx.wait_until("a second attempt", lambda: any(d.headers["x-qmq-attempt"] == "2" for d in rx.ok()))
        await asyncio.wait_for(first_answered.wait(), 30)
    assert sorted(d.headers["x-qmq-attempt"] for d in rx.deliveries) == ["1", "2"]
    assert {d.message_id for d in rx.deliveries} == {message_id}


async def test_unreachable_url_is_a_failure_too(meta_server: str, subject: str) -> None:
    group = _group()
    async with running_receiver() as rx:
        url = rx.url
    # nothing listens at url now: a refused connection
    push_add(subject, group, url, "--max-retries", "0", meta_server=meta_server)
    (message_id,) = await _send(meta_server, subject, 1)
    deadline = time.monotonic() + 30
    while await _dead_letters(meta_server, subject, group) != 1:
        assert time.monotonic() < deadline, "the message never reached the dead letters"
        await asyncio.sleep(0.1)  # polling the broker's dead letters, bounded by the deadline
    answers = await ask_every_broker(meta_server, RequestCode.DEAD_LETTERS, {"subject": subject, "group": group})
    letters = [letter for h in answers.values() if isinstance(h, dict) for letter in h["letters"]]
    assert [letter["message_id"] for letter in letters] == [message_id]
    assert "could not be reached" in letters[0]["error"]


async def test_concurrency_is_bounded_per_subscription(meta_server: str, subject: str) -> None:
    group = _group()
    release = asyncio.Event()

    async def hold(_d: Delivery) -> int:
        await release.wait()
        return 200

    async with running_receiver(hold) as rx:
        push_add(subject, group, rx.url, "--concurrency", "3", meta_server=meta_server)
        ids = await _send(meta_server, subject, 12)
        await rx.wait_until("three deliveries held", lambda: rx.in_flight == 3)
        # the three held, nine others waiting: a fourth never starts while they are held
        assert rx.deliveries == []
        release.set()
        await rx.wait_until("all twelve delivered", lambda: len(rx.ok()) == 12)
    assert rx.max_in_flight == 3
    assert sorted(d.message_id for d in rx.ok()) == sorted(ids)


async def test_rate_bounds_how_fast_deliveries_start(meta_server: str, subject: str) -> None:
    group = _group()
    started: list[float] = []

    async def note(_d: Delivery) -> int:
        started.append(time.monotonic())
        return 200

    async with running_receiver(note) as rx:
        push_add(subject, group, rx.url, "--rate", "5", "--concurrency", "10", meta_server=meta_server)
        await _send(meta_server, subject, 6)
        await rx.wait_until("six deliveries", lambda: len(rx.ok()) == 6)
    # five gaps of at least 1/5 s each (a loaded machine only makes them longer)
    assert started[-1] - started[0] >= 5 * 0.2 - 0.05


async def test_a_slow_endpoint_does_not_stall_another_subscription(meta_server: str, subject: str) -> None:
    slow_group, fast_group = _group(), _group()
    release = asyncio.Event()

    async def hang(_d: Delivery) -> int:
        await release.wait()
        return 200

    async with running_receiver(hang) as slow, running_receiver() as fast:
        push_add(subject, slow_group, slow.url, "--concurrency", "2", "--timeout-ms", "120000", meta_server=meta_server)
        push_add(subject, fast_group, fast.url, "--concurrency", "2", meta_server=meta_server)
        ids = await _send(meta_server, subject, 20)
        await slow.wait_until("the slow endpoint holding two", lambda: slow.in_flight == 2)
        await fast.wait_until("all twenty at the fast endpoint", lambda: len(fast.ok()) == 20)
        assert slow.ok() == []  # still hanging: the fast one did not wait for it
        release.set()
        await slow.wait_until("all twenty at the slow endpoint", lambda: len(slow.ok()) == 20)
    assert sorted(d.message_id for d in fast.ok()) == sorted(ids)


async def test_push_list_and_remove(push_standalone: ReadyProcess, meta_server: str, subject: str) -> None:
    group = _group()
    async with running_receiver() as rx:
        push_add(subject, group, rx.url, "--secret", "hidden", "--tags", "a", "--tags", "b", meta_server=meta_server)
        again = qmq_push("add", subject, "--group", group, "--url", rx.url, meta_server=meta_server)
        assert again.returncode == 1
        assert "exists already" in again.stderr
        deadline = time.monotonic() + 30
        while True:
            listed = json.loads(qmq_push("list", "--json", meta_server=meta_server).stdout)
            mine = [s for s in listed["subscriptions"] if s["subject"] == subject]
            if mine and mine[0]["leased"]:
                break
            assert time.monotonic() < deadline, f"the standalone's gateway never took the lease: {mine}"
            await asyncio.sleep(0.2)  # polling the meta server, bounded by the deadline
        assert [(s["group"], s["url"], s["secret"], s["tags"]) for s in mine] == [(group, rx.url, "***", ["a", "b"])]
        assert f"-gateway-{push_standalone.ready['gateway_pid']}-" in mine[0]["owner"]
        table = qmq_push("list", meta_server=meta_server).stdout
        assert subject in table
        assert "hidden" not in table
        removed = qmq_push("remove", subject, "--group", group, meta_server=meta_server)
        assert removed.returncode == 0, removed.stderr
        listed = json.loads(qmq_push("list", "--json", meta_server=meta_server).stdout)
        assert [s for s in listed["subscriptions"] if s["subject"] == subject] == []
    gone = qmq_push("remove", subject, "--group", group, meta_server=meta_server)
    assert gone.returncode == 1
    assert "no push subscription" in gone.stderr


async def test_a_gateway_stops_a_subscription_removed_or_taken(meta_server: str, subject: str) -> None:
    """A push service in this process beside the standalone's gateway: it runs only what it holds."""
    group = _group()
    async with running_receiver() as rx:
        push_add(subject, group, rx.url, meta_server=meta_server)
        service = PushService(meta_server, lease_ms=3_000)
        await service.start()
        try:
            for _ in range(3):  # the standalone's gateway holds it, or this one does: never both
                await service.renew()
                listed = json.loads(qmq_push("list", "--json", meta_server=meta_server).stdout)
                (mine,) = [s for s in listed["subscriptions"] if s["subject"] == subject]
                assert ((subject, group) in service.runners) == (mine["owner"] == service.owner)
            removed = qmq_push("remove", subject, "--group", group, meta_server=meta_server)
            assert removed.returncode == 0, removed.stderr
            await service.renew()
            assert (subject, group) not in service.runners
        finally:
            await service.stop()


def test_bad_options_are_usage_errors(meta_server: str) -> None:
    bad = qmq_push("add", "s", "--group", "g", "--url", "ftp://x/", meta_server=meta_server)
    assert bad.returncode == 2
    assert "http:// or https://" in bad.stderr
    bad = qmq_push("add", "s", "--group", "g", "--url", "http://x/", "--retry-backoff", "1,x", meta_server=meta_server)
    assert bad.returncode == 2
    assert "seconds separated by commas" in bad.stderr
