"""A read-only view of a broker's data directory, for data jobs (Spark, archive, trace).

It never takes the broker's ``LOCK`` and never writes, truncates or deletes a file, so it is
safe to use while the broker runs. It reads what the files hold at the moment it looks:

- consume logs and the message log (layouts in ``consume_log.py``, ``message_log.py``,
  ``qmq.protocol.record``): a subject's records by sequence. Each record is checked (magic,
  CRC32C, sequence, length) and reading stops at the first one that does not check out — a
  tail being written, or a torn tail a crashed broker has not cut yet. While the broker runs,
  the last records read may not be fsynced yet.
- the action log (``action_log.py``) from its oldest kept segment, the checkpoint
  (``checkpoint.py``), and the consumer progress they give together (``progress.py``),
  replayed by the broker's own rule (``action_log.apply_action``).
- dead letters (``dead_letters.py``), with the ones resent or purged marked as removed.

Every file may begin with the header of ``file_header.py``; files written before headers have
none. A file of a format version this qmq does not read, or a record that passes its CRC but
does not decode, raises DataDirError naming it: a data job never reads past what it cannot read.

Files that retention deletes while a read runs count as gone: a read then starts at the
first record still kept.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import crc32c
import numpy as np

from qmq.common.errors import QmqError
from qmq.common.naming import subject_file_name
from qmq.protocol.record import RECORD_HEADER_BYTES, RECORD_MAGIC, read_record_header, record_crc_ok
from qmq.store import action_log as act
from qmq.store import consume_log, fileio, message_log
from qmq.store import dead_letters as dl
from qmq.store.checkpoint import newest_checkpoint
from qmq.store.consume_log import ENTRY, ENTRY_BYTES, ENTRY_DTYPE, ConsumeLog, first_seq_reaching
from qmq.store.file_header import HEAD_BYTES, FileFormatError, FileKind, head_bytes
from qmq.store.fileio import StrPath
from qmq.store.message_log import RECORD_HEADER_DTYPE
from qmq.store.progress import Progress

# A read gathers at most this many bytes of records (and the entries that point at them).
READ_BYTES_MAX = 8 * 1024 * 1024
# Re-listing segments after one vanished mid-read: retention deletes from the front, so a
# couple of tries always find the new front.
_RELIST_TRIES_MAX = 3
# Header sizes of segment files seen (a file's header never changes), to read each once.
_HEADS_CACHED_MAX = 100_000


class DataDirError(QmqError):
    """The directory is not a broker's data directory, or cannot be read."""


@dataclass(frozen=True, slots=True)
class _Seg:
    base: int
    path: Path
    size: int  # bytes of data, the header not counted
    head: int  # bytes of the header

    @property
    def end(self) -> int:
        return self.base + self.size


def _reader_of(data: bytes) -> Callable[[int, int], bytes]:
    """``read(pos, size)`` over bytes in memory."""
    return lambda pos, size: data[pos : pos + size]


def _pread(path: StrPath, size: int, offset: int) -> bytes:
    fd = fileio.open(path, os.O_RDONLY)
    try:
        return fileio.pread(fd, size, offset)
    finally:
        fileio.close(fd)


class RecordRun(NamedTuple):
    """Records of one subject, back to back as in the message log (and in a READ answer)."""

    first: int  # sequence of the first record
    records: int
    data: bytes


class ActionAt(NamedTuple):
    offset: int  # position in the action log
    action: list[Any]


@dataclass(frozen=True, slots=True)
class DeadLetterInfo:
    dead_subject: str  # %DEAD_RETRY%<subject>%<group>
    letter: int
    dead_at_ms: int
    removed: bool  # resent or purged since
    message: bytes  # the encoded message (qmq.protocol.message)


def _is_broker_dir(path: Path) -> bool:
    return (path / "log").is_dir() and (path / "consume").is_dir()


