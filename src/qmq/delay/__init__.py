"""The delay server: a write-ahead log, schedule logs per time bucket, an in-memory timer of
what is about to come due, and hand-over to brokers through the SDK's producer.

Path of a delay message: SEND_MESSAGES (handlers.py) → the write-ahead log (store.py;
acknowledged once durable) → the schedule log of its time bucket (schedule.py, bucket.py) →
loaded into the timer shortly before the bucket starts (scheduler.py, timer.py) → handed to a
broker when due (dispatcher.py) → its entry number in the bucket's dispatch log (dispatch_log.py).

    server.py      the process: connections, group commit, checkpoints on their thread, shutdown
    handlers.py    what each request code does (PING, SEND_MESSAGES, DELAY_STATS, CANCEL_DELAY, DELAY_LIST)
    store.py       DelayStore: the data directory, the write-ahead log, a send's checks, checkpoints
    recovery.py    builds the store's parts again from its files after any stop
    schedule.py    the time buckets together: replay of records into them, buffers, writes, fsyncs
    far.py         messages of far buckets waiting for the next flush, sorted into buckets in bulk
    bucket.py      one bucket's schedule log: messages and index, and their layouts
    dispatch_log.py  a bucket's dispatch log: what is done with, each entry with a CRC32C
    ids.py         a bucket's id file: a hash of each message id, so a cancel finds a message
    cancel.py      cancels: what one stops, its write-ahead log record, keeping it from the hand-over
    repeat.py      the copies a repeating message becomes as it arrives
    listing.py     DELAY_LIST: a page of a subject's pending messages by due time
    checkpoint.py  the checkpoint's contents and layout, and the job that writes it
    scheduler.py   which buckets are loaded, what is due, reading due records, acknowledgements
    timer.py       the in-memory timer: rows of loaded buckets' messages sorted by due time
    dispatcher.py  hands due messages to brokers through the producer, records what they took
    metrics.py     the Prometheus metrics
"""

from qmq.delay.server import DelayServer, run_delay

__all__ = ["DelayServer", "run_delay"]
