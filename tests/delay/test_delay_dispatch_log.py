"""The dispatch log's check: an entry damaged on disk is dropped, never trusted, so its message is
handed over again after a restart instead of being lost; a dispatch log of the old format (bare
entry numbers, no header) still reads, and is written anew in the current format."""

from __future__ import annotations

import logging
import random
import struct
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np
import pytest
from delayhelpers import T0_MS, append, fire, manual_clock, open_store

from qmq.delay import dispatch_log
from qmq.delay.bucket import DISPATCH, Bucket
from qmq.delay.metrics import DelayMetrics
from qmq.delay.scheduler import Scheduler
from qmq.store.file_header import HEAD_BYTES, MAGIC

PRELOAD = 5_000


def test_each_entry_crc_is_the_crc32c_of_its_four_bytes() -> None:
    rng = random.Random(17)
    values = [0, 1, 0xFF, 0x100, 0xFFFF_FFFF, *(rng.getrandbits(32) for _ in range(500))]
    expected = [crc32c.crc32c(struct.pack("<I", v)) for v in values]
    assert dispatch_log.entry_crcs(np.array(values, dtype=np.uint32)).tolist() == expected
    for n in (1, 2, 15, 16, 17, len(values)):  # a Python loop for a few entries, numpy for more
        encoded = dispatch_log.encode(struct.pack(f"<{n}I", *values[:n]))
        assert encoded == b"".join(struct.pack("<2I", v, c) for v, c in zip(values[:n], expected, strict=False))


def test_a_written_log_reads_back_and_a_damaged_entry_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / DISPATCH
    dispatch_log.rewrite(path, np.array([4, 0, 9], dtype=np.uint32))
    raw = bytearray(path.read_bytes())
    assert raw[: len(MAGIC)] == MAGIC
    assert len(raw) == HEAD_BYTES + 3 * dispatch_log.FILE_ENTRY_BYTES
    found = dispatch_log.read(path)
    assert found.entries.tolist() == [4, 0, 9]
    assert found.clean
    raw[HEAD_BYTES + dispatch_log.FILE_ENTRY_BYTES] ^= 0x01  # entry 0 would read as 1
    path.write_bytes(bytes(raw) + b"\x07\x00\x00")  # and a torn tail
    found = dispatch_log.read(path)
    assert found.entries.tolist() == [4, 9]
    assert (found.damaged, found.torn_bytes, found.clean) == (1, 3, False)


@pytest.mark.parametrize("entries", [[], [3, 0]])
@pytest.mark.parametrize("at", range(0, HEAD_BYTES - 3))
def test_a_damaged_header_never_turns_the_log_into_other_entries(tmp_path: Path, at: int, entries: list[int]) -> None:
    """Read as the old format, a version-2 file's CRCs and its header's version (2) would be
    entry numbers; read by head_bytes, a garbled version would stop the server."""
    path = tmp_path / DISPATCH
    dispatch_log.rewrite(path, np.array(entries, dtype=np.uint32))
    raw = bytearray(path.read_bytes())
    raw[at : at + 8] = bytes(x ^ 0xA5 for x in raw[at : at + 8])
    path.write_bytes(bytes(raw))
    found = dispatch_log.read(path)
    assert set(found.entries.tolist()) <= set(entries)
    assert found.header_damaged
    assert not found.clean
    if at + 8 <= HEAD_BYTES:
        assert found.entries.tolist() == entries


def test_a_dispatch_log_of_the_old_format_still_reads(tmp_path: Path) -> None:
    path = tmp_path / DISPATCH
    path.write_bytes(struct.pack("<3I", 2, 0, 5) + b"\x01")  # bare u32s, as qmq wrote before, torn
    found = dispatch_log.read(path)
    assert found.entries.tolist() == [2, 0, 5]
    assert (found.version, found.damaged, found.torn_bytes) == (1, 0, 1)


def _old_format(path: Path) -> None:
    path.write_bytes(struct.pack("<2I", 2, 0))


def _header_flipped(path: Path) -> None:
    dispatch_log.rewrite(path, np.array([2, 0], dtype=np.uint32))
    raw = bytearray(path.read_bytes())
    raw[8:16] = bytes(x ^ 0xA5 for x in raw[8:16])  # its kind and version
    path.write_bytes(bytes(raw))


