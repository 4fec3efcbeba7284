"""qmq.testing.load against a real standalone: a load is caught up only once its senders have
settled every send they made. A send still in flight when sending stops is acknowledged later;
taking had to go on for it (a rolling-restart test once stopped taking first and reported two
such sends as never delivered, though a pull right after handed them out)."""

from __future__ import annotations

import pytest

from qmq.aio import Consumer, Producer
from qmq.testing.load import Load

pytestmark = pytest.mark.integration


async def test_a_load_is_not_caught_up_while_its_senders_may_still_have_sends_in_flight(
    meta_server: str, subject: str
) -> None:
    async with (
        Producer(app_code="load", meta_server=meta_server) as producer,
        Consumer(app_code="load", meta_server=meta_server, consumer_id="taker") as consumer,
    ):
        load = Load(producer, consumer.pull_consumer(subject, "takers", start_from="earliest"), subject, senders=1)
        load.start()
        await load.until_acked(200)
        # The moment of the race: sending has stopped, the taker has everything acknowledged so far
        # (as if its last batch had just come), and the sender has not settled its sends yet.
        load._stop_sending.set()
        load.record.received.update(load.record.acked)
        load._check_caught_up()
        assert not load._caught_up.is_set(), "caught up before the sends in flight were settled"
        await load.stop()
        r = load.record
        assert not r.failed
        missing = r.acked.keys() - r.received
        assert not missing, f"{len(missing)} acknowledged sends not taken: the load stopped taking early"
