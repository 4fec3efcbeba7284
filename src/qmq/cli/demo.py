"""The README's demo: send one message and consume it, printing both, through the blocking SDK."""

from __future__ import annotations

import time


def run_demo(meta_server: str) -> None:
    from qmq.client.sync import Consumer, Producer

    subject = "demo.order.paid"
    with Consumer(app_code="demo-billing", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, group="demo-billing", start_from="earliest")
        with Producer(app_code="demo-shop", meta_server=meta_server) as producer:
            msg = producer.generate_message(subject)
            msg.set_property("orderId", "42")
            msg.body = f"paid at {time.strftime('%H:%M:%S')}".encode()
            producer.send(msg)
            print(f"demo: sent     {subject} id={msg.message_id} orderId='42' body={msg.body!r}", flush=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for m in pull.pull(max_messages=10, timeout_ms=1000):
                m.ack()
                if m.message_id == msg.message_id:
                    print(
                        f"demo: consumed {m.subject} id={m.message_id} orderId={m.get_property('orderId')!r} "
                        f"body={m.body!r}",
                        flush=True,
                    )
                    print("demo: done; the server keeps running (Ctrl-C stops it)", flush=True)
                    return
        raise RuntimeError(f"the demo message {msg.message_id} did not come back within 10 s")
