"""The cost of TLS and auth, measured with the main bench's own W1 and W3 cells
(`bench/workloads_basic.py`: the same worker processes, adapters, window, batches and
latency stamps as `python -m bench run`):

- W1: acknowledged publish of 1 KiB messages, one producer, batches of 100, a window of
  1,000 in flight, no consumer; msg/s.
- W3: one paced producer at 5,000 msg/s and one subscribed consumer; end-to-end latency
  p50/p99/p99.9 (and from the intended send time).

qmq runs as a fresh `qmq standalone` per repeat and variant: *plain*, and *secure* with TLS on
every port and an auth file (the clients authenticate once per connection and every send and
pull is checked against their app's patterns). The peer is RabbitMQ (the main bench's pika
adapter, durable quorum queues, publisher confirms): one private node (its own node name,
ports, epmd, config and data under the run's temp dir; the system's node is never touched)
with a plain listener and a TLS listener made from the same throw-away certificates; its
clients authenticate (guest) either way, so its figure is the cost of TLS alone.

The certificates are made with the `openssl` command (a throw-away CA and a server
certificate for 127.0.0.1). Which variant goes first alternates from one repeat to the next:
the page cache of a run is still being written back while the next one runs, so a fixed
order would charge it to the second. Ratios are secure ÷ plain of the medians (for W3,
plain ÷ secure of the latency percentiles, so below 1 is a cost either way).

    .venv/bin/python -m bench.secure_throughput [--quick] [--repeats 2] [--flush sync|periodic]
        [--parts tls,auth|tls|auth] [--peers rabbitmq|""] [--only W1,W3] [--w1-messages N]

`python -m bench run` runs it as its W13 cell ("TLS"): for each qmq flush policy of the run
(``--flush``, ``--peers ""``) and, RabbitMQ among its peers, for RabbitMQ (``--no-qmq``), with the
run's own knobs (``--settings``); it reads the JSON line this prints.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.cell import Cell, timed
from bench.servers.base import ServerProcess, StartError
from bench.servers.qmq import QmqServer
from bench.servers.rabbitmq import RabbitMqServer
from bench.settings import Settings
from bench.workers import kill_all_workers
from bench.workloads_basic import w1_publish, w3_latency
from qmq.auth.secrets import hash_secret

CLUSTER_SECRET = "bench-cluster-secret"
APP_SECRET = "bench-app-secret"
# The private RabbitMQ node's ports: apart from the system's (5672, 25672, 4369) and from the
# main bench's (bench/settings.py), so either may run beside this one.
RABBITMQ_TLS_NODE = "qmqsecure@localhost"
RABBITMQ_TLS_PORTS = {"port": 35782, "tls_port": 35781, "dist_port": 35783, "epmd_port": 34469}
WORKLOADS: dict[str, Callable[[Cell, str], dict[str, Any]]] = {"W1": w1_publish, "W3": w3_latency}


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


def log_tail(directory: Path, size: int = 1500) -> str:
    """The end of every log file under ``directory`` (the run's temp dir is removed after it)."""
    tails = []
    for path in sorted(directory.rglob("*.log")):
        with contextlib.suppress(OSError):
            tails.append(f"{path.name}: {path.read_bytes()[-size:].decode(errors='replace')}")
    return " | ".join(tails)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def qmq_server(tmp: Path, name: str, flush: str, settings: Settings, pki: dict[str, Path] | None,
               parts: str) -> QmqServer:
    """A `qmq standalone` launcher; with ``pki``, TLS and/or an auth file as ``parts`` says."""
    server = QmqServer(str(tmp / name), flush, settings)
    if pki is None:
        return server
    if "auth" in parts:
        auth = tmp / "auth.toml"
        auth.write_text(
            f'[apps.qmq-cluster]\nsecret_hash = "{hash_secret(CLUSTER_SECRET)}"\ncluster = true\n'
            f'[apps.bench]\nsecret_hash = "{hash_secret(APP_SECRET)}"\nproduce = ["*"]\nconsume = ["*"]\n'
        )
        server.extra_args += ["--auth-file", str(auth), "--app-code", "qmq-cluster"]
        server.extra_env["QMQ_SECRET"] = CLUSTER_SECRET
        server.endpoint_extra["secret"] = APP_SECRET
    if "tls" in parts:
        server.extra_args += ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"])]
        server.extra_env["SSL_CERT_FILE"] = str(pki["ca"])
        server.endpoint_extra["ca_file"] = str(pki["ca"])
    return server


def rabbitmq_server(tmp: Path, settings: Settings, pki: dict[str, Path]) -> RabbitMqServer:
    """A private RabbitMQ node with a plain and a TLS listener."""
    server = RabbitMqServer(str(tmp), settings)
    server.dir = str(tmp / "rabbitmq-tls")
    server.node = RABBITMQ_TLS_NODE
    server.port = RABBITMQ_TLS_PORTS["port"]
    server.tls_port = RABBITMQ_TLS_PORTS["tls_port"]
    server.dist_port = RABBITMQ_TLS_PORTS["dist_port"]
    server.epmd_port = RABBITMQ_TLS_PORTS["epmd_port"]
    server.tls_files = {"cert": str(pki["cert"]), "key": str(pki["key"]), "ca": str(pki["ca"])}
    return server


def run_cells(system: str, server: ServerProcess, endpoint: dict[str, Any], settings: Settings, only: list[str],
              log_dir: str) -> dict[str, Any]:
    """The selected workloads, one cell each, against a running server."""
    os.makedirs(log_dir, exist_ok=True)
    cell = Cell(system, server, endpoint, settings, log_dir, log)
    results: dict[str, Any] = {}
    for workload in only:
        results[workload] = timed(lambda w=workload: WORKLOADS[w](cell, cell.family(w)))  # type: ignore[misc]
        log(f"  {system} {workload}: {headline(workload, results[workload])}")
    return results


def headline(workload: str, result: dict[str, Any]) -> str:
    if not result.get("ok"):
        return f"FAILED: {result.get('error')}"
    if workload == "W1":
        return f"{result.get('msgs_per_s')} msg/s"
    lat = result.get("latency_ms") or {}
    return f"p50 {lat.get('p50')} ms, p99 {lat.get('p99')} ms, p99.9 {lat.get('p999')} ms"


def summary(runs: dict[str, list[dict[str, Any]]], only: list[str], plain: str, secure: str) -> dict[str, Any]:
    """Medians of each variant and the ratios; failed cells are left out (and counted)."""
    out: dict[str, Any] = {}
    if "W1" in only:
        rates = {v: [r["W1"]["msgs_per_s"] for r in runs[v] if r["W1"].get("ok")] for v in (plain, secure)}
        out["W1_msgs_per_s"] = rates
        if rates[plain] and rates[secure]:
            ratio = statistics.median(rates[secure]) / statistics.median(rates[plain])
            out["W1_ratio_secure_to_plain"] = round(ratio, 3)
        # CPU µs per message on each side (medians): what TLS and auth cost, less moved by the load
        cpu: dict[str, dict[str, float]] = {}
        rss: dict[str, float] = {}
        for v in (plain, secure):
            ok = [r["W1"] for r in runs[v] if r["W1"].get("ok") and r["W1"].get("messages")]
            sides = {
                "client": [w["client_cpu_s"] / w["messages"] * 1e6 for w in ok if "client_cpu_s" in w],
                "server": [w["server"]["server_cpu_s"] / w["messages"] * 1e6 for w in ok
                           if (w.get("server") or {}).get("server_cpu_s") is not None],
            }
            cpu[v] = {side: round(statistics.median(xs), 2) for side, xs in sides.items() if xs}
            peaks = [w["server"]["server_rss_peak_mib"] for w in ok
                     if (w.get("server") or {}).get("server_rss_peak_mib") is not None]
            if peaks:
                rss[v] = statistics.median(peaks)
        out["W1_cpu_us_per_msg"] = cpu
        out["W1_server_rss_peak_mib"] = rss
        if all(len(cpu[v]) == 2 for v in (plain, secure)):
            out["W1_cpu_ratio_secure_to_plain"] = round(sum(cpu[secure].values()) / sum(cpu[plain].values()), 3)
    if "W3" in only:
        lat: dict[str, dict[str, list[float]]] = {}
        for v in (plain, secure):
            ok = [r["W3"] for r in runs[v] if r["W3"].get("ok") and r["W3"].get("latency_ms")]
            lat[v] = {p: [w["latency_ms"][p] for w in ok] for p in ("p50", "p99", "p999")}
            lat[v]["from_schedule_p99"] = [
                w["latency_from_schedule_ms"]["p99"] for w in ok if w.get("latency_from_schedule_ms")
            ]
        out["W3_latency_ms"] = lat
        ratios = {}
        for p in ("p50", "p99", "p999"):
            if lat[plain][p] and lat[secure][p]:
                ratios[p] = round(statistics.median(lat[plain][p]) / statistics.median(lat[secure][p]), 3)
        out["W3_ratio_plain_to_secure"] = ratios
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the main bench's quick counts (W1 20k, W3 5 s)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--flush", choices=["sync", "periodic"], default="sync")
    parser.add_argument(
        "--parts", choices=["tls,auth", "tls", "auth"], default="tls,auth", help="what qmq's secure runs turn on"
    )
    parser.add_argument("--peers", default="rabbitmq", help='"rabbitmq" (TLS against plain) or "" for none')
    parser.add_argument("--no-qmq", action="store_true", help="the peer only")
    parser.add_argument("--only", default="W1,W3", help="W1, W3 or both")
    parser.add_argument("--w1-messages", type=int, default=None, help="W1's count (default: the main bench's)")
    parser.add_argument("--settings", help="the knobs of a `python -m bench run` as JSON (its W13 cell passes them)")
    opts = parser.parse_args()
    only = [w for w in opts.only.split(",") if w]
    unknown = [w for w in only if w not in WORKLOADS]
    if unknown or not only:
        parser.error(f"--only {opts.only!r}: choose from W1,W3")
    if opts.peers not in ("", "rabbitmq"):
        parser.error(f"--peers {opts.peers!r}: only rabbitmq (or \"\" for none)")
    if opts.settings:
        settings = Settings.from_json(opts.settings)
    else:
        settings = Settings.for_quick() if opts.quick else Settings.full()
    settings = settings.replace(repeats=opts.repeats)
    if opts.w1_messages:
        settings = settings.replace(w1_messages=opts.w1_messages)
    qmq_system = f"qmq-{opts.flush}"
    runs: dict[str, list[dict[str, Any]]] = {"qmq plain": [], "qmq secure": [], "rabbitmq plain": [],
                                             "rabbitmq tls": []}
    notes: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="qmq-secure-bench-") as name:
            tmp = Path(name)
            pki = make_pki(tmp)
            for run in range(0 if opts.no_qmq else opts.repeats):
                order = (False, True) if run % 2 == 0 else (True, False)
                for on in order:
                    variant = "qmq secure" if on else "qmq plain"
                    server = qmq_server(tmp, f"run{run}-{'secure' if on else 'plain'}", opts.flush, settings,
                                        pki if on else None, opts.parts)
                    log(f"run {run + 1}: {variant}")
                    try:
                        endpoint = server.start()
                        runs[variant].append(
                            run_cells(qmq_system, server, endpoint, settings, only, str(tmp / "logs" / f"q{run}{on}"))
                        )
                    finally:
                        server.stop()
                        server.remove_data()
            if opts.peers == "rabbitmq":
                rabbit = rabbitmq_server(tmp, settings, pki)
                reason = rabbit.missing()
                if reason is not None:
                    notes.append(f"rabbitmq skipped: {reason}")
                else:
                    try:
                        endpoint = rabbit.start()
                        assert rabbit.tls_port is not None
                        tls_endpoint = {**endpoint, "port": rabbit.tls_port, "ca_file": str(pki["ca"])}
                        for run in range(opts.repeats):
                            order = (False, True) if run % 2 == 0 else (True, False)
                            for on in order:
                                variant = "rabbitmq tls" if on else "rabbitmq plain"
                                log(f"run {run + 1}: {variant}")
                                runs[variant].append(run_cells(
                                    "rabbitmq", rabbit, tls_endpoint if on else endpoint, settings, only,
                                    str(tmp / "logs" / f"r{run}{on}"),
                                ))
                    except StartError as exc:
                        notes.append(f"rabbitmq did not start: {exc}; its log ends: {log_tail(Path(rabbit.dir))}")
                    finally:
                        rabbit.stop()
    finally:
        kill_all_workers()
    if opts.no_qmq:
        runs.pop("qmq plain"), runs.pop("qmq secure")
    result: dict[str, Any] = {
        "workloads": {
            "W1": f"1 KiB, one producer, window {settings.window_messages}, batches of {settings.batch_messages}, "
            f"{settings.w1_messages} messages",
            "W3": f"{settings.w3_rate_per_s:.0f} msg/s for {settings.w3_duration_s:.0f} s, one subscribed consumer",
        },
        "qmq_flush": opts.flush,
        "qmq_secure_parts": opts.parts,
        "repeats": opts.repeats,
        "load_average_at_end": os.getloadavg(),
    }
    if "qmq plain" in runs:
        result["qmq"] = summary(runs, only, "qmq plain", "qmq secure")
    if runs["rabbitmq plain"] or runs["rabbitmq tls"]:
        result["rabbitmq"] = summary(runs, only, "rabbitmq plain", "rabbitmq tls")
    if notes:
        result["notes"] = notes
    failed = [f"{variant} run {i} {workload}: {cell.get('error')}" for variant, variant_runs in runs.items()
              for i, run in enumerate(variant_runs, 1) for workload, cell in run.items() if not cell.get("ok")]
    if failed:
        result["errors"] = failed
    print(json.dumps(result))


if __name__ == "__main__":
    main()
