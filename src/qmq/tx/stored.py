"""A message whose encoding was fixed when it was written to the outbox.

The outbox stores the bytes ``Message.encode()`` produced in the application's
transaction; every send of that row (right after the commit, or by a watchdog much later)
hands the producer those same bytes, so the broker sees the same id, creation time,
properties and body each time and its duplicate window recognises a repeat.
"""

from __future__ import annotations

from qmq.client.message import Message
from qmq.protocol.message import HEADER, HEADER_BYTES, with_times

# Indexes of created_ms and deliver_at_ms in qmq.protocol.message.HEADER.
_CREATED = 6
_DELIVER_AT = 7


class StoredMessage(Message):
    """A ``Message`` that encodes to the stored bytes it was made from."""

    __slots__ = ("_encoded",)

    def __init__(self, subject: str, message_id: str, encoded: bytes) -> None:
        super().__init__(subject, message_id=message_id)
        if len(encoded) >= HEADER_BYTES:
            # What a producer reads of the object rather than of the bytes must agree with them
            # (a message due later goes to a delay server).
            header = HEADER.unpack_from(encoded, 0)
            self._created_ms = int(header[_CREATED])
            self._deliver_at_ms = int(header[_DELIVER_AT])
        self._encoded = encoded

    def encode(self, times: int = 1) -> bytes:
        return self._encoded if times == 1 else with_times(self._encoded, times)

    def __repr__(self) -> str:
        return f"StoredMessage(subject={self.subject!r}, message_id={self.message_id!r}, {len(self._encoded)} bytes)"
