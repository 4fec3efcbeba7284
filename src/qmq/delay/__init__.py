"""The delay server: a write-ahead log, schedule logs per time bucket, an in-memory timer of
what is about to come due, and hand-over to brokers through the SDK's producer.

Path of a delay message: SEND_MESSAGES → write-ahead log (store.py; acknowledged once
durable, flusher.py) → the schedule log of its time bucket (bucket.py) → loaded into the
timer shortly before the bucket starts (scheduler.py, timer.py) → handed to a broker when due
(dispatcher.py) → its entry number in the bucket's dispatch log.
"""

from qmq.delay.server import DelayServer, run_delay

__all__ = ["DelayServer", "run_delay"]
