"""What a broker holds that some consumer group has not consumed yet, summed up for its heartbeat.

The meta server keeps the master's last summary: ``qmq cluster status`` shows a draining group's
"what is left" from it, and ``qmq admin remove-group`` is refused while it is not zero
(docs/cluster.md, "Operations"). Reading it walks the subjects and consumer groups in memory
once; no file is read.

A (subject, consumer group) pair has left what the group has not pulled yet plus what it pulled
and has not acknowledged. A subject with retained messages and no consumer group at all counts
them as left for the group ``None``: nobody has taken them, and removing the broker group would
lose them.
"""

from __future__ import annotations

from typing import Any, Final

from qmq.store.broker_store import BrokerStore

# (subject, consumer group, left) pairs one heartbeat lists, the largest first: enough to name
# what holds a group back; the total counts every pair.
UNCONSUMED_LISTED_MAX: Final = 20


def unconsumed(store: BrokerStore) -> dict[str, Any]:
    """``{"total": N, "pairs": P, "top": [[subject, group or None, left], ...]}`` of ``store``."""
    left_of: list[tuple[int, str, str | None]] = []
    grouped: set[str] = set()
    for (subject, group), gp in store.progress.groups.items():
        grouped.add(subject)
        st = store.subjects.get(subject)
        # next_seq: a send taken but not yet durable counts too (it will be consumable)
        messages = max(st.visible_seq, st.next_seq) if st is not None else 0
        left = max(0, messages - gp.pull_offset) + sum(cp.unacked for cp in gp.consumers.values())
        if left:
            left_of.append((left, subject, group))
    for subject, st in store.subjects.items():
        if subject in grouped:
            continue
        left = max(0, max(st.visible_seq, st.next_seq) - st.clog.min_seq)
        if left:
            left_of.append((left, subject, None))
    left_of.sort(key=lambda item: (-item[0], item[1], item[2] or ""))
    return {
        "total": sum(item[0] for item in left_of),
        "pairs": len(left_of),
        "top": [[subject, group, left] for left, subject, group in left_of[:UNCONSUMED_LISTED_MAX]],
    }
