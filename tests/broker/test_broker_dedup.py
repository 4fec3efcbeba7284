"""The broker's duplicate window through a running broker: a repeated message id is dropped
while it is remembered, and it is remembered for a bounded time (``dedup_window_ms``) and a
bounded number of ids (``dedup_entries_max``), whichever ends first. Ids are kept in
generations of a quarter of either bound (qmq.store.dedup): an id is forgotten within a
quarter past the bound, once later sends begin new generations."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from rawclient import RawClient, broker_client, message, split_records

from qmq.protocol.answers import answer_of
from qmq.protocol.message import decode_message

pytestmark = pytest.mark.integration

WINDOW_MS = 3_000
ENTRIES_MAX = 8


def _send(client: RawClient, subject: str, message_id: str) -> int:
    """Send one message in a frame of its own; the duplicates the broker counted in it."""
    answer = client.send(message(subject, message_id))
    doc = answer_of(answer)
    assert doc["errors"] == [], doc
    duplicates: int = doc["duplicates"]
    return duplicates


def _stored_ids(client: RawClient, subject: str) -> list[str]:
    """Every message id stored for ``subject``, in order (a new group reads from the start)."""
    ids: list[str] = []
    group = f"audit-{uuid.uuid4().hex[:8]}"
    while True:
        records = split_records(bytes(client.pull(subject, group, max_n=100).body))
        if not records:
            return ids
        ids.extend(decode_message(m).message_id for _seq, m in records)


def test_a_repeat_is_dropped_within_the_window_and_stored_again_after_it(tmp_path: Path, subject: str) -> None:
    with broker_client(tmp_path, {"dedup_window_ms": WINDOW_MS}) as client:
        first_at = time.monotonic()
        assert _send(client, subject, "m") == 0
        # later sends, every 200 ms, as any traffic would: each quarter window begins a generation
        fillers = 0
        repeated_at: float | None = None
        while time.monotonic() - first_at < 1.5 * WINDOW_MS / 1000:
            if repeated_at is None and time.monotonic() - first_at >= WINDOW_MS / 4000:
                repeated_at = time.monotonic()
                assert _send(client, subject, "m") == 1, "a repeat a quarter into the window was stored"
            fillers += 1
            assert _send(client, subject, f"filler-{fillers}") == 0
            time.sleep(0.2)  # the traffic's pace: the window is a matter of time
        assert repeated_at is not None
        assert repeated_at - first_at < WINDOW_MS / 1000, "the machine was too slow to repeat within the window"
        # a window and a half later (and a generation past it) the id is forgotten: stored again
        assert _send(client, subject, "m") == 0
        stored = _stored_ids(client, subject)
    assert stored.count("m") == 2
    assert len(stored) == 2 + fillers


def test_a_repeat_is_dropped_among_the_last_ids_and_stored_again_past_them(tmp_path: Path, subject: str) -> None:
    with broker_client(tmp_path, {"dedup_entries_max": ENTRIES_MAX}) as client:
        assert _send(client, subject, "m") == 0
        for i in range(ENTRIES_MAX // 2 - 1):
            assert _send(client, subject, f"near-{i}") == 0
        assert _send(client, subject, "m") == 1, f"a repeat among the last {ENTRIES_MAX // 2} ids was stored"
        # entries_max and a generation (a quarter of it) later, the id is forgotten: stored again
        for i in range(ENTRIES_MAX + ENTRIES_MAX // 4 + 1):
            assert _send(client, subject, f"far-{i}") == 0
        assert _send(client, subject, "m") == 0
        stored = _stored_ids(client, subject)
    assert stored.count("m") == 2
    assert stored[0] == "m"
    assert stored[-1] == "m"
