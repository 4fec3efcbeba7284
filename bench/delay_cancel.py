"""Cost of a cancel and of a page of DELAY_LIST on a delay store holding a backlog, without a
network: ``--messages`` due uniformly over ``--days`` appended straight to a ``DelayStore``,
then one cancel of an id it does not hold (every bucket's id file searched), one of an id it
holds, and one page of a subject's pending messages, each timed on its own, one thread.

    .venv/bin/python -m bench.delay_cancel                          # 1,000,000 over 30 days
    .venv/bin/python -m bench.delay_cancel --messages 100000 --days 1

The server runs the file-reading part of both on its checkpoint thread (qmq.delay.cancel,
qmq.delay.listing), so these are the latency of one request, not time the loop is held.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from qmq.common.config import DelayConfig
from qmq.delay import listing
from qmq.delay.store import DelayStore
from qmq.protocol.message import encode_message, scan_batch

DAY_MS = 86_400_000
_BATCH = 1_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument(
        "--days", type=float, default=30.0, help="due uniformly over this many days from two minutes on"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the store goes (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qmq-delay-cancel-", dir=args.dir) as tmp:
        store = DelayStore(DelayConfig(data_dir=Path(tmp)))
        store.open()
        now = int(time.time() * 1000)
        rnd = random.Random(1)
        for f in range(args.messages // _BATCH):
            frame = b"".join(
                encode_message(
                    b"bench.cancel", f"m-{f}-{i}".encode(), b"", 0, b"", b"x" * 100, now,
                    now + 120_000 + int(rnd.random() * args.days * DAY_MS),
                )
                for i in range(_BATCH)
            )  # fmt: skip
            store.append(frame, scan_batch(frame))
        store.flush_buffers()
        held = f"m-{args.messages // _BATCH // 2}-7"
        for label, message_id in (("an id not held", "not-held"), ("an id held", held)):
            started = time.perf_counter()
            written = store.cancel_search(message_id)()  # the checkpoint thread's part
            searched_s = time.perf_counter() - started
            stopped = store.cancel(message_id, None, written)  # the loop's part
            total_s = time.perf_counter() - started
            print(
                f"{args.messages:,} pending in {len(store.buckets)} buckets: cancel of {label} "
                f"{total_s * 1000:.1f} ms ({searched_s * 1000:.1f} ms of it on the worker thread), stopped {stopped}"
            )
        started = time.perf_counter()
        buckets = listing.buckets_to_list(list(store.iter_buckets()), store.bucket_ms, 0, 1 << 62)
        page, following = listing.list_pending(buckets, b"bench.cancel", 0, 1 << 62, 500, None)
        print(
            f"one DELAY_LIST page of {len(page.items)} messages: {(time.perf_counter() - started) * 1000:.1f} ms"
            f"{' (more follow)' if following else ''}"
        )
        store.close()


if __name__ == "__main__":
    main()
