"""The action log: every change of consumer progress, in order, so recovery can replay it.

Each action is one framed record (little-endian)::

    +-----------+-----------+---------------------------+
    | length u32| crc32c u32| payload (msgpack list)    |
    +-----------+-----------+---------------------------+

Payloads (lists, first item the kind):

    [CREATE_GROUP, subject, group, start_seq]
    [PULL, subject, group, consumer_id, pull_offset, [[seq, count], ...], new_group_pull_offset]
    [ACK, subject, group, consumer_id, [[start, end], ...]]
    [RESET, subject, group, new_group_pull_offset]
    [DEAD_REMOVE, dead_letter_subject, [letter numbers]]   (resent or purged)

A consumer's pull log is the sequence of its PULL runs; it lives in memory (``progress``),
in checkpoints, and here. Writes go to the OS at once (so ``kill -9`` loses nothing) and
are fsynced with the message log's group commit.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import msgpack

from qmq.store.segments import SegmentedLog

CREATE_GROUP = 1
PULL = 2
ACK = 3
RESET = 4
DEAD_REMOVE = 5

_FRAME = struct.Struct("<II")
_SEGMENT_BYTES = 64 * 1024 * 1024


class ActionLog:
    def __init__(
        self, directory: Path, segment_bytes: int = _SEGMENT_BYTES, on_append: Callable[[], None] | None = None
    ) -> None:
        self.segments = SegmentedLog(directory, ".act", segment_bytes)
        self.on_append = on_append

    @property
    def end(self) -> int:
        return self.segments.end

    def append(self, action: list[Any]) -> None:
        payload = msgpack.packb(action, use_bin_type=True)
        self.segments.append(_FRAME.pack(len(payload), crc32c.crc32c(payload)) + payload)
        if self.on_append is not None:
            self.on_append()

    def replay(self, start: int, torn: list[int]) -> Iterator[list[Any]]:
        """Yield actions from ``start``; on a torn or corrupt record, cut the log there.

        ``torn`` receives the number of bytes cut (0 when the log was whole).
        """
        log = self.segments
        pos = max(start, log.start)
        while pos < log.end:
            seg = log.segment_for(pos)
            if seg is None:
                break
            head = log.read(pos, _FRAME.size)
            ok = len(head) == _FRAME.size
            if ok:
                length, crc = _FRAME.unpack(head)
                payload = log.read(pos + _FRAME.size, length)
                ok = len(payload) == length and crc32c.crc32c(payload) == crc
            if not ok:
                torn.append(log.truncate(pos))
                return
            try:
                action = msgpack.unpackb(payload, raw=False, strict_map_key=True)
            except Exception:  # a CRC-valid record that does not decode: treat as torn
                torn.append(log.truncate(pos))
                return
            yield action
            pos += _FRAME.size + length
            if pos >= seg.end and pos < log.end:
                pos = seg.end
        torn.append(0)

    def delete_before(self, offset: int) -> None:
        self.segments.delete_before(offset)

    def close(self) -> None:
        self.segments.close()
