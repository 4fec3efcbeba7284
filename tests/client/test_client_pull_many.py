"""Consumer.pull_many: many subjects in one PULL_MANY per broker group, against a real broker;
acks ride on the next one, and an ordered subscription is pulled with PULL."""

from __future__ import annotations

import asyncio
import functools
import logging

import pytest

from qmq.aio import Consumer, Message, Producer, ReceivedMessage
from qmq.client.pull_many import _parts
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.frame import Frame
from qmq.protocol.message import encode_message
from qmq.protocol.record import record_header

pytestmark = [pytest.mark.integration]


async def _send(meta_server: str, subjects: list[str], n: int) -> None:
    async with Producer(app_code="test", meta_server=meta_server) as producer:
        for subject in subjects:
            for i in range(n):
                await producer.send(Message(subject, body=f"{subject}/{i}".encode()))


async def test_one_pull_many_answers_every_subject_and_its_acks_ride_on_the_next(
    meta_server: str, subject: str
) -> None:
    subjects = [f"{subject}.{k}" for k in range(6)]
    await _send(meta_server, subjects, 4)
    async with Consumer(app_code="test", meta_server=meta_server, ack_flush_ms=60_000) as consumer:
        pcs = [consumer.pull_consumer(s, "g", "earliest") for s in subjects]
        batches = await consumer.pull_many(pcs, max_messages=1_000, per_subject_max=3)
        assert [len(b) for b in batches] == [3] * 6  # per_subject_max
        for s, batch in zip(subjects, batches, strict=True):
            assert [m.body for m in batch] == [f"{s}/{i}".encode() for i in range(3)]
            batch.ack_all()
        assert consumer.acks_pending
        batches = await consumer.pull_many(pcs, max_messages=1_000, per_subject_max=3)
        assert [[m.body for m in b] for b in batches] == [[f"{s}/3".encode()] for s in subjects]
        assert not consumer.acks_pending  # the first batches' acks went with that request
        for batch in batches:
            batch.ack_all()
        assert [len(b) for b in await consumer.pull_many(pcs)] == [0] * 6
        assert not consumer.acks_pending


async def test_the_total_bounds_one_request_and_the_rest_come_next(meta_server: str, subject: str) -> None:
    subjects = [f"{subject}.{k}" for k in range(4)]
    await _send(meta_server, subjects, 5)
    async with Consumer(app_code="test", meta_server=meta_server) as consumer:
        pcs = [consumer.pull_consumer(s, "g", "earliest") for s in subjects]
        first = await consumer.pull_many(pcs, max_messages=7, per_subject_max=5)
        assert [len(b) for b in first] == [5, 2, 0, 0]
        got = sum(len(b) for b in first)
        for _ in range(5):
            got += sum(len(b) for b in await consumer.pull_many(pcs, max_messages=7, per_subject_max=5))
        assert got == 20


async def test_an_ordered_subscription_among_them_is_pulled_with_pull(
    meta_server: str, subject: str, caplog: pytest.LogCaptureFixture
) -> None:
    # a broker refuses an ordered group in PULL_MANY (it serves those by slot, one subject a
    # request): the SDK never puts one there, and the others still come in one request
    subjects = [f"{subject}.plain", f"{subject}.ordered"]
    await _send(meta_server, subjects, 2)
    async with Consumer(app_code="test", meta_server=meta_server) as consumer:
        pcs = [
            consumer.pull_consumer(subjects[0], "g", "earliest"),
            consumer.pull_consumer(subjects[1], "g", "earliest", ordered=True),
        ]
        with caplog.at_level(logging.WARNING, logger="qmq.client.pull_many"):
            batches = await consumer.pull_many(pcs)
        assert [m.body for m in batches[0]] == [f"{subjects[0]}/{i}".encode() for i in range(2)]
        assert "refused a pull" not in caplog.text


async def test_pull_many_reads_the_retry_subjects_too(meta_server: str, subject: str) -> None:
    subjects = [f"{subject}.{k}" for k in range(3)]
    await _send(meta_server, subjects, 1)
    async with Consumer(app_code="test", meta_server=meta_server, retry_pull_interval_ms=50) as consumer:
        pcs = [consumer.pull_consumer(s, "g", "earliest", retry_backoff=[0]) for s in subjects]
        batches = await consumer.pull_many(pcs)
        assert [len(b) for b in batches] == [1, 1, 1]
        [nacked] = batches[1]
        batches[0].ack_all()
        batches[2].ack_all()
        await nacked.nack(ValueError("not now"))
        again: list[object] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not again and loop.time() < deadline:
            batches = await consumer.pull_many(pcs, timeout_ms=100)
            assert not batches[0]
            assert not batches[2]
            again = list(batches[1])
        assert len(again) == 1
        [back] = again
        assert isinstance(back, ReceivedMessage)
        assert (back.message_id, back.times, back.subject) == (nacked.message_id, 2, subjects[1])
        back.ack()