class StoreReader:
    """Reads a broker's data directory without changing it; see the module docstring."""

    def __init__(self, data_dir: str | Path) -> None:
        self.dir = Path(data_dir)
        if not _is_broker_dir(self.dir) and _is_broker_dir(self.dir / "broker"):
            self.dir = self.dir / "broker"  # the --data-dir of `qmq standalone`
        self._checked_from: int | None = None
        self._heads: dict[Path, int] = {}
        if not _is_broker_dir(self.dir):
            raise DataDirError(
                f"{str(self.dir)!r} is not a broker's data directory (no log/ and consume/ in it); "
                "pass the --data-dir a broker or `qmq standalone` was started with"
            )

    def _segments(self, directory: Path, suffix: str, kind: FileKind) -> list[_Seg]:
        out: list[_Seg] = []
        try:
            paths = sorted(directory / name for name in fileio.listdir(directory) if name.endswith(suffix))
        except OSError:
            return out
        for path in paths:
            stem = path.name[: -len(suffix)]
            if len(stem) != 20 or not stem.isdigit():
                continue
            try:
                size = path.stat().st_size
                head = self._heads.get(path)
                if head is None:
                    head = head_bytes(path, _pread(path, HEAD_BYTES, 0), kind)
                    if head is None:  # being created: nothing in it yet
                        out.append(_Seg(int(stem), path, 0, HEAD_BYTES))
                        continue
                    if len(self._heads) >= _HEADS_CACHED_MAX:
                        self._heads.clear()
                    self._heads[path] = head
            except FileNotFoundError:
                continue
            except FileFormatError as exc:
                raise DataDirError(str(exc)) from None
            out.append(_Seg(int(stem), path, max(0, size - head), head))
        return out

    # -- subjects ----------------------------------------------------------------------

    def subjects(self) -> dict[str, Path]:
        """Every subject with a consume log, and the directory of that log."""
        out: dict[str, Path] = {}
        consume = self.dir / "consume"
        for sub in sorted(consume / name for name in fileio.listdir(consume)):
            name = ConsumeLog.subject_in(sub)
            if name is not None:
                out[name] = sub
        return out

    def consume_dir(self, subject: str) -> Path | None:
        """The consume-log directory of ``subject``, or None if it has none."""
        guess = self.dir / "consume" / subject_file_name(subject)
        if ConsumeLog.subject_in(guess) == subject:
            return guess
        return self.subjects().get(subject)  # named by another version's escaping: look at them all

    def bounds(self, subject: str) -> tuple[int, int]:
        """``(first, end)``: the first sequence kept and the sequence after the last good record."""
        clog = self.consume_dir(subject)
        if clog is None:
            return 0, 0
        segs = self._segments(clog, consume_log.SEGMENT_SUFFIX, consume_log.FILE_KIND)
        if not segs:
            return 0, 0
        first = self._first_kept(subject, clog, segs)
        end = segs[-1].end // ENTRY_BYTES
        if end <= first:
            return first, first
        return first, self._last_good_end(clog, first, end)

    def _first_kept(self, subject: str, clog: Path, segs: list[_Seg]) -> int:
        """The first sequence whose record the message log still holds (retention goes by whole segments)."""
        logs = self._segments(self.dir / "log", message_log.SEGMENT_SUFFIX, message_log.FILE_KIND)
        log_start = logs[0].base if logs else 0
        seq = -(-segs[0].base // ENTRY_BYTES)
        end = segs[-1].end // ENTRY_BYTES
        # entries point forward in the log, so the kept ones are a suffix
        return first_seq_reaching(
            lambda at, n: self._entries(clog, at, n), seq, end, consume_log.FIELD_OFFSET, log_start
        )

    def _last_good_end(self, clog: Path, first: int, end: int) -> int:
        """Walk back from the end over entries whose record is not (yet) whole and good."""
        back_max = 4096  # a torn tail is one write; a broker's batch is far smaller than this
        seq = end
        while seq > first and end - seq < back_max:
            raw = self._entries(clog, seq - 1, 1)
            if len(raw) == ENTRY_BYTES:
                off, size, _ms, _bloom, _r = ENTRY.unpack(raw)
                if self._record_ok(off, size, seq - 1):
                    return seq
            seq -= 1
        return seq

    def _record_ok(self, offset: int, size: int, seq: int) -> bool:
        data = self._read_log(offset, size)
        if len(data) != size:
            return False
        h = read_record_header(data, 0)
        return (
            h is not None and h.sequence == seq and RECORD_HEADER_BYTES + h.length == size and record_crc_ok(data, 0, h)
        )

    def _entries(self, clog: Path, seq: int, count: int) -> bytes:
        out = bytearray()
        offset = seq * ENTRY_BYTES
        want = count * ENTRY_BYTES
        for seg in self._segments(clog, consume_log.SEGMENT_SUFFIX, consume_log.FILE_KIND):
            if seg.end <= offset or len(out) >= want:
                continue
            if seg.base > offset:
                break  # a hole: never happens in a broker's files; stop rather than guess
            try:
                chunk = _pread(seg.path, min(want - len(out), seg.end - offset), seg.head + offset - seg.base)
            except FileNotFoundError:
                break
            out += chunk
            offset += len(chunk)
            if len(chunk) == 0:
                break
        return bytes(out[: len(out) // ENTRY_BYTES * ENTRY_BYTES])

    def _read_log(self, offset: int, size: int) -> bytes:
        for seg in self._segments(self.dir / "log", message_log.SEGMENT_SUFFIX, message_log.FILE_KIND):
            if seg.base <= offset < seg.end:
                try:
                    return _pread(seg.path, min(size, seg.end - offset), seg.head + offset - seg.base)
                except FileNotFoundError:
                    return b""
        return b""

    # -- records -----------------------------------------------------------------------

    def read(
        self,
        subject: str,
        from_seq: int,
        to_seq: int,
        bytes_max: int = READ_BYTES_MAX,
        verify: bool = True,
    ) -> RecordRun:
        """Good records of ``subject`` with sequences in ``[from_seq, to_seq)``, from the first
        one kept at or after ``from_seq``, at most ``bytes_max`` bytes (at least one record).

        Stops early at a record that does not check out; ``count`` 0 means nothing (more) to read.
        """
        clog = self.consume_dir(subject)
        if clog is None or to_seq <= from_seq:
            return RecordRun(from_seq, 0, b"")
        for _ in range(_RELIST_TRIES_MAX):
            try:
                return self._read(subject, clog, from_seq, to_seq, bytes_max, verify)
            except FileNotFoundError:
                continue  # a segment went away under us: list again
        raise DataDirError(
            f"segments of {subject!r} in {str(self.dir)!r} kept vanishing while being read; is retention "
            "deleting them this fast? try again"
        )

    def _read(self, subject: str, clog: Path, from_seq: int, to_seq: int, bytes_max: int, verify: bool) -> RecordRun:
        segs = self._segments(clog, consume_log.SEGMENT_SUFFIX, consume_log.FILE_KIND)
        if not segs:
            return RecordRun(from_seq, 0, b"")
        first = max(from_seq, self._first_kept(subject, clog, segs))
        n = min(to_seq - first, bytes_max // 64 + 1, segs[-1].end // ENTRY_BYTES - first)
        if n <= 0:
            return RecordRun(first, 0, b"")
        entries = np.frombuffer(self._entries(clog, first, n), dtype=ENTRY_DTYPE)
        if not len(entries):
            return RecordRun(first, 0, b"")
        offsets = entries["offset"].astype(np.int64)
        sizes = entries["size"].astype(np.int64)
        ends = np.cumsum(sizes)
        count = max(1, int(np.searchsorted(ends, bytes_max, side="right")))
        offsets, sizes, ends = offsets[:count], sizes[:count], ends[:count]
        # records that follow each other in the message log are read with one pread
        breaks = np.flatnonzero(offsets[1:] != offsets[:-1] + sizes[:-1]) + 1
        logs = self._segments(self.dir / "log", message_log.SEGMENT_SUFFIX, message_log.FILE_KIND)
        out = bytearray()
        for a, b in zip([0, *breaks.tolist()], [*breaks.tolist(), count], strict=True):
            out += self._read_span(logs, int(offsets[a]), int(offsets[b - 1] + sizes[b - 1]))
        good = self._good_prefix(out, offsets, sizes, ends, first, verify)
        pos = int(ends[good - 1]) if good else 0
        return RecordRun(first, good, bytes(out[:pos]) if pos != len(out) else bytes(out))

    def _good_prefix(
        self, out: bytearray, offsets: np.ndarray, sizes: np.ndarray, ends: np.ndarray, first: int, verify: bool
    ) -> int:
        """How many records from the start of ``out`` are whole and check out (magic, length,
        sequence; CRC32C for those a checkpoint does not yet cover)."""
        starts = ends - sizes
        whole = ends <= len(out)
        buf = np.frombuffer(bytes(out), dtype=np.uint8) if out else np.zeros(0, dtype=np.uint8)
        at = np.where(whole, starts, 0)
        if len(buf) < RECORD_HEADER_BYTES:
            return 0
        head = buf[at[:, None] + np.arange(RECORD_HEADER_BYTES)]
        fields = head.copy().view(RECORD_HEADER_DTYPE).reshape(-1)
        ok = (
            whole
            & (fields["magic"] == RECORD_MAGIC)
            & (fields["length"].astype(np.int64) + RECORD_HEADER_BYTES == sizes)
            & (fields["sequence"].astype(np.int64) == first + np.arange(len(sizes)))
        )
        bad = np.flatnonzero(~ok)
        good = int(bad[0]) if len(bad) else len(sizes)
        if verify:
            # records a checkpoint covers were fsynced before it: only later ones can be torn
            crc_from = self._crc_from()
            view = memoryview(out)
            crc = crc32c.crc32c
            checked = np.flatnonzero(offsets[:good] >= crc_from).tolist()
            crcs = fields["crc"][:good]
            for i in checked:
                if crc(view[int(starts[i]) + 8 : int(ends[i])]) != int(crcs[i]):
                    return int(i)
        return good

    def _crc_from(self) -> int:
        """Message-log offset from which records are CRC-checked: the checkpoint's, read once."""
        if self._checked_from is None:
            state = newest_checkpoint(self.dir)
            self._checked_from = int(state.get("message_offset", 0)) if state else 0
        return self._checked_from

    @staticmethod
    def _read_span(logs: list[_Seg], start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the message log; fewer if it ends (or was cut) first."""
        out = bytearray()
        pos = start
        for seg in logs:
            if seg.end <= pos or pos >= end:
                continue
            if seg.base > pos:
                break
            chunk = _pread(seg.path, min(end, seg.end) - pos, seg.head + pos - seg.base)
            out += chunk
            pos += len(chunk)
            if len(chunk) == 0:
                break
        return bytes(out)

    def seq_at_time(self, subject: str, time_ms: int) -> int:
        """The first kept sequence of ``subject`` stored at or after ``time_ms`` (stored times never go
        back within a subject), or the end when none is."""
        first, end = self.bounds(subject)
        clog = self.consume_dir(subject)
        if clog is None:
            return end
        return first_seq_reaching(
            lambda at, n: self._entries(clog, at, n), first, end, consume_log.FIELD_STORED_MS, time_ms
        )

    def iter_records(self, subject: str, from_seq: int = 0, to_seq: int | None = None) -> Iterator[RecordRun]:
        """Successive runs of ``subject`` from ``from_seq`` (or the first kept) to ``to_seq`` (or the end)."""
        end = self.bounds(subject)[1] if to_seq is None else to_seq
        seq = from_seq
        while seq < end:  # bounded: every run moves seq forward, or the loop stops
            run = self.read(subject, seq, end)
            if run.records == 0:
                return
            yield run
            seq = run.first + run.records

    # -- consumer progress -------------------------------------------------------------

    def checkpoint(self) -> dict[str, Any] | None:
        return newest_checkpoint(self.dir)

    def actions(self, start: int = 0) -> Iterator[ActionAt]:
        """Actions from offset ``start`` (or the oldest kept) to the first that does not check out."""
        segs = self._segments(self.dir / "action", act.SEGMENT_SUFFIX, act.FILE_KIND)
        for seg in segs:
            if seg.end <= start:
                continue
            try:
                data = _pread(seg.path, seg.size, seg.head)
            except FileNotFoundError:
                continue  # deleted after a checkpoint: its actions are in the checkpoint
            pos = max(0, start - seg.base)
            read = _reader_of(data)
            while pos < len(data):
                try:
                    frame = act.read_frame(read, pos)
                except act.UnreadableAction:
                    raise DataDirError(
                        f"{seg.path}: the action-log frame at offset {seg.base + pos} passes its CRC but is no "
                        f"action of format version {act.FORMAT_VERSION}; another version of qmq wrote it: "
                        "read this directory with that version"
                    ) from None
                if frame is None:
                    return
                yield ActionAt(seg.base + pos, frame[0])
                pos = frame[1]

    def progress(self) -> tuple[Progress, int]:
        """Consumer progress now (checkpoint plus the actions after it) and the checkpoint's time (ms, 0 if none)."""
        state = self.checkpoint()
        if state is None:
            progress, start, at_ms = Progress(), 0, 0
        else:
            progress = Progress.from_snapshot(state["progress"])
            start, at_ms = int(state["action_offset"]), int(state.get("time_ms", 0))
        for item in self.actions(start):
            act.apply_action(progress, item.action, warn=False)
        return progress, at_ms

    # -- dead letters ------------------------------------------------------------------

    def dead_letters(self) -> Iterator[DeadLetterInfo]:
        """Every dead letter of every (subject, group), oldest first within each."""
        dead = self.dir / "dead"
        if not dead.is_dir():
            return
        removed_by_action: dict[str, set[int]] = {}
        for item in self.actions():
            a = item.action
            if a[0] == act.DEAD_REMOVE and len(a) == 3 and isinstance(a[2], list):
                removed_by_action.setdefault(str(a[1]), set()).update(int(n) for n in a[2])
        for box in sorted(dead / name for name in fileio.listdir(dead)):
            try:
                name = fileio.read_text(box / dl.SUBJECT_FILE)
                raw_removed = fileio.read_file(box / dl.REMOVED_FILE) if (box / dl.REMOVED_FILE).exists() else b""
                letters = dl.file_data(box / dl.LETTERS_FILE, fileio.read_file(box / dl.LETTERS_FILE), dl.LETTERS_KIND)
                raw_removed = dl.file_data(box / dl.REMOVED_FILE, raw_removed, dl.REMOVED_KIND)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except FileFormatError as exc:
                raise DataDirError(str(exc)) from None
            removed = dl.removed_numbers(raw_removed)
            removed |= removed_by_action.get(name, set())
            pos = 0
            while True:
                h = read_record_header(letters, pos)
                if (
                    h is None
                    or pos + RECORD_HEADER_BYTES + h.length > len(letters)
                    or not record_crc_ok(letters, pos, h)
                ):
                    break
                end = pos + RECORD_HEADER_BYTES + h.length
                yield DeadLetterInfo(
                    name, h.sequence, h.stored_ms, h.sequence in removed, letters[pos + RECORD_HEADER_BYTES : end]
                )
                pos = end
