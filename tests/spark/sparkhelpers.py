"""Helpers of the Spark tests: sending test messages."""

from __future__ import annotations

import qmq


def send_messages(meta_server: str, subject: str, n: int, body_bytes: int = 20, start: int = 0) -> list[str]:
    """Send ``n`` messages (property i, tag odd/even) and return their ids in the order stored."""
    ids = []
    # one frame in flight: stored in the order sent even if a frame is retried
    with qmq.Producer(app_code="spark-tests", meta_server=meta_server, max_in_flight=1) as producer:
        futures = []
        for i in range(start, start + n):
            m = producer.generate_message(subject)
            m.body = f"{i:0{body_bytes}d}".encode()
            m.set_property("i", i)
            m.add_tag("odd" if i % 2 else "even")
            futures.append(producer.send_async(m))
            ids.append(m.message_id)
        for f in futures:
            f.result(30)
    return ids
