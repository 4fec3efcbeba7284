"""Indexing message-log records after the fact: what recovery does for the log's tail and a
slave does for what it received from its master.

Each record goes into its subject's consume log (when its sequence is the next one expected;
an entry already there is left alone), its id into the duplicate window, a record of a
dead-letter subject into the dead letters (by its offset, so twice is once), and a held
record among the held messages until a copy of it follows (held.py). Entries are
buffered per subject and written in chunks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from qmq.common.naming import DEAD_PREFIX
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.message import scan_batch
from qmq.protocol.record import RECORD_HEADER_BYTES
from qmq.store.consume_log import ENTRY, ENTRY_BYTES, tag_bloom
from qmq.store.held import HELD_SEQUENCE, Held

if TYPE_CHECKING:
    from qmq.store.broker_store import BrokerStore, SubjectState

log = logging.getLogger(__name__)

_FLUSH_ENTRIES = 4096
_DEDUP_CHUNK = 8192
_DEAD_RAW = DEAD_PREFIX.encode()


class UnreadableRecord(Exception):
    """A CRC-valid record that does not decode as a message (written by another version)."""


class RecordIndexer:
    def __init__(self, store: BrokerStore, index_from: int) -> None:
        self.store = store
        self.index_from = index_from  # records before this offset only feed the duplicate window
        self.indexed = 0
        self.rebuilt = 0
        self._keys: list[int] = []
        self._last_ms = 0
        self._pending: set[SubjectState] = set()

    def add(self, offset: int, sequence: int, stored_ms: int, message: bytes | memoryview) -> None:
        from qmq.store.broker_store import dedup_key

        store = self.store
        try:
            (sm,) = scan_batch(bytes(message))
        except (RemoteProtocolError, ValueError):
            raise UnreadableRecord(f"record at offset {offset} does not decode as a message") from None
        key = dedup_key(sm)
        self._keys.append(key)
        self._last_ms = stored_ms
        if len(self._keys) >= _DEDUP_CHUNK:
            store.dedup.add_many(self._keys, stored_ms)
            self._keys = []
        if offset < self.index_from:
            return
        self.indexed += 1
        store.total_messages += 1
        name = sm.subject.decode("utf-8")
        if sm.subject.startswith(_DEAD_RAW):
            store.dead.append(name, [(offset, bytes(message))], stored_ms)
            return
        if sequence == HELD_SEQUENCE:
            store.held.add(Held(sm.deliver_at_ms, offset, RECORD_HEADER_BYTES + len(message), key))
            return
        if store.held:
            store.held.copied(key)
        st = store.subject_state(name)
        assert st is not None
        expected = st.clog.next_seq + len(st.pending) // ENTRY_BYTES
        if sequence < expected:
            return
        if sequence > expected:
            log.error(
                "message log record at offset %d has sequence %d of %r but its consume log ends at %d; "
                "the entries between cannot be rebuilt",
                offset,
                sequence,
                st.name,
                expected,
            )
            return
        st.pending += ENTRY.pack(offset, RECORD_HEADER_BYTES + len(message), stored_ms, tag_bloom(sm.tags), 0)
        self._pending.add(st)
        self.rebuilt += 1
        if len(st.pending) >= _FLUSH_ENTRIES * ENTRY_BYTES:
            st.clog.append(st.pending)
            st.pending.clear()

    def finish(self) -> set[str]:
        """Write what is buffered; returns the subjects that got entries."""
        if self._keys:
            self.store.dedup.add_many(self._keys, self._last_ms)
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
