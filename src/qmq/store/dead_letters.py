"""Dead letters: messages that failed ``max_retries`` times, kept per (subject, group) until
resent or purged — never removed by the message log's retention.

Layout under ``data_dir/dead/<escaped %DEAD_RETRY%subject%group>/``::

    subject     the dead-letter subject, as text
    letters     the header of ``file_header.py`` (kind ``DEAD``), then records as in the
                message log (qmq.protocol.record); a record's sequence is its letter number: the
                offset of the same record in the broker's message log, so indexing a record
                twice (recovery, a slave catching up) adds it once
    removed     the header (kind ``DRMV``), then u64 letter numbers, appended when a letter is
                resent or purged

Files written before headers have none and are read as format version 1.

No file is kept open between writes, so dead-letter subjects cost no file descriptors. What
is written stays open only until the next flush (``take_sync_fds``: the broker's group commit,
or a checkpoint) fsyncs and closes it, off the event loop: a send that stored dead letters is
answered after that flush like any other send, and a storm of them stalls nobody.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qmq.common.naming import subject_file_name
from qmq.protocol.message import decode_message, decode_properties
from qmq.protocol.record import RECORD_HEADER_BYTES, pack_record_into, read_record_header, record_crc_ok
from qmq.store import fileio
from qmq.store.file_header import HEAD_BYTES, FileKind, head_bytes, header, read_head
from qmq.store.segments import cut_back

FORMAT_VERSION = 1
LETTERS_KIND = FileKind(b"DEAD", FORMAT_VERSION, "dead-letter file")
REMOVED_KIND = FileKind(b"DRMV", FORMAT_VERSION, "removed-dead-letter file")
REMOVED = struct.Struct("<Q")  # a letter number in ``removed``
SUBJECT_FILE = "subject"
LETTERS_FILE = "letters"
REMOVED_FILE = "removed"
_READ_BYTES = 4 * 1024 * 1024
ERROR_PROPERTY = "qmq.error"


def removed_numbers(raw: bytes) -> set[int]:
    """The letter numbers in the data of a ``removed`` file (a torn last one ignored)."""
    return {n for (n,) in REMOVED.iter_unpack(raw[: len(raw) // REMOVED.size * REMOVED.size])}


def file_data(path: Path, raw: bytes, kind: FileKind) -> bytes:
    """The data of a dead-letter file whose bytes are ``raw``, its header (if any) taken off;
    FileFormatError if another kind of file or a newer format version."""
    head = head_bytes(path, raw[:HEAD_BYTES], kind)
    return b"" if head is None else raw[head:]


@dataclass(slots=True, eq=False)
class DeadBox:
    subject: str
    directory: Path
    size: int  # bytes of letters, the header not counted
    head: int  # bytes of the letters file's header (0 in a file written before headers)
    count: int
    last_number: int = -1
    removed: set[int] = field(default_factory=set)
    # written since the last flush took them: fsynced and closed by that flush (-1: none)
    letters_fd: int = -1
    removed_fd: int = -1

    @property
    def live(self) -> int:
        # a removal may name a letter not kept yet (a slave learns of it first): it does not count
        return self.count - sum(1 for n in self.removed if n <= self.last_number)


@dataclass(slots=True)
class Letter:
    number: int
    stored_ms: int
    message: bytes

    def describe(self) -> dict[str, Any]:
        fields = decode_message(self.message)
        error = decode_properties(fields.properties_raw).get(ERROR_PROPERTY, "")
        return {
            "letter": self.number,
            "message_id": fields.message_id,
            "attempts": fields.times,
            "error": error if isinstance(error, str) else repr(error),
            "dead_at_ms": self.stored_ms,
            "bytes": len(self.message),
        }

    def contents(self, body_bytes_max: int) -> dict[str, Any]:
        """What the letter carries: its properties and the first ``body_bytes_max`` of its body."""
        fields = decode_message(self.message)
        return {
            "properties": decode_properties(fields.properties_raw),
            "body": bytes(fields.body[:body_bytes_max]),
            "body_bytes": len(fields.body),
        }


Mark = tuple[int, int, int]  # a box's size, count and last number, to cut back to


class DeadLetters:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        fileio.make_dirs(directory)
        self.boxes: dict[str, DeadBox] = {}
        self._written: set[DeadBox] = set()  # boxes holding files the next flush fsyncs
        self._new_files: list[int] = []  # new subject files and the directories that name them
        for entry in sorted(fileio.listdir(directory)):
            sub = directory / entry
            name_file = sub / SUBJECT_FILE
            if name_file.exists():
                self._open(fileio.read_text(name_file), sub)

    def _open(self, subject: str, sub: Path) -> DeadBox:
        if not sub.exists():
            fileio.mkdir(sub)
            self._new_files.append(fileio.open(self.directory, os.O_RDONLY))
            self._new_files.append(fileio.open(sub, os.O_RDONLY))
        name_file = sub / SUBJECT_FILE
        if not name_file.exists():
            fd = fileio.open(name_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            self._new_files.append(fd)
            fileio.write_all(fd, subject.encode("utf-8"))
        box = DeadBox(subject, sub, 0, HEAD_BYTES, 0)
        path = sub / LETTERS_FILE
        fd = fileio.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        written = False
        try:
            head = read_head(fd, path, LETTERS_KIND)
            if head is None:  # new, or cut inside its header: it holds no letters
                fileio.ftruncate(fd, 0)
                fileio.write_all(fd, header(LETTERS_KIND))
                head, written = HEAD_BYTES, True
            box.head = head
            box.size = fileio.size(fd) - head
            end = [0]
            for letter in self._scan(fd, box, end):
                box.count += 1
                box.last_number = letter.number
            if end[0] < box.size:  # a torn last letter: cut it
                fileio.ftruncate(fd, head + end[0])
                box.size, written = end[0], True
        except BaseException:
            fileio.close(fd)
            raise
        if written:
            box.letters_fd = fd
            self._written.add(box)
        else:
            fileio.close(fd)
        try:
            raw = fileio.read_file(sub / REMOVED_FILE)
        except FileNotFoundError:
            raw = b""
        box.removed = removed_numbers(file_data(sub / REMOVED_FILE, raw, REMOVED_KIND))
        self.boxes[subject] = box
        return box

    def _box(self, subject: str) -> DeadBox:
        return self.boxes.get(subject) or self._open(subject, self.directory / subject_file_name(subject))

    def _letters_fd(self, box: DeadBox) -> int:
        """The letters file open for writing, held for the next flush."""
        if box.letters_fd < 0:
            box.letters_fd = fileio.open(box.directory / LETTERS_FILE, os.O_RDWR | os.O_APPEND | os.O_CREAT)
            self._written.add(box)
        return box.letters_fd

    def _removed_fd(self, box: DeadBox) -> int:
        """The removed file open for writing (its header written if new), held for the next flush."""
        if box.removed_fd < 0:
            path = box.directory / REMOVED_FILE
            fd = fileio.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
            try:
                if read_head(fd, path, REMOVED_KIND) is None:
                    fileio.ftruncate(fd, 0)
                    fileio.write_all(fd, header(REMOVED_KIND))
            except BaseException:
                fileio.close(fd)
                raise
            box.removed_fd = fd
            self._written.add(box)
        return box.removed_fd

    @staticmethod
    def _scan(fd: int, box: DeadBox, end: list[int]) -> Iterator[Letter]:
        """Every good letter of ``box`` (its letters file open as ``fd``) in order; ``end[0]`` is
        left at the end of the last good one."""
        pos = 0
        head = box.head
        while pos < box.size:
            data = fileio.pread(fd, min(_READ_BYTES, box.size - pos), head + pos)
            p = 0
            while True:
                h = read_record_header(data, p)
                if h is None or p + RECORD_HEADER_BYTES + h.length > len(data):
                    break
                if not record_crc_ok(data, p, h):
                    return
                q = p + RECORD_HEADER_BYTES + h.length
                yield Letter(h.sequence, h.stored_ms, data[p + RECORD_HEADER_BYTES : q])
                p = q
                end[0] = pos + p
            if p == 0:
                if len(data) >= _READ_BYTES:  # a letter larger than a read: read it whole
                    h = read_record_header(data, 0)
                    if h is not None and RECORD_HEADER_BYTES + h.length <= box.size - pos:
                        data = fileio.pread(fd, RECORD_HEADER_BYTES + h.length, head + pos)
                        if record_crc_ok(data, 0, h):
                            yield Letter(h.sequence, h.stored_ms, data[RECORD_HEADER_BYTES:])
                            pos += len(data)
                            end[0] = pos
                            continue
                return
            pos += p

    def append(self, subject: str, letters: list[tuple[int, bytes | memoryview]], now_ms: int) -> None:
        """Keep ``letters`` (letter number, message); numbers at or below the last one kept are
        skipped. Written, not fsynced: the next flush fsyncs it (``take_sync_fds``)."""
        box = self._box(subject)
        fresh = [(n, m) for n, m in letters if n > box.last_number]
        if not fresh:
            return
        out = bytearray(sum(RECORD_HEADER_BYTES + len(m) for _n, m in fresh))
        pos = 0
        for number, message in fresh:
            pos = pack_record_into(out, pos, message, number, now_ms)
        fd = self._letters_fd(box)
        try:
            fileio.write_all(fd, out)
        except OSError as exc:
            cut_back(fd, box.head + box.size, exc)
            raise
        box.size += len(out)
        box.count += len(fresh)
        box.last_number = fresh[-1][0]

    def mark(self, subject: str) -> Mark | None:
        """Where ``subject``'s letters end now (None before it has any), for ``cut_back``."""
        box = self.boxes.get(subject)
        return None if box is None else (box.size, box.count, box.last_number)

    def cut_back(self, subject: str, mark: Mark | None) -> None:
        """Forget the letters appended to ``subject`` since ``mark`` (an append undone)."""
        box = self.boxes.get(subject)
        if box is None:
            return
        size, count, last = mark or (0, 0, -1)
        if box.size != size:
            fileio.ftruncate(self._letters_fd(box), box.head + size)
        box.size, box.count, box.last_number = size, count, last

    def take_sync_fds(self) -> list[int]:
        """The files written since the last call, for a flush to fsync and close (it owns them now)."""
        fds, self._new_files = self._new_files, []
        for box in self._written:
            for fd in (box.letters_fd, box.removed_fd):
                if fd >= 0:
                    fds.append(fd)
            box.letters_fd = box.removed_fd = -1
        self._written.clear()
        return fds

    def letters(self, subject: str, after: int = -1, limit: int = 100, message_id: str | None = None) -> list[Letter]:
        """Live letters of a dead-letter subject with number > ``after``, oldest first."""
        box = self.boxes.get(subject)
        if box is None:
            return []
        out: list[Letter] = []
        fd = fileio.open(box.directory / LETTERS_FILE, os.O_RDONLY)
        try:
            for letter in self._scan(fd, box, [0]):
                if letter.number <= after or letter.number in box.removed:
                    continue
                if message_id is not None and decode_message(letter.message).message_id != message_id:
                    continue
                out.append(letter)
                if len(out) >= limit:
                    break
        finally:
            fileio.close(fd)
        return out

    def cut_from(self, number: int) -> None:
        """Forget every letter numbered ``number`` or later (a log cut back after a failover)."""
        for box in self.boxes.values():
            if box.last_number < number:
                continue
            keep = 0
            count = 0
            last = -1
            fd = self._letters_fd(box)
            for letter in self._scan(fd, box, [0]):
                if letter.number >= number:
                    break
                keep += RECORD_HEADER_BYTES + len(letter.message)
                count += 1
                last = letter.number
            fileio.ftruncate(fd, box.head + keep)
            box.size, box.count, box.last_number = keep, count, last
            box.removed = {n for n in box.removed if n < number}

    def remove(self, subject: str, numbers: list[int]) -> None:
        """Drop letters by number; a number not kept yet (a slave may learn of a removal first)
        is remembered, so the letter never counts when it comes. Written, fsynced by the next flush."""
        box = self._box(subject)
        fresh = [n for n in numbers if n not in box.removed]
        if not fresh:
            return
        # removed at once: the action log, written first, says so and its replay removes them again
        box.removed.update(fresh)
        fd = self._removed_fd(box)
        size = fileio.size(fd)
        try:
            fileio.write_all(fd, b"".join(REMOVED.pack(n) for n in fresh))
        except OSError as exc:
            cut_back(fd, size, exc)
            raise

    def live(self, subject: str) -> int:
        box = self.boxes.get(subject)
        return box.live if box else 0

    def close(self) -> None:
        for fd in self.take_sync_fds():
            fileio.close(fd)
        self.boxes.clear()
