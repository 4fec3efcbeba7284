"""Commit latency added by a transactional send (the outbox insert and the after-commit hand-over).

    .venv/bin/python -m bench.tx_latency [--db URL] [--meta-server URL] [--commits 500]

Each iteration times two transactions on PostgreSQL, in alternating order so drift hits
both alike: one inserting a business row ("without"), one inserting the same row and
calling ``TransactionalProducer.send`` ("with"), each from ``engine.begin()`` to the end of
the commit; the after-commit send is part of the commit call, the broker's answer and the
outbox row's deletion are not (they happen after it, off the application's thread). Prints
median, p99 and mean of each and the difference. Without ``--db`` it uses a fresh schema of
the local PostgreSQL (127.0.0.1:5432, user postgres); without ``--meta-server`` it starts a
``qmq standalone`` (flush policy "sync") in a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa

_PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
_WARMUP = 50

_meta = sa.MetaData()
payments = sa.Table(
    "bench_payments",
    _meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("amount_cents", sa.Integer, nullable=False),
    sa.Column("note", sa.String(100), nullable=False),
)


@contextlib.contextmanager
def _fresh_schema() -> Iterator[str]:
    admin = sa.create_engine(_PG_ADMIN, isolation_level="AUTOCOMMIT")
    name = f"qmq_bench_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {name}"))
    try:
        yield sa.make_url(_PG_ADMIN).update_query_dict({"options": f"-csearch_path={name}"}).render_as_string()
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {name} CASCADE"))
        admin.dispose()


@contextlib.contextmanager
def _meta_server(given: str | None) -> Iterator[str]:
    if given:
        yield given
        return
    from qmq.testing import running_standalone

    with tempfile.TemporaryDirectory(prefix="qmq-bench-tx-") as tmp, running_standalone(Path(tmp) / "data") as qmq:
        yield qmq.meta_server


def _summary(name: str, samples_ms: list[float]) -> str:
    ordered = sorted(samples_ms)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"| {name} | {statistics.median(ordered):.3f} | {p99:.3f} | {statistics.fmean(ordered):.3f} | {len(ordered)} |"
    )


def measure(db_url: str, meta_server: str, commits: int) -> tuple[list[float], list[float]]:
    from qmq.client.message import Message
    from qmq.client.sync import Producer
    from qmq.tx import TransactionalProducer

    engine = sa.create_engine(db_url, pool_size=2)
    _meta.create_all(engine)
    without: list[float] = []
    with_send: list[float] = []
    try:
        with (
            Producer(app_code="bench-tx", meta_server=meta_server) as producer,
            TransactionalProducer(producer, engine, create_table=True) as tx,
        ):
            row = {"amount_cents": 1234, "note": "a payment"}
            for i in range(_WARMUP + commits):
                order = (False, True) if i % 2 == 0 else (True, False)
                for outbox in order:
                    msg = Message("bench.payment.created", body=b'{"payment_id": 1, "amount_cents": 1234}')
                    started = time.perf_counter()
                    with engine.begin() as conn:
                        conn.execute(payments.insert(), row)
                        if outbox:
                            tx.send(conn, msg)
                    elapsed_ms = (time.perf_counter() - started) * 1000
                    if i >= _WARMUP:
                        (with_send if outbox else without).append(elapsed_ms)
            producer.flush()
    finally:
        engine.dispose()
    return without, with_send


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", help="PostgreSQL URL to use (default: a fresh schema of the local server)")
    parser.add_argument("--meta-server", help="meta_server URL of a running qmq (default: start one)")
    parser.add_argument("--commits", type=int, default=500, help="timed commits of each kind")
    args = parser.parse_args(argv)
    schema = contextlib.nullcontext(args.db) if args.db else _fresh_schema()
    with schema as db_url, _meta_server(args.meta_server) as meta_server:
        without, with_send = measure(db_url, meta_server, args.commits)
    print("| transaction | median ms | p99 ms | mean ms | commits |")
    print("|---|---|---|---|---|")
    print(_summary("insert + commit", without))
    print(_summary("insert + tx_producer.send + commit", with_send))
    added = statistics.median(with_send) - statistics.median(without)
    print(f"\nadded by tx_producer.send: {added:.3f} ms at the median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
