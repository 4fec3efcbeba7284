"""Indexing message-log records after the fact: what recovery does for the log's tail and a
slave does for what it received from its master.

Each record goes into its subject's consume log (when its sequence is the next one expected;
an entry already there is left alone; the sequences of damaged records skipped before it get
entries of size 0, which name no record and which pulls skip), its id into the duplicate window, a record of a
dead-letter subject into the dead letters (by its offset, so twice is once), and a held
record among the held messages until a copy of it follows (held.py). Entries are
buffered per subject and written in chunks.
"""

from __future__ import annotations

import logging

from qmq.common.naming import DEAD_PREFIX
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.message import VERSION, order_slot_field, scan_batch
from qmq.protocol.record import RECORD_AND_MESSAGE_HEADERS, RECORD_HEADER_BYTES, RECORD_MAGIC
from qmq.store.consume_log import ENTRY, ENTRY_BYTES, tag_bloom
from qmq.store.dead_letters import DeadLetters
from qmq.store.dedup import DedupWindow, dedup_key
from qmq.store.held import HELD_SEQUENCE, Held, HeldMessages
from qmq.store.message_log import MessageLog
from qmq.store.subjects import Subjects, SubjectState

log = logging.getLogger(__name__)

_FLUSH_ENTRIES = 4096
_DEDUP_CHUNK = 8192
_DEAD_RAW = DEAD_PREFIX.encode()
_GAP_FILLED_MAX = 100_000  # entries of damaged records filled in, at most, for one gap
_KEYS_CHUNK_BYTES = 4 * 1024 * 1024


class UnreadableRecord(Exception):
    """A CRC-valid record that does not decode as a message (written by another version)."""


class RecordIndexer:
    def __init__(
        self,
        subjects: Subjects,
        dedup: DedupWindow,
        held: HeldMessages,
        dead: DeadLetters,
        index_from: int,
        reindex_from: int | None = None,
    ) -> None:
        self.subjects = subjects
        self.dedup = dedup
        self.held = held
        self.dead = dead
        self.index_from = index_from  # records before this offset only feed the duplicate window
        # ... and, from this offset, the consume logs whose entries were lost (a damaged consume log)
        self.reindex_from = index_from if reindex_from is None else reindex_from
        self.indexed = 0
        self.rebuilt = 0
        self._keys: list[int] = []
        self._last_ms = 0
        self._pending: set[SubjectState] = set()

    def add(self, offset: int, sequence: int, stored_ms: int, message: bytes | memoryview) -> None:
        try:
            (sm,) = scan_batch(bytes(message))
        except (RemoteProtocolError, ValueError):
            raise UnreadableRecord(f"the record at offset {offset} does not decode as a message") from None
        key = dedup_key(sm)
        self._keys.append(key)
        self._last_ms = stored_ms
        if len(self._keys) >= _DEDUP_CHUNK:
            self.dedup.add_many(self._keys, stored_ms)
            self._keys = []
        if offset < self.index_from:
            if offset >= self.reindex_from and sequence != HELD_SEQUENCE and not sm.subject.startswith(_DEAD_RAW):
                self._entry(sm.subject.decode("utf-8"), sm.tags, offset, sequence, stored_ms, message)
            return
        self.indexed += 1
        self.dedup.total_messages += 1
        name = sm.subject.decode("utf-8")
        if sm.subject.startswith(_DEAD_RAW):
            self.dead.append(name, [(offset, bytes(message))], stored_ms)
            return
        if sequence == HELD_SEQUENCE:
            self.held.add(Held(sm.deliver_at_ms, offset, RECORD_HEADER_BYTES + len(message), key))
            return
        if self.held:
            self.held.copied(key)
        self._entry(name, sm.tags, offset, sequence, stored_ms, message)

    def _entry(
        self, name: str, tags: bytes, offset: int, sequence: int, stored_ms: int, message: bytes | memoryview
    ) -> None:
        """The consume-log entry of a record, if its consume log lacks it (with the message's
        order slot, as BrokerStore.append writes it)."""
        st = self.subjects.state(name)
        expected = st.clog.next_seq + len(st.pending) // ENTRY_BYTES
        if sequence < expected:
            return
        if sequence > expected:
            if sequence - expected > _GAP_FILLED_MAX:
                log.error(
                    "message log record at offset %d has sequence %d of %r but its consume log ends at %d; "
                    "the entries between cannot be rebuilt",
                    offset,
                    sequence,
                    st.name,
                    expected,
                )
                return
            # the records between were damaged (recovery skipped them): entries that name no
            # record keep every later sequence in its place, and a pull skips them as damaged
            log.error(
                "consume log of %r: no good record of sequences %d to %d before offset %d (damaged): "
                "their entries name none",
                st.name,
                expected,
                sequence - 1,
                offset,
            )
            st.pending += ENTRY.pack(offset, 0, stored_ms, 0, 0) * (sequence - expected)
        slot = order_slot_field(message)
        st.pending += ENTRY.pack(offset, RECORD_HEADER_BYTES + len(message), stored_ms, tag_bloom(tags), slot)
        self._pending.add(st)
        self.rebuilt += 1
        if len(st.pending) >= _FLUSH_ENTRIES * ENTRY_BYTES:
            st.clog.append(st.pending)
            st.pending.clear()

    def finish(self) -> set[str]:
        """Write what is buffered; returns the subjects that got entries."""
        if self._keys:
            self.dedup.add_many(self._keys, self._last_ms)
            self._keys = []
        touched = set()
        for st in self._pending:
            if st.pending:
                st.clog.append(st.pending)
                st.pending.clear()
            st.next_seq = st.clog.next_seq
            touched.add(st.name)
        self._pending.clear()
        return touched


def add_window_keys(mlog: MessageLog, start: int, end: int, dedup: DedupWindow) -> tuple[int, int]:
    """Fill the duplicate window with the keys of the records from ``start`` to ``end`` (both
    record boundaries) in one tight pass, reading only what a key needs: neither CRCs nor
    consume-log entries, for records recovery only reads to see their ids again. Returns the
    offset it reached and the records it read: ``end``, or the first record that is not an
    ordinary one (bad magic or framing, another format version), from which the caller's
    checked scan goes on.

    About a quarter of the checked scan's cost per record (the pass over a busy broker's last
    ten minutes is most of its restart); the records' CRCs are checked when they are pulled
    (``Checked.crc_from``)."""
    unpack = RECORD_AND_MESSAGE_HEADERS.unpack_from
    heads = RECORD_AND_MESSAGE_HEADERS.size
    rb = RECORD_HEADER_BYTES
    pos = start
    count = 0
    while pos < end:
        chunk = mlog.segments.read(pos, min(_KEYS_CHUNK_BYTES, end - pos))
        size = len(chunk)
        keys: list[int] = []
        append = keys.append
        stored = 0
        p = 0
        while size - p >= heads:
            magic, _, length, _, stored_at, ver, _, slen, ilen, _, tlen, _, _, times, copy, plen, blen = unpack(
                chunk, p
            )
            nxt = p + rb + length
            # framing that does not add up, or another version's message: the checked scan's to judge
            framed = heads + slen + ilen + tlen + plen + blen == nxt - p
            if magic != RECORD_MAGIC or ver != VERSION or nxt > size or not framed:
                break
            s = p + heads
            i = s + slen
            append(hash((chunk[i : i + ilen], chunk[s:i], times, copy)))
            stored = stored_at
            p = nxt
        dedup.add_many(keys, stored)
        count += len(keys)
        if p == 0:
            break
        pos += p
    return pos, count
