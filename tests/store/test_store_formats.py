"""Format versions: every file begins with a header naming its kind and version; files written
before headers still open; what another version wrote is refused by name, never cut."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import crc32c
import msgpack
import pytest
from test_store_send_pull import records

from conftest import append, batch, flush
from qmq.protocol.record import record_header
from qmq.store import action_log as act
from qmq.store.broker_store import BrokerStore
from qmq.store.datadir import StoreError
from qmq.store.file_header import HEAD, HEAD_BYTES, MAGIC
from qmq.store.reader import DataDirError, StoreReader

DEAD = "%DEAD_RETRY%s%g"


def data_files(root: Path) -> list[Path]:
    kinds = ("*.log", "*.cl", "*.act", "letters", "removed")
    return sorted(p for kind in kinds for p in root.rglob(kind))


def strip_headers(root: Path) -> int:
    """Rewrite every file as a qmq without headers wrote it; returns how many had one."""
    stripped = 0
    for path in data_files(root):
        raw = path.read_bytes()
        if raw.startswith(MAGIC):
            path.write_bytes(raw[HEAD_BYTES:])
            stripped += 1
    return stripped


def fill(store: BrokerStore) -> None:
    """Messages, a group with progress, and dead letters (one of them removed)."""
    append(store, batch("s", ["a", "b", "c"]))
    append(store, batch(DEAD, ["d1", "d2"]))
    flush(store)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    store.pull(gp, cp, "x", 2)
    store.ack(gp, cp, [[0, 1]])
    store.remove_dead(DEAD, [store.dead.letters(DEAD)[0].number])


def test_every_file_begins_with_a_header_naming_its_kind_and_version(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store()
    fill(store)
    store.close()
    kinds = {}
    for path in data_files(tmp_path / "broker"):
        magic, kind, version = HEAD.unpack_from(path.read_bytes())
        assert (magic, version) == (MAGIC, 1), path
        kinds[path.suffix or path.name] = kind
    assert kinds == {".log": b"MLOG", ".cl": b"CLOG", ".act": b"ALOG", "letters": b"DEAD", "removed": b"DRMV"}


def test_a_data_directory_written_before_headers_opens_as_version_1(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store(segment_bytes=64 * 1024)
    fill(store)
    store.close()
    assert strip_headers(tmp_path / "broker") == 5

    again = open_store(segment_bytes=64 * 1024)
    gp = again.progress.get("s", "g")
    assert gp is not None
    assert gp.pull_offset == 2
    cp = gp.consumers["c"]
    got = again.pull(gp, cp, "new-session", 10)
    assert got is not None
    assert [i for _s, i in records(got)] == ["b", "c"]
    assert len(again.dead.letters(DEAD)) == again.dead.live(DEAD) == 1
    # the old files are appended to as they are; new segments get headers
    for n in range(40):
        append(again, batch("s", [f"more-{n}-{i}" for i in range(10)], body=b"y" * 200))
    flush(again)
    segments = sorted((tmp_path / "broker" / "log").glob("*.log"))
    assert len(segments) > 1
    assert not segments[0].read_bytes().startswith(MAGIC)
    assert segments[-1].read_bytes().startswith(MAGIC)
    assert again.subjects["s"].next_seq == 403
    reader = StoreReader(tmp_path / "broker")
    assert reader.bounds("s") == (0, 403)
    assert sum(run.records for run in reader.iter_records("s")) == 403
    assert [d.removed for d in reader.dead_letters()] == [True, False]
    again.close()
    third = open_store(segment_bytes=64 * 1024)
    assert third.subjects["s"].next_seq == 403


def test_a_file_of_a_newer_format_version_is_refused_by_name(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store()
    fill(store)
    store.close()
    clog = next((tmp_path / "broker" / "consume").glob("s/*.cl"))
    raw = bytearray(clog.read_bytes())
    HEAD.pack_into(raw, 0, MAGIC, b"CLOG", 2)
    clog.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=rf"{clog}.* format version 2; this qmq reads consume-log segments of"):
        open_store()
    assert clog.read_bytes() == bytes(raw)
    with pytest.raises(DataDirError, match=r"format version 2"):
        StoreReader(tmp_path / "broker").bounds("s")


def test_a_record_that_passes_its_crc_but_does_not_decode_is_refused_not_cut(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store()
    append(store, batch("s", ["a", "b"]))
    flush(store)
    end = store.mlog.end
    store.close()
    seg = sorted((tmp_path / "broker" / "log").glob("*.log"))[-1]
    foreign = b"a message of a later format"
    with seg.open("ab") as fh:
        fh.write(record_header(foreign, 2, 1) + foreign)
    size = seg.stat().st_size
    with pytest.raises(StoreError, match=rf"{seg}: the record at offset {end} does not decode .*format version 1"):
        open_store()
    assert seg.stat().st_size == size  # nothing was cut


def test_an_action_that_passes_its_crc_but_does_not_decode_is_refused_not_cut(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store()
    append(store, batch("s", ["a", "b"]))
    flush(store)
    gp = store.group("s", "g", "earliest")
    store.pull(gp, gp.consumer("c"), "x", 2)
    end = store.alog.end
    store.close()
    seg = sorted((tmp_path / "broker" / "action").glob("*.act"))[-1]
    payload = msgpack.packb({"kind": "of a later version"})
    with seg.open("ab") as fh:
        fh.write(act.FRAME.pack(len(payload), crc32c.crc32c(payload)) + payload)
    size = seg.stat().st_size
    with pytest.raises(StoreError, match=rf"{seg}: the action-log frame at offset {end} passes its CRC"):
        open_store()
    assert seg.stat().st_size == size
    with pytest.raises(DataDirError, match=rf"offset {end} passes its CRC"):
        StoreReader(tmp_path / "broker").progress()
