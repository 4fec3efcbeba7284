"""The store's parts alone, each built from its own inputs without a BrokerStore: subjects
and their visibility, the duplicate window and its marks, the action log's one replay, the
consume-log format, the indexer and pulls."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from qmq.common.errors import InvalidSubjectError
from qmq.common.limits import DEFAULT_LIMITS
from qmq.protocol.message import encode_message, scan_batch
from qmq.protocol.record import RECORD_HEADER_BYTES, pack_record_into
from qmq.store import action_log as act
from qmq.store.action_log import ActionLog, ProgressLog, apply_action, read_frame
from qmq.store.consume_log import (
    ENTRY,
    ENTRY_DTYPE,
    FIELD_OFFSET,
    FIELD_STORED_MS,
    ConsumeLog,
    first_seq_reaching,
)
from qmq.store.dead_letters import DeadLetters
from qmq.store.dedup import DedupWindow, dedup_key
from qmq.store.held import HELD_SEQUENCE, HeldMessages
from qmq.store.indexer import RecordIndexer
from qmq.store.message_log import MessageLog
from qmq.store.progress import Progress
from qmq.store.subjects import Subjects
from qmq.store.take import Pulls

NOW_MS = 1_700_000_000_000


def message(subject: str, mid: str, times: int = 0, deliver_at_ms: int = 0) -> bytes:
    return encode_message(subject.encode(), mid.encode(), b"", 0, b"", b"body", NOW_MS, deliver_at_ms, times)


def subjects_in(tmp_path: Path) -> Subjects:
    return Subjects(tmp_path / "consume", 1024, DEFAULT_LIMITS, files_max=100)


# -- subjects ----------------------------------------------------------------------------


def test_a_raw_subject_name_is_checked_once_and_found_by_name(tmp_path: Path) -> None:
    subjects = subjects_in(tmp_path)
    st = subjects.for_raw(b"order.created")
    assert subjects.for_raw(b"order.created") is st
    assert subjects.get("order.created") is st
    assert [s.name for s in subjects] == ["order.created"]
    with pytest.raises(InvalidSubjectError, match="UTF-8"):
        subjects.for_raw(b"\xff\xfe")
    with pytest.raises(InvalidSubjectError):
        subjects.for_raw(b"has space")
    assert subjects.dead_name(b"%DEAD_RETRY%order.created%g") == "%DEAD_RETRY%order.created%g"
    with pytest.raises(InvalidSubjectError):
        subjects.dead_name(b"%DEAD_RETRY%no-group")


def test_a_subjects_consume_log_is_found_again_by_its_directory(tmp_path: Path) -> None:
    subjects = subjects_in(tmp_path)
    subjects.state("a/b")  # a name that is escaped on disk
    subjects.close()
    (tmp_path / "consume" / "stray").mkdir()
    again = subjects_in(tmp_path)
    assert again.open_all() == [tmp_path / "consume" / "stray"]
    assert list(again.by_name) == ["a/b"]


def test_a_new_subject_is_one_directory_and_one_segment_file_and_is_found_again_by_its_name(tmp_path: Path) -> None:
    subjects = subjects_in(tmp_path)
    subjects.state("a/b")
    subjects.state("x" * 200)  # a name cut and hashed on disk: it says its subject in a file
    subjects.close()
    consume = tmp_path / "consume"
    assert sorted(os.listdir(consume / "a~2Fb")) == ["00000000000000000000.cl"]
    [hashed] = [d for d in os.listdir(consume) if "~~" in d]
    assert sorted(os.listdir(consume / hashed)) == ["00000000000000000000.cl", "subject"]
    (consume / "empty").mkdir()  # a directory without a segment is no consume log
    again = subjects_in(tmp_path)
    assert again.open_all() == [consume / "empty"]
    assert sorted(again.by_name) == ["a/b", "x" * 200]


def test_a_consume_log_written_with_a_subject_file_is_named_by_it(tmp_path: Path) -> None:
    subjects = subjects_in(tmp_path)
    subjects.state("s")
    subjects.close()
    # an older directory name (another escaping) with its subject file, as qmq wrote them before
    (tmp_path / "consume" / "s").rename(tmp_path / "consume" / "old-name")
    (tmp_path / "consume" / "old-name" / "subject").write_text("s")
    again = subjects_in(tmp_path)
    assert again.open_all() == []
    assert again.by_name["s"].clog.directory == tmp_path / "consume" / "old-name"


def test_under_the_sync_policy_messages_become_visible_when_their_batch_is_flushed(tmp_path: Path) -> None:
    subjects = subjects_in(tmp_path)
    st = subjects.state("s")
    st.next_seq = 3
    subjects.publish({st: 0}, log_end=300, nbytes=300, sync_policy=True, visible_now=False)
    assert (st.visible_seq, subjects.unflushed_bytes) == (0, 300)
    st.next_seq = 4
    # a copy of a held record, durable already, still waits behind the batch before it
    subjects.publish({st: 3}, log_end=400, nbytes=100, sync_policy=True, visible_now=True)
    assert (st.visible_seq, subjects.unflushed_bytes) == (0, 400)
    assert subjects.flushed(299, unflushed_bytes=101) == set()
    assert subjects.flushed(300, unflushed_bytes=100) == {"s"}
    assert (st.visible_seq, subjects.unflushed_bytes) == (3, 100)
    assert subjects.flushed(400, unflushed_bytes=0) == {"s"}
    assert (st.visible_seq, subjects.unflushed_bytes) == (4, 0)
    st.next_seq = 5
    subjects.publish({st: 4}, log_end=500, nbytes=100, sync_policy=True, visible_now=True)
    assert (st.visible_seq, subjects.unflushed_bytes) == (5, 0)  # nothing earlier waits: at once
    st.next_seq = 6
    subjects.publish({st: 5}, log_end=600, nbytes=100, sync_policy=False, visible_now=False)
    assert st.visible_seq == 6


# -- the duplicate window ----------------------------------------------------------------


def test_a_duplicate_key_is_the_id_on_the_same_subject_at_the_same_attempt() -> None:
    body = message("s", "m1") + message("s", "m1") + message("t", "m1") + message("s", "m1", times=1)
    same, again, other_subject, retried = (dedup_key(sm) for sm in scan_batch(body))
    assert same == again
    assert len({same, other_subject, retried}) == 3


def test_marks_bound_how_far_back_the_window_is_rebuilt() -> None:
    window = DedupWindow(window_ms=1000, entries_max=10)
    window.begin_marks(0, 100)
    assert window.marks == [[0, 100, 0]]
    window.total_messages = 5
    window.mark(500, 200)
    window.total_messages = 12
    # the first mark is 12 messages back, past entries_max: the second one, 7 back, suffices
    assert window.rebuild_from(300) == 200
    assert window.rebuild_from(150) == 150
    window.total_messages = 30
    assert window.rebuild_from(300) == 300
    assert window.mark(2000, 300) == [[500, 200, 5], [2000, 300, 30]]  # the window left 0 behind
    assert DedupWindow(0, 10).rebuild_from(300) == 300


# -- the action log ----------------------------------------------------------------------


def test_read_frame_gives_none_for_a_torn_frame_and_refuses_a_crc_valid_non_action(tmp_path: Path) -> None:
    alog = ActionLog(tmp_path / "action")
    alog.append([act.RESET, "s", "g", 7])
    alog.append({"not": "a list"})  # type: ignore[arg-type]
    data = alog.segments.read(0, alog.end)
    first = act.frame_len(data, 0)
    assert first is not None

    def read(pos: int, size: int) -> bytes:
        return data[pos : pos + size]

    assert read_frame(read, 0) == ([act.RESET, "s", "g", 7], first)
    with pytest.raises(act.UnreadableAction, match=f"offset {first} passes its CRC"):
        read_frame(read, first)  # CRC-valid, but no action: another version's, never taken for a torn tail
    assert read_frame(lambda p, n: data[: first - 1][p : p + n], 0) is None  # partial
    damaged = bytearray(data)
    damaged[first - 1] ^= 1
    assert read_frame(lambda p, n: bytes(damaged[p : p + n]), 0) is None
    alog.close()


def test_replay_warns_only_when_asked_and_applies_what_it_knows(caplog: pytest.LogCaptureFixture) -> None:
    removed: list[tuple[str, list[int]]] = []
    actions = [
        [99, "from a later version"],
        [act.ACK, "s", "g", "c", [[0, 1]]],  # before the group exists
        [act.CREATE_GROUP, "s", "g", 5, "an item a later version added"],
        [act.PULL, "s", "g", "c", 0, [[5, 2]]],  # too short
        [act.PULL, "s", "g", "c", 0, [[5, 2]], 7],
        [act.ACK, "s", "g", "c", [[0, 1]]],
        [act.DEAD_REMOVE, "%DEAD_RETRY%s%g", [3]],
    ]
    for warn, remove_dead in ((True, lambda s, n: removed.append((s, n))), (False, None)):
        progress = Progress()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="qmq.store.action_log"):
            for action in actions:
                apply_action(progress, action, remove_dead, warn=warn)
        gp = progress.get("s", "g")
        assert gp is not None
        assert (gp.pull_offset, gp.consumers["c"].pull_log_end, gp.consumers["c"].ack_offset) == (7, 2, 1)
        assert len(caplog.records) == (3 if warn else 0)
    assert removed == [("%DEAD_RETRY%s%g", [3])]


def test_progress_changes_are_logged_and_replayed_to_the_same_state(tmp_path: Path) -> None:
    dead = DeadLetters(tmp_path / "dead")
    plog = ProgressLog(ActionLog(tmp_path / "action"), Progress(), dead.remove)
    gp = plog.create_group("s", "g", 0)
    assert plog.create_group("s", "g", 9) is gp  # logged once
    cp = gp.consumer("c")
    assert plog.record_pull(gp, cp, [[0, 3]], 3) == 0
    assert plog.ack(gp, cp, [[1, 3]]) == 0
    plog.reset(gp, 10)
    plog.remove_dead("%DEAD_RETRY%s%g", [4])
    plog.remove_dead("%DEAD_RETRY%s%g", [])  # nothing to log
    end = plog.alog.end
    plog.alog.close()
    with (tmp_path / "action" / f"{0:020d}.act").open("ab") as f:
        f.write(b"\x05\x00")  # a torn frame
    again = ProgressLog(ActionLog(tmp_path / "action"), Progress(), dead.remove)
    assert again.replay(0) == (5, 2)
    assert again.alog.end == end
    assert again.progress.snapshot() == plog.progress.snapshot()
    assert dead.boxes["%DEAD_RETRY%s%g"].removed == {4}
    again.alog.close()
    dead.close()


# -- the consume-log format --------------------------------------------------------------


def test_the_entry_struct_and_dtype_read_the_same_bytes() -> None:
    raw = ENTRY.pack(1 << 40, 128, NOW_MS, (1 << 63) | 5, 0) + ENTRY.pack(7, 1, -1, 0, 0)
    rows = np.frombuffer(raw, dtype=ENTRY_DTYPE)
    assert [tuple(int(v) for v in row) for row in rows.tolist()] == [tuple(e) for e in ENTRY.iter_unpack(raw)]


def test_a_consume_log_finds_by_time_cuts_past_the_log_and_drops_what_retention_removed(tmp_path: Path) -> None:
    clog = ConsumeLog(tmp_path / "c", "s", entries_per_segment=2)
    for seq in range(6):
        clog.append(ENTRY.pack(seq * 100, 100, NOW_MS + seq * 10, 0, 0))
    assert clog.seq_at_time(NOW_MS + 25) == 3
    assert first_seq_reaching(clog.read, 0, 6, FIELD_OFFSET, 250) == 3
    assert first_seq_reaching(clog.read, 0, 6, FIELD_STORED_MS, NOW_MS + 1000) == 6
    assert clog.cut_past(450) == 2  # entries 4 and 5 end past 450
    assert clog.next_seq == 4
    clog.delete_before_offset(300)  # the segment of entries 0-1 points before 300; 2-3 do not all
    assert (clog.min_seq, clog.next_seq) == (2, 4)
    clog.close()


# -- indexing and pulling, from the parts alone --------------------------------------------


def test_indexed_records_are_pulled_through_the_parts_alone(tmp_path: Path) -> None:
    mlog = MessageLog(tmp_path / "log", 1 << 20)
    subjects = subjects_in(tmp_path)
    dedup = DedupWindow(60_000, 1000)
    held = HeldMessages()
    dead = DeadLetters(tmp_path / "dead")
    messages = [
        (message("s", "a"), 0),
        (message("s", "later", deliver_at_ms=NOW_MS + 500), HELD_SEQUENCE),
        (message("%DEAD_RETRY%s%g", "dead"), 0),
        (message("s", "b"), 1),
    ]
    out = bytearray(sum(RECORD_HEADER_BYTES + len(m) for m, _seq in messages))
    pos = 0
    spans = []
    for m, seq in messages:
        end = pack_record_into(out, pos, m, seq, NOW_MS)
        spans.append((pos, end))
        pos = end
    mlog.append(out)
    indexer = RecordIndexer(subjects, dedup, held, dead, 0)
    for (start, end), (_m, seq) in zip(spans, messages, strict=True):
        indexer.add(start, seq, NOW_MS, out[start + RECORD_HEADER_BYTES : end])
    assert indexer.finish() == {"s"}
    assert (indexer.rebuilt, len(held), dedup.total_messages, len(dedup)) == (2, 1, 4, 4)
    assert dead.live("%DEAD_RETRY%s%g") == 1
    st = subjects.state("s")
    st.visible_seq = st.next_seq

    plog = ProgressLog(ActionLog(tmp_path / "action"), Progress(), dead.remove)
    pulls = Pulls(mlog, plog, bytes_max=1 << 20, ordered_lease_ms=20_000)
    gp = plog.create_group("s", "g", 0)
    got = pulls.pull(st, gp, gp.consumer("c"), "session", 10, None)
    assert got is not None
    assert (got.messages, got.runs) == (2, [[0, 2]])
    assert b"".join(got.chunks) == bytes(out[spans[0][0] : spans[0][1]]) + bytes(out[spans[3][0] : spans[3][1]])
    assert pulls.read_range(st, 1, 10)[:2] == (1, 1)
    assert pulls.read_range(None, 4, 10) == (4, 0, [])
    for closing in (mlog, plog.alog, dead, subjects):
        closing.close()
