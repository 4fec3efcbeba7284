"""One consumer process of the ordered-message tests and bench: an ordered listener that writes a
line per handled message to a file, ``key n start_ns end_ns``.

    python ordered_worker.py META_SERVER SUBJECT GROUP CONSUMER_ID OUT_PATH [HANDLER_MS] [CONCURRENCY]

Prints ``qmq ready role=ordered-worker`` once its listener runs; stops on SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

from qmq.aio import Consumer, ReceivedMessage


async def main(argv: list[str]) -> None:
    meta_server, subject, group, consumer_id, out_path = argv[:5]
    handler_s = (float(argv[5]) if len(argv) > 5 else 0.0) / 1000
    concurrency = int(argv[6]) if len(argv) > 6 else 32
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def handle(m: ReceivedMessage) -> None:
        start = time.time_ns()
        if handler_s:
            await asyncio.sleep(handler_s)
        os.write(fd, f"{m.order_key} {m.body.decode()} {start} {time.time_ns()}\n".encode())

    async with Consumer(app_code="ordered-test", meta_server=meta_server, consumer_id=consumer_id) as consumer:
        consumer.add_listener(
            subject, group, handle, start_from="earliest", ordered=True, concurrency=concurrency, prefetch=512
        )
        print("qmq ready role=ordered-worker", flush=True)
        await stop.wait()
    os.close(fd)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
