"""What a pull costs the broker's store when its records lie apart in the message log: W7's shape
(many subjects sent to round-robin, so a subject's records are one in ``--subjects`` of the
log), in-process, without a server.

Stores ``--subjects`` × ``--per-subject`` messages of 1 KiB (one batch a round, every subject
once), then pulls each subject ``--take`` at a time, one group, round after round, until all
are taken: µs per record and per pull (each record is its own read; the pull's action-log record
is written, as a broker's is). ``--profile`` prints cProfile's top functions of the pulls.

    .venv/bin/python -m bench.scattered_reads [--subjects 1000] [--per-subject 200] [--take 25] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path

from qmq.common.config import BrokerConfig
from qmq.protocol.message import encode_message, scan_batch
from qmq.store.broker_store import BrokerStore

_BODY = b"x" * 1024


def measure(subjects: int, per_subject: int, take: int, profile: bool) -> dict[str, float]:
    names = [f"w7.s{i:05d}" for i in range(subjects)]
    with tempfile.TemporaryDirectory() as tmp:
        store = BrokerStore(BrokerConfig(data_dir=Path(tmp) / "broker", flush="periodic"))
        store.open()
        try:
            for j in range(per_subject):
                body = b"".join(encode_message(s.encode(), f"{s}-{j}".encode(), b"", 0, b"", _BODY, 1) for s in names)
                store.append(body, scan_batch(body))  # visible at once under flush = "periodic"
            pairs = []
            for s in names:
                gp = store.group(s, "bench", "earliest")
                pairs.append((gp, gp.consumer("c1")))
            prof = cProfile.Profile() if profile else None
            records = pulls = 0
            started = time.perf_counter()
            if prof is not None:
                prof.enable()
            for _round in range((per_subject + take - 1) // take):
                for gp, cp in pairs:
                    result = store.pull(gp, cp, "session", take)
                    if result is not None:
                        records += result.messages
                        pulls += 1
            if prof is not None:
                prof.disable()
            elapsed = time.perf_counter() - started
        finally:
            store.close()
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return {
        "subjects": subjects,
        "records": records,
        "pulls": pulls,
        "us_per_record": round(elapsed / max(1, records) * 1e6, 2),
        "us_per_pull": round(elapsed / max(1, pulls) * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subjects", type=int, default=1000)
    parser.add_argument("--per-subject", type=int, default=200)
    parser.add_argument("--take", type=int, default=25, help="messages a pull (the W7 adapter's 25)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    print(json.dumps(measure(args.subjects, args.per_subject, args.take, args.profile)))


if __name__ == "__main__":
    main()
