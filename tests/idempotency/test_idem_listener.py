"""A checker behind a blocking SDK listener (``idempotent_checker=``), against a real `qmq
standalone`: the transactional checker gives the handler its connection, and a second
message with the same business key is acknowledged without being applied."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from qmq.client.message import Message
from qmq.client.sync import Consumer, Producer, ReceivedMessage
from qmq.idempotency import TransactionalIdempotentChecker

pytestmark = pytest.mark.integration

_meta = sa.MetaData()
orders = sa.Table("applied_orders", _meta, sa.Column("n", sa.Integer, primary_key=True), sa.Column("order_id", sa.Text))


def test_transactional_checker_behind_a_listener(engine: sa.Engine, meta_server: str, subject: str) -> None:
    _meta.create_all(engine)
    delivered: list[str] = []
    lock = threading.Lock()

    def order_key(m: ReceivedMessage) -> str:
        # Called once per delivery, duplicates included: it also counts the deliveries.
        with lock:
            delivered.append(m.message_id)
        return str(m.get_property("orderId"))

    checker = TransactionalIdempotentChecker(engine, key=order_key, group="orders")

    def apply(m: ReceivedMessage, conn: sa.Connection) -> None:
        conn.execute(orders.insert().values(order_id=str(m.get_property("orderId"))))

    with Consumer(app_code="orders", meta_server=meta_server) as consumer:
        # The transactional checker calls handler(message, conn); the SDK types a one-argument handler.
        consumer.add_listener(subject, "orders", apply, start_from="earliest", idempotent_checker=checker)  # type: ignore[arg-type]
        with Producer(app_code="shop", meta_server=meta_server) as producer:
            for order_id in ("1", "1", "2"):
                producer.send(Message(subject, properties={"orderId": order_id}))
        deadline = time.monotonic() + 20
        while len(delivered) < 3:
            assert time.monotonic() < deadline, f"only {len(delivered)} of 3 messages were delivered"
            time.sleep(0.02)  # polling a condition, bounded by the deadline
    with engine.connect() as conn:
        assert sorted(conn.scalars(sa.select(orders.c.order_id))) == ["1", "2"]
