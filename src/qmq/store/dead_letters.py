"""Dead letters: messages that failed ``max_retries`` times, kept per (subject, group) until
resent or purged — never removed by the message log's retention.

Layout under ``data_dir/dead/<escaped %DEAD_RETRY%subject%group>/``::

    subject     the dead-letter subject, as text
    letters     records as in the message log (qmq.protocol.record); a record's sequence is
                its letter number: the offset of the same record in the broker's message log,
                so indexing a record twice (recovery, a slave catching up) adds it once
    removed     u64 letter numbers, appended when a letter is resent or purged

Dead letters are rare, so each append is fsynced at once and a listing reads the file.
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
from qmq.store.segments import fsync_dir

REMOVED = struct.Struct("<Q")  # a letter number in ``removed``
SUBJECT_FILE = "subject"
LETTERS_FILE = "letters"
REMOVED_FILE = "removed"
_READ_BYTES = 4 * 1024 * 1024
ERROR_PROPERTY = "qmq.error"


def removed_numbers(raw: bytes) -> set[int]:
    """The letter numbers a ``removed`` file holds (a torn last one ignored)."""
    return {n for (n,) in REMOVED.iter_unpack(raw[: len(raw) // REMOVED.size * REMOVED.size])}


@dataclass(slots=True)
class DeadBox:
    subject: str
    directory: Path
    letters_fd: int
    removed_fd: int
    size: int
    count: int
    last_number: int = -1
    removed: set[int] = field(default_factory=set)

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


class DeadLetters:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.boxes: dict[str, DeadBox] = {}
        for sub in sorted(directory.iterdir()):
            name_file = sub / SUBJECT_FILE
            if name_file.exists():
                self._open(name_file.read_text(encoding="utf-8"), sub)

    def _open(self, subject: str, sub: Path) -> DeadBox:
        sub.mkdir(parents=True, exist_ok=True)
        name_file = sub / SUBJECT_FILE
        if not name_file.exists():
            name_file.write_text(subject, encoding="utf-8")
            fsync_dir(sub)
        letters_fd = os.open(sub / LETTERS_FILE, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        removed_fd = os.open(sub / REMOVED_FILE, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        box = DeadBox(subject, sub, letters_fd, removed_fd, os.fstat(letters_fd).st_size, 0)
        end = [0]
        for letter in self._scan(box, end):
            box.count += 1
            box.last_number = letter.number
        if end[0] < box.size:  # a torn last letter: cut it
            os.ftruncate(letters_fd, end[0])
            box.size = end[0]
        raw = os.pread(removed_fd, os.fstat(removed_fd).st_size, 0)
        box.removed = removed_numbers(raw)
        self.boxes[subject] = box
        return box

    @staticmethod
    def _scan(box: DeadBox, end: list[int]) -> Iterator[Letter]:
        """Every good letter in order; ``end[0]`` is left at the end of the last good one."""
        pos = 0
        while pos < box.size:
            data = os.pread(box.letters_fd, min(_READ_BYTES, box.size - pos), pos)
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
                        data = os.pread(box.letters_fd, RECORD_HEADER_BYTES + h.length, pos)
                        if record_crc_ok(data, 0, h):
                            yield Letter(h.sequence, h.stored_ms, data[RECORD_HEADER_BYTES:])
                            pos += len(data)
                            end[0] = pos
                            continue
                return
            pos += p

    def append(self, subject: str, letters: list[tuple[int, bytes | memoryview]], now_ms: int) -> None:
        """Keep ``letters`` (letter number, message); numbers at or below the last one kept are skipped."""
        box = self.boxes.get(subject) or self._open(subject, self.directory / subject_file_name(subject))
        fresh = [(n, m) for n, m in letters if n > box.last_number]
        if not fresh:
            return
        out = bytearray(sum(RECORD_HEADER_BYTES + len(m) for _n, m in fresh))
        pos = 0
        for number, message in fresh:
            pos = pack_record_into(out, pos, message, number, now_ms)
        try:
            os.write(box.letters_fd, out)
            os.fsync(box.letters_fd)
        except OSError:
            os.ftruncate(box.letters_fd, box.size)
            raise
        box.size += len(out)
        box.count += len(fresh)
        box.last_number = fresh[-1][0]

    def letters(self, subject: str, after: int = -1, limit: int = 100, message_id: str | None = None) -> list[Letter]:
        """Live letters of a dead-letter subject with number > ``after``, oldest first."""
        box = self.boxes.get(subject)
        if box is None:
            return []
        out: list[Letter] = []
        for letter in self._scan(box, [0]):
            if letter.number <= after or letter.number in box.removed:
                continue
            if message_id is not None and decode_message(letter.message).message_id != message_id:
                continue
            out.append(letter)
            if len(out) >= limit:
                break
        return out

    def cut_from(self, number: int) -> None:
        """Forget every letter numbered ``number`` or later (a log cut back after a failover)."""
        for box in self.boxes.values():
            if box.last_number < number:
                continue
            keep = 0
            count = 0
            last = -1
            for letter in self._scan(box, [0]):
                if letter.number >= number:
                    break
                keep += RECORD_HEADER_BYTES + len(letter.message)
                count += 1
                last = letter.number
            os.ftruncate(box.letters_fd, keep)
            box.size, box.count, box.last_number = keep, count, last
            box.removed = {n for n in box.removed if n < number}

    def remove(self, subject: str, numbers: list[int]) -> None:
        """Drop letters by number; a number not kept yet (a slave may learn of a removal first)
        is remembered, so the letter never counts when it comes."""
        box = self.boxes.get(subject) or self._open(subject, self.directory / subject_file_name(subject))
        fresh = [n for n in numbers if n not in box.removed]
        if not fresh:
            return
        os.write(box.removed_fd, b"".join(REMOVED.pack(n) for n in fresh))
        os.fsync(box.removed_fd)
        box.removed.update(fresh)

    def live(self, subject: str) -> int:
        box = self.boxes.get(subject)
        return box.live if box else 0

    def close(self) -> None:
        for box in self.boxes.values():
            os.close(box.letters_fd)
            os.close(box.removed_fd)
        self.boxes.clear()