def _torn(path: Path) -> None:
    dispatch_log.rewrite(path, np.array([2, 0], dtype=np.uint32))
    path.write_bytes(path.read_bytes() + b"\x05\x00")


@pytest.mark.parametrize("make", [_old_format, _header_flipped, _torn])
def test_appending_to_a_log_not_as_this_version_writes_it_writes_it_anew_first(
    tmp_path: Path, make: Callable[[Path], None]
) -> None:
    b = Bucket(tmp_path, T0_MS)
    b.create()
    make(b.directory / DISPATCH)
    b.append_dispatch(struct.pack("<I", 5))
    b.append_dispatch(struct.pack("<2I", 7, 1))
    b.close()
    found = dispatch_log.read(b.directory / DISPATCH)
    assert found.entries.tolist() == [2, 0, 5, 7, 1]
    assert found.clean
    assert (b.directory / DISPATCH).read_bytes()[: len(MAGIC)] == MAGIC


@pytest.mark.parametrize(
    "damage",
    ["entry 0 turned into entry 1", "its CRC flipped", "8 bytes flipped"],
)
def test_a_damaged_dispatch_entry_is_handed_over_again_never_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """The fault campaign's loss (corruption, dispatch log flipped): with bare entry numbers,
    entry 0 (handed over) flipped into entry 1 (not yet due) made recovery take b for done."""
    clock = manual_clock()
    store = open_store(tmp_path, clock, preload_ms=PRELOAD)
    sched = Scheduler(store, PRELOAD)
    append(store, [("s", "a", T0_MS + 1000), ("s", "b", T0_MS + 30_000), ("s", "c", T0_MS + 40_000)])
    clock.advance(2)
    assert fire(sched, clock) == ["a"]
    path = store.buckets[T0_MS].directory / DISPATCH
    store.close()

    raw = bytearray(path.read_bytes())
    at = HEAD_BYTES if raw.startswith(MAGIC) else 0  # where entry 0 is, in either format
    if damage == "entry 0 turned into entry 1":
        raw[at] ^= 0x01
    elif damage == "its CRC flipped":
        raw[at + 4] ^= 0x40
    else:
        raw[at : at + 8] = bytes(x ^ 0xA5 for x in raw[at : at + 8])
    path.write_bytes(bytes(raw))

    with caplog.at_level(logging.WARNING, logger="qmq.delay.bucket"):
        store = open_store(tmp_path, clock, preload_ms=PRELOAD)
    sched = Scheduler(store, PRELOAD)
    clock.advance(45)
    assert sorted(fire(sched, clock)) == ["a", "b", "c"], "a again (at least once), and b never lost"
    metrics = DelayMetrics()
    metrics.watch(sched, lambda: None)
    assert b"qmq_delay_dispatch_entries_damaged_total 1.0" in metrics.render()
    warnings = [r for r in caplog.records if "failed their CRC check" in r.getMessage()]
    assert len(warnings) == 1
    assert str(path) in warnings[0].getMessage()
    found = dispatch_log.read(path)
    assert found.clean  # recovery wrote it anew without the damaged entry
    assert sorted(found.entries.tolist()) == [0, 1, 2]
    store.close()


def test_a_bucket_whose_dispatch_log_has_the_old_format_keeps_what_it_names(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, preload_ms=PRELOAD)
    append(store, [("s", "a", T0_MS + 1000), ("s", "b", T0_MS + 30_000), ("s", "c", T0_MS + 40_000)])
    path = store.buckets[T0_MS].directory / DISPATCH
    store.close()
    path.write_bytes(struct.pack("<2I", 2, 0))  # a and c handed over, written by the qmq before

    store = open_store(tmp_path, clock, preload_ms=PRELOAD)
    assert store.pending_total == 1
    assert store.schedule.dispatch_entries_damaged == 0
    found = dispatch_log.read(path)
    assert found.clean  # written anew in the current format
    assert sorted(found.entries.tolist()) == [0, 2]
    sched = Scheduler(store, PRELOAD)
    clock.advance(45)
    assert fire(sched, clock) == ["b"]
    store.close()
