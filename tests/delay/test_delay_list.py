"""Listing pending delay messages through real processes, with two delay groups: by due time,
merged over both groups, page after page over a backlog larger than a page, within a time
window, without cancelled ones; `qmq delay-list --json`; and a cancel that reaches whichever
group holds the message."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import msgpack
import pytest
from delaywire import delay_group, request
from test_delay_cli import qmq

from qmq.aio import Producer
from qmq.protocol.codes import RequestCode
from qmq.testing import running_role

pytestmark = pytest.mark.integration

BACKLOG = 1_300  # more than a page of the SDK's (500) and of the raw request below (100)
HOUR_MS = 3_600_000


@pytest.fixture(scope="module")
def two_delay_groups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp_path = tmp_path_factory.mktemp("list")
    with running_role(["meta", "--data-dir", str(tmp_path / "meta"), "--port", "0"]) as meta:
        url = meta.ready["meta_server"]
        with (
            running_role(["broker", "--data-dir", str(tmp_path / "broker"), "--meta-server", url]),
            running_role(["delay", "--data-dir", str(tmp_path / "d1"), "--meta-server", url, "--group", "d1"]),
            running_role(["delay", "--data-dir", str(tmp_path / "d2"), "--meta-server", url, "--group", "d2"]),
        ):
            yield url


async def send_backlog(producer: Producer, subject: str, dues_ms: list[int]) -> dict[str, int]:
    """Send messages due at ``dues_ms`` in frames of 100 (so both delay groups take some)."""
    due_of: dict[str, int] = {}
    for i in range(0, len(dues_ms), 100):
        futures = []
        for due in dues_ms[i : i + 100]:
            m = producer.generate_message(subject)
            m.set_deliver_at(due / 1000)
            due_of[m.message_id] = m.deliver_at_ms
            futures.append(producer.send_nowait(m))
        await asyncio.gather(*futures)
    return due_of


async def test_a_backlog_larger_than_a_page_is_listed_by_due_time_over_both_groups(
    two_delay_groups: str, subject: str
) -> None:
    url = two_delay_groups
    now_ms = int(time.time() * 1000)
    dues = [now_ms + HOUR_MS + i * 1_000 for i in range(BACKLOG)]
    random.Random(7).shuffle(dues)
    async with Producer(app_code="t", meta_server=url) as producer:
        due_of = await send_backlog(producer, subject, dues)
        await send_backlog(producer, subject + ".other", dues[:50])
        listed = await producer.delay_list(subject, limit=10_000)
        window = await producer.delay_list(
            subject, start=(now_ms + HOUR_MS + 100_000) / 1000, end=(now_ms + HOUR_MS + 200_000) / 1000
        )
    assert [p.message_id for p in listed] == sorted(due_of, key=lambda mid: due_of[mid])
    assert [p.due_ms for p in listed] == sorted(due_of.values())
    assert {p.group for p in listed} == {"d1", "d2"}, "one delay group took the whole backlog"
    assert all(p.copy == 0 and p.times == 1 for p in listed)
    assert [p.due_ms for p in window] == [now_ms + HOUR_MS + i * 1_000 for i in range(100, 200)]


async def test_the_raw_listing_comes_in_pages_with_a_cursor(two_delay_groups: str, subject: str) -> None:
    url = two_delay_groups
    now_ms = int(time.time() * 1000)
    async with Producer(app_code="t", meta_server=url) as producer:
        due_of = await send_backlog(producer, subject, [now_ms + HOUR_MS + i for i in range(BACKLOG)])
    # each frame of 100 went to one delay group: one may hold a single page, the other then many
    pages_of: dict[str, int] = {}
    every: list[int] = []
    for group in ("d1", "d2"):
        address = delay_group(url, group)["address"]
        seen: list[int] = []
        after = None
        pages = 0
        while True:
            header = {"subject": subject, "limit": 100, **({"after": after} if after is not None else {})}
            doc = msgpack.unpackb((await request(address, RequestCode.DELAY_LIST, header)).body)
            pages += 1
            assert len(doc["messages"]) <= 100
            seen += [item["due_ms"] for item in doc["messages"]]
            after = doc.get("next")
            if after is None:
                break
        assert seen == sorted(seen)
        assert len(seen) == len(set(seen))
        assert 0 < len(seen) < len(due_of)  # each delay group took part of the backlog
        pages_of[group] = pages
        every += seen
    assert max(pages_of.values()) > 1
    assert sorted(every) == sorted(due_of.values())  # the two groups' pages hold the backlog, once


async def test_a_cancel_reaches_the_group_that_holds_the_message_and_leaves_the_listing(
    two_delay_groups: str, subject: str
) -> None:
    url = two_delay_groups
    async with Producer(app_code="t", meta_server=url) as producer:
        due = int(time.time() * 1000) + HOUR_MS
        due_of: dict[str, int] = {}
        for i in range(20):  # one at a time: each send is its own frame, the groups take turns
            due_of |= await send_backlog(producer, subject, [due + i])
        groups = {p.message_id: p.group for p in await producer.delay_list(subject, limit=1000)}
        one_each = [next(mid for mid, g in groups.items() if g == name) for name in ("d1", "d2")]
        for mid in one_each:
            assert await producer.cancel_delay(mid) is True
        left = {p.message_id for p in await producer.delay_list(subject, limit=1000)}
    assert left == set(due_of) - set(one_each)


async def test_delay_list_command_prints_json_lines_by_due_time(two_delay_groups: str, subject: str) -> None:
    url = two_delay_groups
    now = datetime.now(UTC)
    async with Producer(app_code="t", meta_server=url) as producer:
        m = producer.generate_message(subject)
        m.set_deliver_at(now + timedelta(hours=2))
        m.add_tag("late")
        await producer.send(m)
        r = producer.generate_message(subject)
        r.set_deliver_at(now + timedelta(hours=1))
        r.set_repeat(every=timedelta(minutes=1), times=3)
        await producer.send(r)
    out = qmq("delay-list", subject, "--json", "--limit", "4", meta_server=url)
    assert out.returncode == 0, out.stderr
    docs = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(d["message_id"], d["copy"]) for d in docs] == [
        (r.message_id, 1),
        (r.message_id, 2),
        (r.message_id, 3),
        (m.message_id, 0),
    ]
    assert docs[3]["tags"] == ["late"]
    window = qmq(
        "delay-list",
        subject,
        "--json",
        "--from",
        "90m",
        "--to",
        (now + timedelta(hours=3)).isoformat(),
        meta_server=url,
    )
    assert window.returncode == 0, window.stderr
    assert [json.loads(line)["message_id"] for line in window.stdout.splitlines()] == [m.message_id]
    text = qmq("delay-list", subject, "--to", "1h30m", meta_server=url)
    assert text.returncode == 2, "1h30m is not a duration qmq reads"
    assert "--to" in text.stderr
    plain = qmq("delay-list", subject, "--limit", "1", meta_server=url)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.splitlines()[1].split("\t")[1] == r.message_id


def test_the_blocking_producer_lists(two_delay_groups: str, subject: str) -> None:
    import qmq as blocking

    with blocking.Producer(app_code="t", meta_server=two_delay_groups) as producer:
        sent = []
        for minutes in (30, 10, 20):
            m = producer.generate_message(subject)
            m.set_delay(timedelta(minutes=minutes))
            producer.send(m)
            sent.append(m)
        listed = producer.delay_list(subject, end=datetime.now(UTC) + timedelta(minutes=25), limit=10)
    assert [p.message_id for p in listed] == [sent[1].message_id, sent[2].message_id]
    assert listed[0].due_at < listed[1].due_at