async def test_pull_many_waits_for_the_first_message_of_any_subject(meta_server: str, subject: str) -> None:
    subjects = [f"{subject}.{k}" for k in range(3)]
    async with Consumer(app_code="test", meta_server=meta_server) as consumer:
        pcs = [consumer.pull_consumer(s, "g", "earliest") for s in subjects]
        assert [len(b) for b in await consumer.pull_many(pcs)] == [0, 0, 0]  # the groups begin here
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert [len(b) for b in await consumer.pull_many(pcs, timeout_ms=300)] == [0, 0, 0]
        assert loop.time() - t0 >= 0.25  # it waited
        waiting = asyncio.ensure_future(consumer.pull_many(pcs, timeout_ms=20_000))
        await asyncio.sleep(0.2)  # the pull is parked on the broker (a send before it would do as well)
        assert not waiting.done()
        t0 = loop.time()
        await _send(meta_server, [subjects[2]], 1)
        batches = await asyncio.wait_for(waiting, 10)
        assert loop.time() - t0 < 10
        assert [[m.body for m in b] for b in batches] == [[], [], [f"{subjects[2]}/0".encode()]]


async def test_what_a_cancelled_pull_many_was_handed_comes_with_the_next(meta_server: str, subject: str) -> None:
    subjects = [f"{subject}.{k}" for k in range(2)]
    async with Consumer(app_code="test", meta_server=meta_server) as consumer:
        pcs = [consumer.pull_consumer(s, "g", "earliest") for s in subjects]
        assert [len(b) for b in await consumer.pull_many(pcs)] == [0, 0]  # the groups begin here
        waiting = asyncio.ensure_future(consumer.pull_many(pcs, timeout_ms=20_000))
        await asyncio.sleep(0.2)  # parked on the broker
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # the broker answers the parked request it still holds with this message
        await _send(meta_server, [subjects[1]], 1)
        got: list[bytes] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not got and loop.time() < deadline:
            got = [m.body for b in await consumer.pull_many(pcs, timeout_ms=100) for m in b]
        assert got == [f"{subjects[1]}/0".encode()]


async def test_the_routes_of_many_new_subjects_are_asked_for_together(meta_server: str, subject: str) -> None:
    # a consumer of hundreds of subjects it never pulled: their routes come from a few requests
    # to the meta server (up to 256 subjects each), not one request per subject
    subjects = [f"{subject}.{k}" for k in range(300)]
    async with Consumer(app_code="test", meta_server=meta_server) as consumer:
        pcs = [consumer.pull_consumer(s, "g", "earliest") for s in subjects]
        meta = consumer._ctx.meta
        asked_before = meta.refreshes
        batches = await consumer.pull_many(pcs)
        assert [len(b) for b in batches] == [0] * len(subjects)
        assert all(meta.route(s) is not None for s in subjects)
        assert meta.refreshes - asked_before <= 4, meta.refreshes - asked_before


async def test_a_flush_sends_the_acks_of_the_subjects_acked_and_looks_at_no_other(
    meta_server: str, subject: str
) -> None:
    subjects = [f"{subject}.{k}" for k in range(20)]
    await _send(meta_server, subjects, 1)
    async with Consumer(app_code="test", meta_server=meta_server, ack_flush_ms=60_000) as consumer:
        pcs = [consumer.pull_consumer(s, "g", "earliest") for s in subjects]
        batches = await consumer.pull_many(pcs, max_messages=1_000, per_subject_max=1)
        assert [len(b) for b in batches] == [1] * 20
        for batch in batches[:3]:
            batch.ack_all()
        listed = consumer._ctx.with_acks
        assert {t.subject for t in listed} == set(subjects[:3])  # what a flush looks at
        await consumer.flush_acks()
        assert not listed
        assert not consumer.acks_pending
        for batch in batches[3:]:
            batch.ack_all()
        assert len(listed) == 17
        await consumer.flush_acks()
        assert not listed
        assert not consumer.acks_pending
        # every ack took: each broker answered its subject's acknowledged prefix past the message
        assert [t.ack_offset for pc in pcs for t in pc.puller.trackers.values()] == [1] * 20


