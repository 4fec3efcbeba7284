"""Retention: message-log segments older than ``retention_hours`` are deleted whole, and with
them the consume-log segments whose every entry points before what is kept."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from qmq.common.clock import Clock
    from qmq.common.config import BrokerConfig
    from qmq.store.message_log import MessageLog
    from qmq.store.subjects import SubjectState

log = logging.getLogger(__name__)


class Retained(Protocol):
    """What retention needs of the store whose logs it trims."""

    clock: Clock
    config: BrokerConfig
    mlog: MessageLog

    @property
    def subjects(self) -> Mapping[str, SubjectState]: ...


def run_retention(store: Retained) -> int:
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
        st.clog.delete_before_offset(offset)
    log.info("retention deleted %d message-log segment(s) before offset %d", keep_from, offset)
    return keep_from
