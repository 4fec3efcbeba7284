"""Helpers of the SDK's integration tests: pulling until a count with a deadline, and asking
the broker for a consumer group's lag over the SDK's own connection."""

from __future__ import annotations

import asyncio
from typing import Any

from qmq.aio import Batch, PullConsumer, ReceivedMessage
from qmq.client.connection import Connection
from qmq.client.meta import MetaClient
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode


async def pull_until(
    pull: PullConsumer, count: int, timeout_s: float = 20.0, max_messages: int = 500, ack: bool = True
) -> list[ReceivedMessage]:
    """Pull until ``count`` messages came (or fail at the deadline); ack them unless told not to."""
    got: list[ReceivedMessage] = []
    async with asyncio.timeout(timeout_s):
        while len(got) < count:
            batch: Batch = await pull.pull(max_messages=min(max_messages, count - len(got)), timeout_ms=1000)
            if ack:
                await batch.ack_all()
            got.extend(batch)
    return got


async def lag(meta_server: str, subject: str, group: str) -> dict[str, Any]:
    """The broker's LAG answer for (subject, group), from the subject's broker group."""
    meta = MetaClient(meta_server, timeout_ms=5000)
    await meta.start()
    try:
        route = await meta.resolve(subject)
        address = meta.available(route)[0].address
    finally:
        await meta.close()
    conn = Connection(address, connect_timeout_ms=5000)
    try:
        frame = await conn.request(RequestCode.LAG, {"subject": subject, "group": group})
    finally:
        await conn.close()
    return answer_of(frame)


async def wait_for_lag(
    meta_server: str, subject: str, group: str, key: str, value: int, timeout_s: float = 10.0
) -> dict[str, Any]:
    """Ask LAG until ``answer[key] == value``; fail at the deadline with the last answer."""
    answer: dict[str, Any] = {}
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                answer = await lag(meta_server, subject, group)
                if answer.get(key) == value:
                    return answer
                await asyncio.sleep(0.05)  # polling a condition, bounded by the deadline
    except TimeoutError:
        raise AssertionError(f"LAG {key} never became {value} within {timeout_s} s: {answer}") from None


async def wait_for_dead_letters(
    meta_server: str, subject: str, group: str, count: int, timeout_s: float = 20.0
) -> list[dict[str, Any]]:
    """Ask every broker for the dead letters of (subject, group) until ``count`` are there."""
    from qmq.cli.admin import ask_every_broker

    letters: list[dict[str, Any]] = []
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                answers = await ask_every_broker(
                    meta_server, RequestCode.DEAD_LETTERS, {"subject": subject, "group": group}
                )
                letters = [letter for h in answers.values() if isinstance(h, dict) for letter in h["letters"]]
                if len(letters) >= count:
                    return letters
                await asyncio.sleep(0.05)  # polling a condition, bounded by the deadline
    except TimeoutError:
        raise AssertionError(f"{len(letters)} of {count} dead letters within {timeout_s} s: {letters}") from None
