"""DELAY_LIST's page on a manual clock: a page that reads past too many records of other
subjects stops with a cursor, and following the cursors lists every message once, by due time,
without those handed over or cancelled."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from delayhelpers import T0_MS, append, manual_clock, open_store

from qmq.delay import listing
from qmq.delay.store import DelayStore

MINUTE = 60_000


def list_all(store: DelayStore, subject: str, limit: int) -> tuple[list[str], int]:
    """Every page of ``subject``'s listing: the ids listed, and how many pages it took."""
    ids: list[str] = []
    after = None
    pages = 0
    while True:
        page, after = listing.list_pending(
            list(store.iter_buckets()), store.bucket_ms, subject.encode(), 0, 1 << 62, limit, after
        )
        pages += 1
        ids += [msgpack.unpackb(item)["message_id"] for item in page.items]
        if after is None:
            return ids, pages


def test_pages_follow_their_cursors_over_buckets_and_skip_what_is_not_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(listing, "SCAN_RECORDS_MAX", 10)
    store = open_store(tmp_path, manual_clock())
    base = T0_MS + 10 * MINUTE
    append(store, [("other", f"o{i}", base + i) for i in range(30)])  # read and skipped, 10 a page at most
    # mine, over three buckets, sent out of due order
    append(store, [("mine", f"m{i}", base + (i % 3) * MINUTE + 100 + i) for i in range(9)])
    assert store.cancel("m4", None) == 1
    ids, pages = list_all(store, "mine", limit=2)
    expected = sorted((f"m{i}" for i in range(9) if i != 4), key=lambda m: ((int(m[1:]) % 3), int(m[1:])))
    assert ids == expected
    assert pages >= 5  # 30 others at 10 a page, then 8 of mine at 2 a page
    store.close()
