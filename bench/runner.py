"""The driver: for each system, start its server, run the selected workloads in a fixed
order with one cell each, stop the server; one failing system never stops the others.

Order per system: W1+W2 (× repeats), W3, W13 (TLS: on servers of its own, while the run's holds
little), W6, W12 (ordered), W7, W8 (qmq only), W14 (filtered, qmq only), W9 (fan-out to 70 groups),
W15 (fan-out to 700 groups), W11 (64 KiB and 1 MiB messages), W10 (40,000 subjects: it restarts the
server on its data), then W4 and W5 on a freshly started server (full runs), so the delay figures
see no earlier backlog in memory.
W12 and W14 run once, on the first qmq system of the run: their backlogs are sent before any clock
starts, so the flush policy is not what they measure."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from bench.cell import Cell, CellError, timed
from bench.servers import ServerProcess, StartError, make_server
from bench.settings import Settings
from bench.workers import kill_all_workers
from bench.workloads_basic import w1_publish, w2_drain, w3_latency
from bench.workloads_delay import w4_delay, w5_thundering_second
from bench.workloads_fanout import w9_fanout, w15_fanout_wide
from bench.workloads_features import w12_ordered, w13_tls, w14_filtered
from bench.workloads_gateway import w8_gateway
from bench.workloads_large import w11_large
from bench.workloads_many import w10_many_subjects
from bench.workloads_scale import w6_elasticity, w7_many_subjects

Log = Callable[[str], None]
GUARANTEE = {"rabbitmq": "sync", "nats": "periodic", "redis": "periodic"}
CLIENTS = {"rabbitmq": "pika AsyncioConnection", "nats": "nats-py", "redis": "redis-py+hiredis", "qmq": "qmq.aio"}
# Why a peer has no row of its own in a feature cell (W12 ordered, W13 TLS, W14 filtered); the
# report cuts a reason at 90 characters.
FEATURE_PEERS = {"W12": ("rabbitmq",), "W13": ("rabbitmq",), "W14": ()}
PEER_SKIPS = {
    ("W12", "nats"): "no ordered consumer group in nats-server 2.9 (partitions assigned by hand: not built)",
    ("W12", "redis"): "Redis Streams groups keep no per-key order (partitions assigned by hand: not built)",
    ("W13", "nats"): "not measured: W13's peer is RabbitMQ with TLS (no NATS TLS set-up in the bench)",
    ("W13", "redis"): "not measured: W13's peer is RabbitMQ with TLS (no Redis TLS set-up in the bench)",
    ("W14", "rabbitmq"): "no server-side filter on message bodies (RabbitMQ routes on routing keys, headers)",
    ("W14", "nats"): "no server-side filter on message bodies (NATS consumers filter on subjects)",
    ("W14", "redis"): "no server-side filter at all (a Redis Streams group reads every entry)",
}
ONCE_WHY = {"W12": "its backlogs are sent before any clock starts",
            "W14": "the subject is sent before the drains are timed"}


def guarantee_of(system: str) -> str:
    return system.removeprefix("qmq-") if system.startswith("qmq-") else GUARANTEE[system]


class SystemRun:
    """One system's server and its workloads, within the system's time limit."""

    def __init__(self, system: str, settings: Settings, only: set[str], data_root: str, log_dir: str,
                 log: Log, once_on: str | None = None) -> None:
        self.system = system
        # the system that runs the cells run once per run (W12, W14): the run's first qmq system
        self.once_on = once_on or system
        self.settings = settings
        self.only = only
        self.log = log
        self.server: ServerProcess = make_server(system, data_root, settings)
        self.log_dir = log_dir
        self.deadline = time.monotonic() + settings.system_limit_s
        self.entry: dict[str, Any] = {
            "system": system,
            "kind": "qmq" if system.startswith("qmq-") else "peer",
            "guarantee": guarantee_of(system),
            "client": CLIENTS["qmq" if system.startswith("qmq-") else system],
            "workloads": {},
        }
        self.cell: Cell | None = None

    def _start(self) -> Cell:
        started = time.monotonic()
        endpoint = self.server.start()
        self.server.check_loopback_only()
        self.entry.setdefault("startup_s", round(time.monotonic() - started, 1))
        self.cell = Cell(self.system, self.server, endpoint, self.settings, self.log_dir, self.log)
        return self.cell

    def _restart(self) -> Cell:
        self.log(f"  {self.system}: restarting on a fresh data dir")
        self.server.stop()
        return self._start()

    def _record(self, workload: str, result: dict[str, Any], repeat: bool = False) -> None:
        if repeat:
            self.entry["workloads"].setdefault(workload, []).append(result)
        else:
            self.entry["workloads"][workload] = result
        for key in ("server_version", "client"):
            if result.get(key) and key not in self.entry.get("reported", {}):
                self.entry.setdefault("reported", {})[key] = result[key]
        status = "skipped" if "skipped" in result else ("ok" if result.get("ok") else "FAILED")
        detail = result.get("skipped") or result.get("error") or _headline(workload, result)
        self.log(f"  {self.system} {workload}: {status} — {detail} ({result.get('wall_s', '?')} s)")

    def _over_time(self) -> bool:
        return time.monotonic() > self.deadline

    def _cell(self, workload: str, fn: Callable[[Cell, str], dict[str, Any]], cell: Cell,
              repeat: bool = False, family: str | None = None) -> dict[str, Any]:
        if self._over_time():
            result = {"ok": False, "error": f"system time limit of {self.settings.system_limit_s:.0f} s reached"}
        else:
            self.log(f"  {self.system} {workload} …")
            name = family or cell.family(workload)
            result = timed(lambda: fn(cell, name))
        self._record(workload, result, repeat)
        return result

    def run(self) -> dict[str, Any]:
        missing = self.server.missing()
        if missing is not None:
            self.entry["skipped"] = missing
            self.log(f"== {self.system}: skipped — {missing}")
            return self.entry
        self.entry["load_avg_at_start"] = [round(x, 2) for x in os.getloadavg()]
        self.entry["durability"] = self.server.durability()
        self.entry["server_version"] = self.server.version()
        try:
            self.log(f"== {self.system}: starting server")
            cell = self._start()
            self._run_workloads(cell)
        except StartError as exc:
            self.entry["error"] = str(exc)
            self.log(f"== {self.system}: {exc}")
        except Exception as exc:  # one system's surprise must not stop the others
            self.entry["error"] = f"{type(exc).__name__}: {exc}"
            self.log(f"== {self.system}: aborted: {self.entry['error']}")
        finally:
            kill_all_workers()
            stopping = time.monotonic()
            self.server.stop()
            self.server.remove_data()
            self.entry["stop_s"] = round(time.monotonic() - stopping, 1)
            self.log(f"== {self.system}: stopped ({self.entry['stop_s']} s)")
        return self.entry

    def _run_workloads(self, cell: Cell) -> None:
        want = self.only
        if want & {"W1", "W2"}:
            for _ in range(self.settings.repeats):
                family = cell.family("W1")
                published = self._cell("W1", w1_publish, cell, repeat=True, family=family)
                if "W2" in want:
                    if published.get("ok"):
                        self._cell("W2", w2_drain, cell, repeat=True, family=family)
                    else:
                        self._record("W2", {"ok": False, "error": "no backlog: W1 failed"}, repeat=True)
        if "W3" in want:
            for _ in range(self.settings.repeats):
                self._cell("W3", w3_latency, cell, repeat=True)
        self._feature("W13", w13_tls, cell)
        if "W6" in want:
            self._cell("W6", w6_elasticity, cell)
        self._feature("W12", w12_ordered, cell)
        if "W7" in want:
            self._cell("W7", w7_many_subjects, cell)
        if "W8" in want:
            if self.system.startswith("qmq-"):
                self._cell("W8", w8_gateway, cell)
            else:
                self._record("W8", {"skipped": "no HTTP gateway: W8 measures qmq's"})
        self._feature("W14", w14_filtered, cell)
        for workload, fn in (("W9", w9_fanout), ("W15", w15_fanout_wide), ("W11", w11_large),
                             ("W10", w10_many_subjects)):
            if workload in want:
                self._cell(workload, fn, cell)
        restarted = False
        for workload, fn in (("W4", w4_delay), ("W5", w5_thundering_second)):
            if workload not in want:
                continue
            reason = self._delay_unsupported(cell)
            if reason is not None and reason.startswith("FAILED"):
                self._record(workload, {"ok": False, "error": reason})
                continue
            if reason is not None:
                self._record(workload, {"skipped": reason})
                continue
            if not restarted and self.settings.fresh_server_for_delay:
                cell = self._restart()
                restarted = True
            self._cell(workload, fn, cell)

    def _feature(self, workload: str, fn: Callable[[Cell, str], dict[str, Any]], cell: Cell) -> None:
        """A feature cell: qmq (W12 and W14 once a run), its peer, or a skipped row saying why."""
        if workload not in self.only:
            return
        if self.system.startswith("qmq-"):
            if workload in ONCE_WHY and self.system != self.once_on:
                self._record(workload, {"skipped": f"runs once, on {self.once_on} ({ONCE_WHY[workload]})"})
            else:
                self._cell(workload, fn, cell)
        elif self.system in FEATURE_PEERS[workload]:
            self._cell(workload, fn, cell)
        else:
            self._record(workload, {"skipped": PEER_SKIPS[(workload, self.system)]})

    def _delay_unsupported(self, cell: Cell) -> str | None:
        """Ask the server, then the client (qmq's SDK grows delay support), once per system."""
        if "delay_probe" not in self.entry:
            reason = self.server.delay_unsupported()
            if reason is None:
                probe = cell.family("probe")
                try:
                    reason = cell.setup(probe, [probe], delayed=True).get("skipped")
                except CellError as exc:
                    reason = f"FAILED: delay probe: {exc}"
            self.entry["delay_probe"] = reason
        reason = self.entry["delay_probe"]
        return reason if isinstance(reason, str) else None


def _headline(workload: str, result: dict[str, Any]) -> str:
    if workload in ("W1", "W2"):
        return f"{result.get('msgs_per_s')} msg/s"
    if workload == "W3":
        lat = result.get("latency_ms") or {}
        return f"p50 {lat.get('p50')} ms, p99 {lat.get('p99')} ms, p99.9 {lat.get('p999')} ms"
    if workload in ("W4", "W5"):
        late = result.get("lateness_ms") or {}
        extra = f", all delivered after {result.get('seconds_until_all_delivered')} s" if workload == "W5" else ""
        return f"lateness p50 {late.get('p50')} ms, p99 {late.get('p99')} ms{extra}"
    if workload == "W6":
        handled = result.get("handler_bound", {})
        return "handler-bound speed-up " + ", ".join(
            f"x{k}: {v.get('speedup_vs_1')}" for k, v in handled.items())
    if workload == "W7":
        return f"publish {result.get('publish_msgs_per_s')} msg/s, drain {result.get('drain_msgs_per_s')} msg/s"
    if workload in ("W9", "W15"):
        drained, live = result.get("drained") or {}, result.get("live") or {}
        return (f"drained {drained.get('deliveries_per_s')} deliveries/s, "
                f"live p99 {(live.get('latency_ms') or {}).get('p99')} ms")
    if workload == "W10":
        restart = result.get("restart") or {}
        return (f"{result.get('reached')} of {result.get('asked')} subjects, "
                f"{result.get('new_subjects_per_s')} new/s, restart "
                + (restart.get("skipped") or f"{restart.get('restart_s')} s"))
    if workload == "W11":
        return ", ".join(f"{label} publish {(r.get('publish') or {}).get('MB_per_s')} MB/s"
                         for label, r in (result.get("sizes") or {}).items())
    if workload == "W12":
        counts = [str(c) for c in result.get("consumers") or []]
        return ", ".join(f"{listener} ×{counts[-1]}: {(cells.get(counts[-1]) or {}).get('speedup_vs_1')}× one"
                         for listener, cells in (result.get("handler_bound") or {}).items()) if counts else ""
    if workload == "W13":
        return (f"W1 TLS ÷ plain {result.get('W1_ratio_secure_to_plain')}, "
                f"CPU {result.get('W1_cpu_ratio_secure_to_plain')}× plain's")
    if workload == "W14":
        f, u = result.get("filtered") or {}, result.get("unfiltered") or {}
        return (f"consumer CPU per wanted message: filtered {f.get('consumer_cpu_us_per_matched', 0):.1f} µs, "
                f"unfiltered {u.get('consumer_cpu_us_per_matched', 0):.1f} µs")
    if workload == "W8":
        return (f"HTTP publish {result.get('http_publish_per_s', 0):.0f} msg/s "
                f"({result.get('publish_ratio', 0):.2f} of the SDK's), "
                f"drain {result.get('http_drain_per_s', 0):.0f} msg/s ({result.get('drain_ratio', 0):.2f})")
    return ""
