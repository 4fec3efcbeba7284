"""What OpenTelemetry costs the producer when installed with no SDK configured, in W1's shape:
1 KiB messages sent in batches of 100 with at most 1,000 unacknowledged, one producer.

    .venv/bin/python -m bench.otel_overhead --meta-server URL [--messages N] [--without-otel]

``--without-otel`` makes every import of ``opentelemetry`` fail, as if the ``otel`` extra were
not installed. Prints ``messages=N seconds=S rate=R cpu_us_per_message=C`` (acknowledged messages a second,
and the producer process's CPU time over the sends, start-up left out). Compare
the two with farm-bench, pairing the runs (docs/observability.md has the command and figures).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time


async def publish(meta_server: str, subject: str, total: int) -> tuple[float, float]:
    from qmq.aio import Producer

    body = os.urandom(1024)
    window: list[asyncio.Future[None]] = []
    async with Producer(app_code="bench", meta_server=meta_server) as producer:
        await producer.prepare([subject])
        start_s = time.perf_counter()
        cpu_start_s = time.process_time()
        sent = 0
        while sent < total:
            for _ in range(100):
                m = producer.generate_message(subject)
                m.body = body
                window.append(producer.send_nowait(m))
            sent += 100
            if len(window) >= 1_000:
                await asyncio.gather(*window[:100])
                del window[:100]
        await asyncio.gather(*window)
        return time.perf_counter() - start_s, time.process_time() - cpu_start_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meta-server", required=True)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--subject", default="bench.otel")
    parser.add_argument("--without-otel", action="store_true")
    args = parser.parse_args()
    if args.without_otel:
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]  # every import of it fails
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    seconds, cpu_s = asyncio.run(publish(args.meta_server, args.subject, args.messages))
    from qmq.client import telemetry

    print(
        f"otel={'installed' if telemetry.INSTALLED else 'absent'} messages={args.messages} "
        f"seconds={seconds:.3f} rate={args.messages / seconds:,.0f} "
        f"cpu_us_per_message={cpu_s / args.messages * 1e6:.2f}"
    )


if __name__ == "__main__":
    main()
