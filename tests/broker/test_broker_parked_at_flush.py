"""Under flush = "sync" a long poll takes what sends wrote when the next flush begins: every
send made until then goes to the same pull (its answer waits for that flush either way)."""

from __future__ import annotations

from pathlib import Path

from rawclient import message

from qmq.broker.pulls import ParkedPull, ParkedPulls
from qmq.common.clock import ManualClock
from qmq.common.config import BrokerConfig
from qmq.protocol.message import scan_batch
from qmq.store.broker_store import BrokerStore, PullResult


async def test_a_long_poll_woken_at_the_flush_takes_every_send_made_before_it(tmp_path: Path) -> None:
    store = BrokerStore(BrokerConfig(data_dir=tmp_path / "broker"), ManualClock())
    store.open()
    try:
        parked = ParkedPulls(store, lambda _n: None)
        gp = store.group("s", "g", "earliest")
        answers: list[PullResult | None] = []
        pull = ParkedPull(object(), gp, gp.consumer("c"), "x", 100, None, answers.append, lambda exc: None)
        parked.park(pull, 30_000)
        for i in range(3):
            body = message("s", f"m{i}")
            store.append(body, scan_batch(body))
            parked.notify_at_flush({"s"})
        assert answers == []  # nothing taken at the sends
        parked.notify_at_flush({"other"})
        parked.take_flush_wakes()  # the group commit's next flush begins
        assert len(answers) == 1
        result = answers[0]
        assert result is not None
        assert (result.messages, result.runs) == (3, [[0, 3]])
        parked.take_flush_wakes()  # nothing named since: nothing tried
        assert len(answers) == 1
    finally:
        store.close()
