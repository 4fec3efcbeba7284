"""CPU cost of the delay server's intake, without a network or a client: frames of messages due
uniformly over ``--days`` appended straight to a ``DelayStore`` (write-ahead log, replay into
time buckets, their buffers written at ``schedule_buffer_bytes_max``), one thread.

    .venv/bin/python -m bench.delay_intake                 # 2,000 frames of 100 messages over 30 days
    .venv/bin/python -m bench.delay_intake --days 0.01     # due within minutes: the loaded-bucket path

Prints microseconds per message for the whole append and for the replay step alone.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from qmq.common.config import DelayConfig
from qmq.delay.store import DelayStore
from qmq.protocol.message import encode_message, scan_batch

DAY_MS = 86_400_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=2_000)
    parser.add_argument("--batch", type=int, default=100, help="messages per frame")
    parser.add_argument("--days", type=float, default=30.0, help="due uniformly over this many days from a minute on")
    parser.add_argument("--body-bytes", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qmq-delay-intake-") as tmp:
        store = DelayStore(DelayConfig(data_dir=Path(tmp)))
        store.open()
        now = int(time.time() * 1000)
        rnd = random.Random(1)
        body = b"x" * args.body_bytes
        frames = [
            b"".join(
                encode_message(
                    b"intake.s", f"m-{f}-{i}".encode(), b"", 0, b"", body, now,
                    now + 60_000 + int(rnd.random() * args.days * DAY_MS),
                )
                for i in range(args.batch)
            )
            for f in range(args.frames)
        ]
        replay_s = 0.0
        replay = store.replay

        def timed_replay(*a, **k):  # type: ignore[no-untyped-def]
            nonlocal replay_s
            t = time.perf_counter()
            try:
                return replay(*a, **k)
            finally:
                replay_s += time.perf_counter() - t

        store.replay = timed_replay  # type: ignore[method-assign]
        started = time.perf_counter()
        for frame in frames:
            store.append(frame, scan_batch(frame))
        store.flush_buffers()
        total_s = time.perf_counter() - started
        store.close()
    n = args.frames * args.batch
    print(
        f"{n:,} messages due over {args.days:g} days: scan + append {total_s / n * 1e6:.2f} us/msg, "
        f"of which replay {replay_s / n * 1e6:.2f} us/msg; {n / total_s:,.0f} msg/s on one thread"
    )


if __name__ == "__main__":
    main()
