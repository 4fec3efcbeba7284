"""What the outbox sends: a message whose encoding is the stored bytes, with the fields a
producer reads of the object (id, creation and due time) agreeing with them."""

from __future__ import annotations

from datetime import UTC, datetime

from qmq.client.message import Message
from qmq.protocol.message import decode_message
from qmq.tx.stored import StoredMessage


def test_stored_message_is_the_stored_bytes() -> None:
    m = Message("orders.paid", message_id="order-42", body="b", properties={"k": 1}, tags=["t"])
    m.set_deliver_at(datetime(2030, 1, 1, tzinfo=UTC))
    encoded = m.encode()
    stored = StoredMessage(m.subject, m.message_id, encoded)
    assert stored.encode() == encoded
    assert (stored.subject, stored.message_id) == ("orders.paid", "order-42")
    assert stored.created_ms == m.created_ms
    assert stored.deliver_at_ms == m.deliver_at_ms
    retried = decode_message(stored.encode(times=2))
    assert retried.times == 2
    assert retried.message_id == "order-42"
