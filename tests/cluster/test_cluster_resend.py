"""A message sent again by another producer — an outbox watchdog resending a row, a delay server
handing over again after a restart, an application retrying a send whose answer never came —
goes to the broker group its message id picks (client/routing.py), the one that may have
stored it, whose duplicate window drops it: it is never stored twice by two groups (found by
the fault campaign, which saw such second copies delivered after the first one's ack)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from clusterhelpers import cluster_up, fast_config, sent_one_by_one, stored_by_group

from qmq.aio import Producer
from qmq.common.errors import SendError

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

SUBJECT = "resend.orders"
MESSAGES = 40


async def test_a_message_sent_again_by_another_producer_is_dropped_by_the_group_that_stored_it(
    tmp_path: Path,
) -> None:
    args = ["--broker-groups", "2", "--slaves", "0", "--delay-groups", "0"]
    with cluster_up(tmp_path / "cluster", args, fast_config(tmp_path / "fast.toml")) as c:
        messages = await sent_one_by_one(c.meta_server, SUBJECT, MESSAGES)
        stored = await stored_by_group(c.meta_server, SUBJECT)
        assert sum(stored.values()) == MESSAGES
        assert len(stored) == 2, stored
        assert min(stored.values()) > 0, stored  # both groups took some
        # a new producer, as a watchdog or a restarted delay server is, sends the same bytes again
        async with Producer(app_code="shop", meta_server=c.meta_server) as again:
            for m in reversed(messages):  # not in the first order: which ones it resends is its own
                await again.send_encoded(SUBJECT, m.encode(), m.message_id)
            assert again.stats.duplicates == MESSAGES
        assert await stored_by_group(c.meta_server, SUBJECT) == stored


async def test_a_resend_waits_for_the_group_its_id_picks_while_that_group_is_down(
    tmp_path: Path,
) -> None:
    # a delay server handing over again after a restart, or the outbox watchdog, while the group
    # that stored the first send is away: sent to the other group, it would be stored twice
    args = ["--broker-groups", "2", "--slaves", "0", "--delay-groups", "0"]
    with cluster_up(tmp_path / "cluster", args, fast_config(tmp_path / "fast.toml")) as c:
        messages = await sent_one_by_one(c.meta_server, SUBJECT, MESSAGES)
        stored = await stored_by_group(c.meta_server, SUBJECT)
        assert min(stored.values()) > 0, stored
        os.kill(c.member("b2-m").pid, signal.SIGKILL)
        await asyncio.to_thread(
            c.wait_view,
            "b2 unavailable",
            lambda v: any(g["group"] == "b2" and g["state"] != "available" for g in v["groups"]),
        )
        async with Producer(app_code="shop", meta_server=c.meta_server, send_timeout_ms=5_000) as again:
            results = await asyncio.gather(
                *(again.send_encoded(SUBJECT, m.encode(), m.message_id) for m in reversed(messages)),
                return_exceptions=True,
            )
        failed = [r for r in results if isinstance(r, BaseException)]
        assert all(isinstance(r, SendError) for r in failed), failed
        # those b2 stored wait for it (a group without a slave stays in the meta server's answer)
        # and fail after send_timeout_ms, to be sent again later, never to b1
        assert len(failed) == stored["b2"]
        assert again.stats.duplicates == stored["b1"]  # the rest went to b1, which dropped them
        assert (await stored_by_group(c.meta_server, SUBJECT))["b1"] == stored["b1"]


async def test_a_resending_producer_waits_for_a_read_only_group_rather_than_store_it_twice(
    tmp_path: Path,
) -> None:
    # a delay server's hand-overs and the outbox watchdog (ProducerOptions.resends): the group
    # their message ids pick turned read-only (its slave gone), so it takes no sends and a plain
    # producer goes to the other group; what they send may be stored there already
    args = ["--broker-groups", "2", "--slaves", "1", "--delay-groups", "0"]
    with cluster_up(tmp_path / "cluster", args, fast_config(tmp_path / "fast.toml")) as c:
        c.wait_view(
            "both slaves replicating",
            lambda v: sum(1 for s in v["servers"] if s["role_in_group"] == "slave" and s["replicated_ms"] > 0) == 2,
        )
        messages = await sent_one_by_one(c.meta_server, SUBJECT, MESSAGES)
        stored = await stored_by_group(c.meta_server, SUBJECT)
        assert min(stored.values()) > 0, stored
        os.kill(c.member("b2-s1").pid, signal.SIGKILL)
        await asyncio.to_thread(
            c.wait_view,
            "b2 read-only",
            lambda v: any(g["group"] == "b2" and g["write_state"] == "read-only" for g in v["groups"]),
        )
        async with Producer(app_code="shop", meta_server=c.meta_server, resends=True, send_timeout_ms=3_000) as again:
            results = await asyncio.gather(
                *(again.send_encoded(SUBJECT, m.encode(), m.message_id) for m in reversed(messages)),
                return_exceptions=True,
            )
        failed = [r for r in results if isinstance(r, BaseException)]
        assert all(isinstance(r, SendError) for r in failed), failed
        assert len(failed) == stored["b2"]  # they wait for b2, to be sent again later
        assert again.stats.duplicates == stored["b1"]
        assert (await stored_by_group(c.meta_server, SUBJECT))["b1"] == stored["b1"]
