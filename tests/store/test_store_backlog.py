"""What a broker reports unconsumed in its heartbeat (qmq.broker.backlog), over a real store:
not pulled yet plus pulled and not acknowledged, per subject and consumer group, and a subject's
messages when no consumer group has pulled it."""

from __future__ import annotations

from collections.abc import Callable

from conftest import append, batch, flush
from qmq.broker.backlog import unconsumed
from qmq.store.broker_store import BrokerStore


def test_what_is_left_counts_unpulled_and_unacknowledged_messages_and_subjects_nobody_pulled(
    open_store: Callable[..., BrokerStore],
) -> None:
    store = open_store()
    assert unconsumed(store) == {"total": 0, "pairs": 0, "top": []}
    append(store, batch("s", [f"s{i}" for i in range(10)]))
    append(store, batch("t", ["t0", "t1", "t2"]))
    flush(store)
    assert unconsumed(store) == {"total": 13, "pairs": 2, "top": [["s", None, 10], ["t", None, 3]]}

    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("a")
    assert store.pull(gp, cp, "sa", 4) is not None
    # 6 not pulled yet and 4 pulled but not acknowledged
    assert unconsumed(store)["top"] == [["s", "g", 10], ["t", None, 3]]
    store.ack(gp, cp, [[0, 4]])
    assert unconsumed(store)["top"] == [["s", "g", 6], ["t", None, 3]]
    assert store.pull(gp, cp, "sa", 100) is not None
    store.ack(gp, cp, [[4, 10]])
    assert unconsumed(store) == {"total": 3, "pairs": 1, "top": [["t", None, 3]]}