async def test_the_groups_of_a_fan_out_get_their_own_messages_of_records_carried_once(
    meta_server: str, subject: str
) -> None:
    # The broker sends the records the groups share once (PULL_MANY's "share"): each group's
    # batch still holds its own messages, acked for that group alone.
    await _send(meta_server, [subject], 5)
    async with Consumer(app_code="test", meta_server=meta_server, consumer_id="fan") as consumer:
        pcs = [consumer.pull_consumer(subject, f"g{i}", "earliest") for i in range(4)]
        batches = await consumer.pull_many(pcs, max_messages=1_000, per_subject_max=10)
        assert [[m.body for m in b] for b in batches] == [[f"{subject}/{i}".encode() for i in range(5)]] * 4
        assert len({id(b[0]) for b in batches}) == 4  # a message object each
        assert [m.sequence for m in batches[3]] == [0, 1, 2, 3, 4]
        for batch in batches[:3]:
            batch.ack_all()
        batches[3][0].ack()
        await consumer.flush_acks()
    # the same consumer again (a new session): what g3 was handed and never acked comes back
    async with Consumer(app_code="test", meta_server=meta_server, consumer_id="fan") as consumer:
        pcs = [consumer.pull_consumer(subject, f"g{i}", "earliest") for i in range(4)]
        batches = await consumer.pull_many(pcs, max_messages=1_000, per_subject_max=10)
        assert [[m.body for m in b] for b in batches] == [[], [], [], [f"{subject}/{i}".encode() for i in range(1, 5)]]


async def test_an_answer_that_shares_records_wrongly_is_refused_and_drops_the_connection(
    meta_server: str, subject: str
) -> None:
    # A broker's answer is checked: a result may share only an earlier result's records, with
    # no bytes of its own, and only as many as its runs count.
    messages = [encode_message(subject.encode(), f"id{i}".encode(), b"", 0, b"", b"x", 1) for i in range(2)]
    records = b"".join(record_header(m, seq, 1) + m for seq, m in enumerate(messages))
    async with Consumer(app_code="test", meta_server=meta_server) as consumer:
        pullers = [consumer.pull_consumer(subject, f"g{i}", "earliest").puller for i in range(2)]
        taken = [(i, p, p._tracker("bg"), []) for i, p in enumerate(pullers)]

        def answer(second: dict[str, object]) -> Frame:
            first = {"runs": [[0, 2]], "bytes": len(records)}
            return Frame(RequestCode.PULL_MANY, 1, {"results": [first, second]}, records)

        good = _parts(answer({"runs": [[5, 2]], "bytes": 0, "same": 0}), taken, "bg", lambda: None)
        assert [[m.sequence for m in b] for _i, b in good] == [[0, 1], [0, 1]]
        assert [m._offset for m in good[1][1]] == [5, 6]  # the second group's own pull offsets
        for wrong in (
            {"runs": [[0, 2]], "bytes": 0, "same": 1},  # itself, not an earlier one
            {"runs": [[0, 2]], "bytes": 0, "same": [0]},
            {"runs": [[0, 2]], "bytes": 3, "same": 0},  # bytes of its own besides
            {"runs": [[0, 3]], "bytes": 0, "same": 0},  # more than the records shared
        ):
            dropped: list[bool] = []
            with pytest.raises(RemoteProtocolError):
                _parts(answer(wrong), taken, "bg", functools.partial(dropped.append, True))
            assert dropped or wrong["runs"] == [[0, 3]], wrong  # the runs' count is the records' check


async def test_subjects_whose_entries_pass_one_frame_header_go_in_more_requests(meta_server: str, subject: str) -> None:
    # 400 subjects of 100 characters: their entries take over 64 KiB, the bound of a frame's
    # header, and the whole pull failed (LocalProtocolError) before they were split by size.
    subjects = [f"{subject}.{k:04d}.".ljust(100, "x") for k in range(400)]
    await _send(meta_server, [subjects[0], subjects[-1]], 2)
    async with Consumer(app_code="test", meta_server=meta_server) as consumer:
        group = "g".ljust(60, "g")
        pcs = [consumer.pull_consumer(s, group, "earliest") for s in subjects]
        batches = await consumer.pull_many(pcs, max_messages=1_000, per_subject_max=10)
        got = {s: [m.body for m in b] for s, b in zip(subjects, batches, strict=True) if len(b)}
        assert got == {s: [f"{s}/{i}".encode() for i in range(2)] for s in (subjects[0], subjects[-1])}
