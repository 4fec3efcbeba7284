"""The action log: every change of consumer progress, in order, so recovery (and a slave)
can replay it. This module is the one home of its format: the frame, the payloads, how each
is written (``ProgressLog``) and the one replay of them (``apply_action``), which serves the
broker and the offline reader (``reader.py``).

Each segment file begins with the header of ``file_header.py`` (kind ``ALOG``, the format
version below), then frames. Frame layout, format version 1 (little-endian), one action per frame::

    +-----------+-----------+---------------------------+
    | length u32| crc32c u32| payload (msgpack list)    |
    +-----------+-----------+---------------------------+

    | field   | type  | bytes      | meaning                                  |
    |---------|-------|------------|------------------------------------------|
    | length  | u32   | 0-3        | bytes of the payload                     |
    | crc32c  | u32   | 4-7        | CRC32C of the payload                    |
    | payload | bytes | 8-(8+len)  | a msgpack list, its first item the kind  |

Payloads (a later version may only add items at the end):

    [CREATE_GROUP, subject, group, start_seq]
    [PULL, subject, group, consumer_id, pull_offset, [[seq, count], ...], new_group_pull_offset
     (pull_offset: of its first entry; the pull log's end, or past it where a new stretch
      begins: progress.py)
     (, ordered: 1 for an ordered group, else 0 (older versions wrote it for ordered groups only)
      (, at_ms: when, epoch ms; older versions wrote none))]
    [ACK, subject, group, consumer_id, [[start, end], ...] (, at_ms: when; older versions wrote none)]
    [RESET, subject, group, new_group_pull_offset]
    [DEAD_REMOVE, dead_letter_subject, [letter numbers]]   (resent or purged)
    [FORGET, subject, group, [consumer_id, ...]]   (consumers gone with nothing unacknowledged)

A new layout needs a new version here, and a way to read the files of the old one. A frame
that passes its CRC but is no action of this version was written by another version of qmq:
recovery refuses to start rather than cut it (only a frame that fails its CRC is a torn tail).
A consumer's pull log is the sequence of its PULL runs; it lives in memory
(``progress``), in checkpoints, and here. Writes go to the OS at once (so ``kill -9`` loses
nothing) and are fsynced by the broker's group commit, with the message log
(``BrokerStore.begin_flush``), which an ack's answer waits for under flush = "sync".
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import msgpack

from qmq.protocol.packing import packb
from qmq.store.datadir import StoreError
from qmq.store.file_header import FileKind
from qmq.store.progress import ConsumerProgress, GroupProgress, Progress
from qmq.store.segments import SegmentedLog

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FILE_KIND = FileKind(b"ALOG", FORMAT_VERSION, "action-log segment")
FRAME = struct.Struct("<II")  # payload length, CRC32C of the payload
FRAME_BYTES = FRAME.size
SEGMENT_SUFFIX = ".act"
SEGMENT_BYTES = 64 * 1024 * 1024

CREATE_GROUP = 1
PULL = 2
ACK = 3
RESET = 4
DEAD_REMOVE = 5
FORGET = 6
# consumer ids one FORGET names at most (~200 KB): an action is replicated in one frame
_FORGET_IDS_MAX = 1000
# items in each kind's payload, the kind included
_ITEMS = {CREATE_GROUP: 4, PULL: 7, ACK: 5, RESET: 4, DEAD_REMOVE: 3, FORGET: 4}


def frame_len(buf: bytes, pos: int) -> int | None:
    """Bytes of the frame at ``buf[pos:]``, header included; None if its header is not all there."""
    if len(buf) - pos < FRAME_BYTES:
        return None
    length, _crc = FRAME.unpack_from(buf, pos)
    return FRAME_BYTES + int(length)


class UnreadableAction(Exception):
    """A frame that passes its CRC but holds no action of this format version."""


def read_frame(read: Callable[[int, int], bytes], pos: int) -> tuple[list[Any], int] | None:
    """The action in the frame at ``pos`` and the position after it; None where the frame is
    partial or fails its CRC (a torn tail). ``UnreadableAction`` for a frame that passes its
    CRC but does not decode as an action (another version's).

    ``read(pos, size)`` gives the bytes there, fewer where the log ends.
    """
    head = read(pos, FRAME_BYTES)
    if len(head) != FRAME_BYTES:
        return None
    length, crc = FRAME.unpack(head)
    payload = read(pos + FRAME_BYTES, length)
    if len(payload) != length or crc32c.crc32c(payload) != crc:
        return None
    try:
        action = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception:  # msgpack raises many types for bad input
        action = None
    if not isinstance(action, list) or not action:
        raise UnreadableAction(
            f"the action-log frame at offset {pos} passes its CRC but is no action of format version {FORMAT_VERSION}"
        )
    return action, pos + FRAME_BYTES + length


def apply_action(
    progress: Progress,
    action: list[Any],
    remove_dead: Callable[[str, list[int]], None] | None = None,
    warn: bool = True,
) -> None:
    """Apply one action to ``progress``: the one replay of the action log, for the broker
    (recovery, and a slave applying its master's actions) and for the offline reader.

    Where the two differ, a parameter says how, and why:

    - ``remove_dead``: the broker removes dead letters here; the reader (None) skips the
      removals, since it marks them itself when it lists dead letters.
    - ``warn``: the broker (True) logs what its own log should never hold — a kind it does not
      know, a payload with too few items, a group used before it was created, a pull log out
      of step — then skips it as the reader does; the reader (False) reads the files of a
      running broker, perhaps of another version, where skipping such a record is expected
      and a data job must not log a line per action.

    A payload with more items than its kind has (a later version's) is applied by the items known.
    """
    kind = action[0]
    items = _ITEMS.get(kind) if isinstance(kind, int) else None
    if items is None or len(action) < items:
        if warn:
            what = "unknown action kind" if items is None else "too short an action of kind"
            log.warning("%s %r in the action log; skipped", what, kind)
        return
    if kind == DEAD_REMOVE:
        if remove_dead is not None:
            remove_dead(str(action[1]), action[2])
        return
    if kind == CREATE_GROUP:
        progress.create_group(str(action[1]), str(action[2]), int(action[3]))
        return
    gp = progress.get(str(action[1]), str(action[2]))
    if gp is None:
        if warn:
            log.warning("action log names group %r of %r before creating it; skipped", action[2], action[1])
        return
    if kind == PULL:
        cp = gp.consumer(str(action[3]))
        start = int(action[4])
        if warn and start < cp.pull_log_end:
            log.warning(
                "pull log of %r in group %r is out of step (%d vs %d)", action[3], gp.group, cp.pull_log_end, start
            )
        Progress.record_pull(gp, cp, action[5], int(action[6]), start)
        if len(action) > items and action[items] == 1:
            gp.ordered = True  # slots are served to their owners, also after a restart or promotion
    elif kind == ACK:
        Progress.apply_ack(gp.consumer(str(action[3])), action[4])
    elif kind == FORGET:
        Progress.forget(gp, [str(c) for c in action[3]])
    else:  # RESET
        gp.pull_offset = int(action[3])


class ActionLog:
    """The action log's files: frames appended, replayed, and cut where torn."""

    def __init__(
        self, directory: Path, segment_bytes: int = SEGMENT_BYTES, on_append: Callable[[], None] | None = None
    ) -> None:
        self.segments = SegmentedLog(directory, SEGMENT_SUFFIX, segment_bytes, FILE_KIND)
        self.on_append = on_append

    @property
    def end(self) -> int:
        return self.segments.end

    def append(self, action: list[Any]) -> None:
        payload = packb(action)
        self.segments.append(FRAME.pack(len(payload), crc32c.crc32c(payload)) + payload)
        if self.on_append is not None:
            self.on_append()

    def replay(self, start: int, torn: list[int]) -> Iterator[list[Any]]:
        """Yield actions from ``start``; on a torn record (partial, or failing its CRC), cut the
        log there. A record that passes its CRC but does not decode raises StoreError: it is
        another version's, and cutting it would lose what follows.

        ``torn`` receives the number of bytes cut (0 when the log was whole).
        """
        log = self.segments
        pos = max(start, log.start)
        while pos < log.end:
            seg = log.segment_for(pos)
            if seg is None:
                break
            try:
                frame = read_frame(log.read, pos)
            except UnreadableAction as exc:
                raise StoreError(
                    f"{seg.path}: {exc}; it was written by another version of qmq. Nothing was cut: "
                    "run the qmq version that wrote it, or move the data directory aside"
                ) from None
            if frame is None:
                torn.append(log.truncate(pos))
                return
            action, pos = frame
            yield action
            if pos >= seg.end and pos < log.end:
                pos = seg.end
        torn.append(0)

    def delete_before(self, offset: int) -> None:
        self.segments.delete_before(offset)

    def close(self) -> None:
        self.segments.close()


class ProgressLog:
    """Consumer progress as the broker keeps it: each change is appended to the action log,
    then applied to ``progress`` by the rule replay applies (``apply_action``); dead-letter
    removals, logged here too, are applied to ``remove_dead``'s owner."""

    def __init__(
        self,
        alog: ActionLog,
        progress: Progress,
        remove_dead: Callable[[str, list[int]], None],
        now_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.alog = alog
        self.progress = progress
        self._remove_dead = remove_dead
        self._now_ms = now_ms  # the time a pull or an ack is logged with (qmq trace tells it)
        # where pull logs go on since the last restart or promotion (progress.py: stretches);
        # 0 on a first start, where no position was ever handed out
        self.stretch = 0

    def new_stretch(self) -> None:
        """Pull logs go on above every position handed out before (a restart, a promotion)."""
        self.stretch = self.progress.next_stretch(self._now_ms())

    def create_group(self, subject: str, group: str, start_seq: int) -> GroupProgress:
        gp = self.progress.get(subject, group)
        if gp is None:
            self.alog.append([CREATE_GROUP, subject, group, start_seq])
            gp = self.progress.create_group(subject, group, start_seq)
        return gp

    def record_pull(self, gp: GroupProgress, cp: ConsumerProgress, runs: list[list[int]], new_offset: int) -> int:
        """Log and apply a pull of consume-log ``runs``; returns the pull-log offset of its first entry."""
        ordered = 1 if gp.ordered else 0
        start = max(cp.pull_log_end, self.stretch)
        self.alog.append([PULL, gp.subject, gp.group, cp.consumer_id, start, runs, new_offset, ordered, self._now_ms()])
        return Progress.record_pull(gp, cp, runs, new_offset, start)

    def ack(self, gp: GroupProgress, cp: ConsumerProgress, ranges: list[list[int]]) -> int:
        self.alog.append([ACK, gp.subject, gp.group, cp.consumer_id, ranges, self._now_ms()])
        return Progress.apply_ack(cp, ranges)

    def reset(self, gp: GroupProgress, seq: int) -> None:
        self.alog.append([RESET, gp.subject, gp.group, seq])
        gp.pull_offset = seq

    def forget_gone(self, now_ms: int, gone_ms: int) -> int:
        """Log and forget every consumer silent for ``gone_ms`` with nothing unacknowledged;
        returns how many."""
        forgotten = 0
        for gp, ids in self.progress.gone_consumers(now_ms, gone_ms):
            for at in range(0, len(ids), _FORGET_IDS_MAX):
                some = ids[at : at + _FORGET_IDS_MAX]
                self.alog.append([FORGET, gp.subject, gp.group, some])
                Progress.forget(gp, some)
            forgotten += len(ids)
        return forgotten

    def remove_dead(self, dead_subject: str, numbers: list[int]) -> None:
        if numbers:
            self.alog.append([DEAD_REMOVE, dead_subject, numbers])
            self._remove_dead(dead_subject, numbers)

    def replay(self, start: int) -> tuple[int, int]:
        """Apply the actions logged from ``start``, cutting a torn tail; returns
        ``(actions applied, bytes cut)``."""
        torn: list[int] = []
        n = 0
        for action in self.alog.replay(start, torn):
            apply_action(self.progress, action, self._remove_dead)
            n += 1
        return n, torn[-1] if torn else 0
