"""The campaign's load: a producer or a consumer, each its own process (it can be killed too),
writing its history (history.py) as it goes.

    python -m chaos.worker produce --meta-server URL --history FILE [--rate N] [--tx-db PATH]
    python -m chaos.worker consume --meta-server URL --history FILE --group G --consumer-id C

The producer sends a mix: realtime messages, delay messages due 1 to 4 s later, and (with
``--tx-db``) transactional sends through an outbox in SQLite, until SIGTERM. The consumer pulls
(main and retry subjects), fails one first delivery in ten (it comes back through the retry
subject), acknowledges the rest, and records each ack it saw answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from chaos.history import HistoryFile, now_ms

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from qmq.aio import Producer
    from qmq.aio.tx import TransactionalProducer

SUBJECT = "chaos.orders"
_IN_FLIGHT_MAX = 64
_PULL_MAX = 100


class _Stop:
    def __init__(self) -> None:
        self.event = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.event.set)


async def produce(meta_server: str, history: HistoryFile, rate: int, tx_db: str | None) -> None:
    from qmq.aio import Message, Producer, QmqError

    stop = _Stop()
    slots = asyncio.Semaphore(_IN_FLIGHT_MAX)
    tasks: set[asyncio.Task[None]] = set()
    async with Producer(app_code="chaos", meta_server=meta_server) as producer:
        tx = await _tx_producer(producer, tx_db) if tx_db else None

        async def one(m: Message, kind: str) -> None:
            try:
                if kind == "tx" and tx is not None:
                    engine, txp = tx
                    async with engine.begin() as conn:
                        await txp.send(conn, m)
                else:
                    await producer.send(m)
            except QmqError:
                return  # not acknowledged: the checker does not count on it
            finally:
                slots.release()
            history.write([f"A\t{m.message_id}\t{now_ms()}\n"])

        interval_s = 1 / rate
        while not stop.event.is_set():
            await slots.acquire()
            m = Message.generate(SUBJECT)
            m.body = m.message_id  # the checker tells a damaged record by it
            roll = random.random()
            kind = "tx" if tx is not None and roll < 0.1 else "delay" if roll < 0.3 else "rt"
            if kind == "delay":
                m.set_delay(random.uniform(1.0, 4.0))
            history.write([f"S\t{m.message_id}\t{kind}\t{m.deliver_at_ms}\n"])
            task = asyncio.ensure_future(one(m, kind))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.event.wait(), interval_s)
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        if tx is not None:
            await tx[1].close()
            await tx[0].dispose()


async def _tx_producer(producer: Producer, path: str) -> tuple[AsyncEngine, TransactionalProducer]:
    from sqlalchemy.ext.asyncio import create_async_engine

    from qmq.aio.tx import TransactionalProducer

    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    txp = TransactionalProducer(producer, engine, create_table=True)
    await txp.start()
    return engine, txp


async def consume(meta_server: str, history: HistoryFile, group: str, consumer_id: str) -> None:
    from qmq.aio import Consumer, QmqError

    stop = _Stop()
    async with Consumer(
        app_code="chaos", meta_server=meta_server, consumer_id=consumer_id, retry_pull_interval_ms=200
    ) as consumer:
        pull = consumer.pull_consumer(SUBJECT, group, "earliest", retry_backoff=[1.0])
        waiting: list[str] = []  # acks recorded, not yet seen answered
        while not stop.event.is_set():
            try:
                batch = await pull.pull(max_messages=_PULL_MAX, timeout_ms=500)
            except QmqError:
                await asyncio.sleep(0.2)  # brokers away (killed, cut off): ask again shortly
                batch = None
            if batch:
                ms = now_ms()
                history.write(f"D\t{group}\t{m.message_id}\t{m.times}\t{ms}\n" for m in batch)
                # where each copy came from (the broker group and its consume-log place), for the checker's examples
                history.write(
                    f"W\t{group}\t{m.message_id}\t{m.times}\t{ms}\t{m._tracker.broker_group}\t{m.sequence}\n"
                    for m in batch
                )
                for m in batch:
                    if m.times == 1 and hash(m.message_id) % 10 == 0:
                        m.nack()
                    else:
                        m.ack()
                        waiting.append(f"{m.message_id}\t{m.times}")
            if waiting:
                unheld = consumer.acks_unheld
                try:
                    await consumer.flush_acks()
                except QmqError as exc:
                    if not exc.retriable:
                        # refused for good: the SDK dropped those acks, never answered as done;
                        # a later empty flush must not record them as answered
                        waiting = []
                    continue
                if consumer.acks_undelivered or consumer.acks_pending:
                    # a broker went away mid-request (killed, cut off), or its group was not
                    # available to send to: flush_acks kept the acks for the next flush without
                    # an answer and without an error, so none may be recorded as answered yet
                    continue
                if consumer.acks_unheld > unheld:
                    # the broker said some of these acks named positions it never handed out (a
                    # pull from a master since replaced): they did nothing and their messages come
                    # again, so none of this flush is recorded as answered (the SDK counts, not names, them)
                    waiting = []
                    continue
                ms = now_ms()
                history.write(f"K\t{group}\t{w}\t{ms}\n" for w in waiting)
                waiting = []


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos.worker")
    parser.add_argument("what", choices=("produce", "consume"))
    parser.add_argument("--meta-server", required=True)
    parser.add_argument("--history", required=True, type=Path)
    parser.add_argument("--rate", type=int, default=200, help="sends a second at most")
    parser.add_argument("--tx-db", default=None, help="SQLite file of the transactional outbox")
    parser.add_argument("--group", default="g1")
    parser.add_argument("--consumer-id", default="c1")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    history = HistoryFile(args.history)
    if args.what == "produce":
        coro = produce(args.meta_server, history, args.rate, args.tx_db)
    else:
        coro = consume(args.meta_server, history, args.group, args.consumer_id)
    print("qmq ready worker", flush=True)
    asyncio.run(coro)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
