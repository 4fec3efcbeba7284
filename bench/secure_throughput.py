"""The cost of TLS and auth: W1's shape (acknowledged publish of 1 KiB messages, one producer,
batches of 100, a window of 1,000 in flight, no consumer) against a fresh `qmq standalone`
without and with TLS on every port and an auth file (the producer authenticates once per
connection and every send batch is checked against its produce patterns), `--repeats` times
each; the ratio is secure ÷ plain of the medians.

The certificates are made with the `openssl` command (a throw-away CA and a server
certificate for 127.0.0.1); the secrets' scrypt hashes have the default cost. Which of the two
goes first alternates from one repeat to the next: the page cache of a run is still being
written back while the next one runs, so a fixed order would charge it to the second.

    .venv/bin/python -m bench.secure_throughput [--messages 200000] [--repeats 2] [--flush sync|periodic]
        [--parts tls,auth|tls|auth]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from bench.payload import make_body
from qmq.aio import Producer
from qmq.auth.secrets import hash_secret
from qmq.testing import running_standalone

_WINDOW_MESSAGES = 1_000
_BATCH_MESSAGES = 100
CLUSTER_SECRET = "bench-cluster-secret"
APP_SECRET = "bench-app-secret"


def make_pki(tmp: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1, made with openssl."""
    files = {name: tmp / f"{name}.pem" for name in ("ca", "ca_key", "cert", "key", "csr")}
    ext = tmp / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
        "-subj", "/CN=qmq bench CA", "-keyout", str(files["ca_key"]), "-out", str(files["ca"]))  # fmt: skip
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", str(files["key"]), "-out", str(files["csr"]))  # fmt: skip
    run("x509", "-req", "-in", str(files["csr"]), "-CA", str(files["ca"]), "-CAkey", str(files["ca_key"]),
        "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(files["cert"]))  # fmt: skip
    return files


async def publish(meta_server: str, messages: int, secret: str | None, ctx: ssl.SSLContext | None) -> float:
    """Messages per second of one acknowledged publish of ``messages`` 1 KiB messages."""
    async with Producer(
        app_code="bench", meta_server=meta_server, secret=secret, ssl=ctx, batch_messages_max=_BATCH_MESSAGES
    ) as producer:
        warm = producer.generate_message("bench.secure")
        warm.body = make_body(0, 0, 0)
        await producer.send(warm)  # connect (and authenticate) before the clock starts
        window: asyncio.Semaphore = asyncio.Semaphore(_WINDOW_MESSAGES)
        pending: set[asyncio.Future[None]] = set()
        started = time.perf_counter()
        cpu_started = time.process_time()
        for seq in range(messages):
            await window.acquire()
            message = producer.generate_message("bench.secure")
            message.body = make_body(seq, 0, 0)
            fut = producer.send_nowait(message)
            pending.add(fut)
            fut.add_done_callback(lambda f: _done(f, pending, window))
        if pending:
            await asyncio.gather(*pending)
        elapsed = time.perf_counter() - started
        stats = producer.stats
        cpu_s = time.process_time() - cpu_started
        print(f"  frames {stats.frames_sent}, retries {stats.retries}, client CPU {cpu_s:.2f} s", flush=True)
        return messages / elapsed


def _done(fut: asyncio.Future[None], pending: set[asyncio.Future[None]], window: asyncio.Semaphore) -> None:
    pending.discard(fut)
    window.release()


def one_run(tmp: Path, run: int, secure: bool, messages: int, flush: str, pki: dict[str, Path], parts: str) -> float:
    data = tmp / f"run{run}-{'secure' if secure else 'plain'}"
    config = {"broker": {"flush": flush}}
    args: list[str] = []
    env: dict[str, str] = {}
    ctx: ssl.SSLContext | None = None
    secret: str | None = None
    if secure and "auth" in parts:
        auth = tmp / "auth.toml"
        auth.write_text(
            f'[apps.qmq-cluster]\nsecret_hash = "{hash_secret(CLUSTER_SECRET)}"\ncluster = true\n'
            f'[apps.bench]\nsecret_hash = "{hash_secret(APP_SECRET)}"\nproduce = ["bench.*"]\nconsume = ["bench.*"]\n'
        )
        args = ["--auth-file", str(auth), "--app-code", "qmq-cluster"]
        env["QMQ_SECRET"] = CLUSTER_SECRET
        secret = APP_SECRET
    if secure and "tls" in parts:
        args += ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])]
        env["SSL_CERT_FILE"] = str(pki["ca"])
        ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    with (
        running_standalone(data, config=config, extra_args=args, env=env) as proc,
        asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner,
    ):
        return runner.run(publish(proc.meta_server, messages, secret, ctx))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--flush", choices=["sync", "periodic"], default="sync")
    parser.add_argument(
        "--parts", choices=["tls,auth", "tls", "auth"], default="tls,auth", help="what the secure runs turn on"
    )
    opts = parser.parse_args()
    rates: dict[str, list[float]] = {"plain": [], "secure": []}
    with tempfile.TemporaryDirectory(prefix="qmq-secure-bench-") as name:
        tmp = Path(name)
        pki = make_pki(tmp)
        for run in range(opts.repeats):
            # which goes first alternates: a run's data is still being written back while the next runs
            for on in (False, True) if run % 2 == 0 else (True, False):
                rate = one_run(tmp, run, on, opts.messages, opts.flush, pki, opts.parts)
                rates["secure" if on else "plain"].append(rate)
                print(f"run {run + 1} {'TLS+auth' if on else 'plain   '}: {rate:,.0f} msg/s", flush=True)
    plain, secure = statistics.median(rates["plain"]), statistics.median(rates["secure"])
    result: dict[str, Any] = {
        "workload": "W1 shape: 1 KiB, one producer, window 1000, batches of 100",
        "flush": opts.flush,
        "secure_parts": opts.parts,
        "messages": opts.messages,
        "plain_msgs_per_s": rates["plain"],
        "secure_msgs_per_s": rates["secure"],
        "ratio_secure_to_plain": round(secure / plain, 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
