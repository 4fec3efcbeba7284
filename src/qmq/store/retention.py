"""Retention: message-log segments older than ``retention_hours`` are deleted whole, and with
them the consume-log segments whose every entry points before what is kept."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from qmq.store.consume_log import ENTRY, ENTRY_BYTES

if TYPE_CHECKING:
    from qmq.store.broker_store import BrokerStore

log = logging.getLogger(__name__)


def run_retention(store: BrokerStore) -> int:
    """Delete message-log segments older than the retention; returns segments deleted."""
    cutoff_s = store.clock.now_ms() / 1000 - store.config.retention_hours * 3600
    segs = store.mlog.segments.segments
    keep_from = 0
    for i, seg in enumerate(segs[:-1]):
        if os.fstat(seg.fd).st_mtime < cutoff_s:
            keep_from = i + 1
        else:
            break
    if not keep_from:
        return 0
    offset = segs[keep_from].base
    store.mlog.segments.delete_before(offset)
    for st in store.subjects.values():
        clog_segs = st.clog.segments.segments
        for cseg in clog_segs[:-1]:
            last = st.clog.read(cseg.end // ENTRY_BYTES - 1, 1)
            if len(last) == ENTRY_BYTES and ENTRY.unpack(last)[0] < offset:
                st.clog.delete_before_seq(cseg.end // ENTRY_BYTES)
            else:
                break
    log.info("retention deleted %d message-log segment(s) before offset %d", keep_from, offset)
    return keep_from
