"""The feature cells of `bench run` — W12 ordered, W13 TLS, W14 filtered: their sizes, how the
runner runs them (W12 and W14 once, on the run's first qmq system; a peer without the feature has a
row saying why), how each cell calls its bench and reads its JSON, and the report's rows and goals
(from figures of a recorded quick run). No timings are asserted here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bench.cell import Cell, CellError
from bench.report import failure_lines, markdown
from bench.report_features import feature_goals, filter_lines, ordered_lines, tls_lines
from bench.runner import SystemRun
from bench.settings import CELL_NAMES, WORKLOADS, Settings
from bench.workloads_features import w12_ordered, w13_tls, w14_filtered

pytestmark = pytest.mark.timeout(30)
FEATURES = ("W12", "W13", "W14")


def test_the_cells_are_named_by_what_they_measure_with_full_and_quick_sizes() -> None:
    assert WORKLOADS[-4:-1] == FEATURES
    assert [CELL_NAMES[w] for w in FEATURES] == ["ordered", "TLS", "filtered"]
    full, quick = Settings.full(), Settings.for_quick()
    assert (full.ordered_keys, full.ordered_per_key, full.ordered_consumer_counts) == (10_000, 2, (1, 2, 4, 8))
    assert (full.ordered_drain_keys * full.ordered_drain_per_key, full.tls_repeats) == (50_000, 2)
    assert (full.filter_messages, full.filter_match_every, full.filter_rounds) == (100_000, 10, 3)
    assert (quick.ordered_keys, quick.ordered_drain_keys, quick.tls_repeats) == (2_000, 2_000, 1)
    assert (quick.filter_messages, quick.filter_rounds) == (20_000, 2)
    assert Settings.from_json(full.to_json()) == full


class _Server:
    def pids(self) -> list[int]:
        return [11, 12]

    def role_pids(self) -> dict[str, list[int]]:
        return {"broker": [12], "meta": [11]}


class _Cell:
    """What a feature cell uses of a Cell; run_bench records its call and answers ``reply``."""

    def __init__(self, system: str, reply: dict[str, Any] | None = None) -> None:
        self.system = system
        self.settings = Settings.for_quick()
        self.endpoint = {"host": "127.0.0.1", "port": 35682} if system == "rabbitmq" else {"meta_server": "http://m:1"}
        self.server = _Server()
        self.reply = reply or {"ok": True}
        self.calls: list[tuple[str, list[str], int | None]] = []

    def family(self, workload: str) -> str:
        return f"{workload.lower()}n1"

    def worker_limit_s(self, expected_s: float) -> float:
        return expected_s + self.settings.worker_slack_s

    def run_bench(self, module: str, args: list[str], limit_s: float, what: str,
                  count: int | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
        assert limit_s > 0
        assert module in what
        self.calls.append((module, args, count))
        return dict(self.reply), ({"server_rss_peak_mib": 300.0} if count else None)


def _arg(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_w12_and_w14_run_once_on_the_first_qmq_system_and_each_peer_says_why_not(tmp_path: Path) -> None:
    ran: list[tuple[str, str]] = []
    entries = {}
    for system in ("qmq-sync", "qmq-periodic", "rabbitmq", "nats", "redis"):
        run = SystemRun(system, Settings.for_quick(), set(FEATURES), str(tmp_path), str(tmp_path), lambda _m: None,
                        once_on="qmq-sync")
        for workload in FEATURES:
            run._feature(workload, lambda _c, _f, s=system, w=workload: ran.append((s, w)) or {"ok": True},
                         _Cell(system))  # type: ignore[arg-type]
        entries[system] = run.entry["workloads"]
    assert ran == [("qmq-sync", "W12"), ("qmq-sync", "W13"), ("qmq-sync", "W14"), ("qmq-periodic", "W13"),
                   ("rabbitmq", "W12"), ("rabbitmq", "W13")]
    assert entries["qmq-periodic"]["W12"]["skipped"].startswith("runs once, on qmq-sync (")
    assert entries["qmq-periodic"]["W14"]["skipped"].startswith("runs once, on qmq-sync (")
    assert "filter" in entries["rabbitmq"]["W14"]["skipped"]
    assert "RabbitMQ" in entries["nats"]["W13"]["skipped"]
    reasons = [r["skipped"] for w in entries.values() for r in w.values() if "skipped" in r]
    assert len(reasons) == 9
    assert all(len(reason) <= 90 for reason in reasons)  # the report cuts a reason at 90 characters


def test_w12_runs_bench_ordered_on_qmq_and_sac_queues_on_the_runs_own_rabbitmq() -> None:
    cell = _Cell("qmq-sync", {"handler_bound": {"ordered": {}, "unordered": {}}, "consumers": [1, 2, 4, 8]})
    result = w12_ordered(cell, "w12n1")  # type: ignore[arg-type]
    module, args, count = cell.calls[0]
    assert module == "bench.ordered"
    assert (_arg(args, "--meta-server"), _arg(args, "--subject-prefix"), _arg(args, "--keys")) == (
        "http://m:1", "w12n1", "2000")
    assert (_arg(args, "--consumers"), _arg(args, "--server-pids"), args[-1]) == ("1,2,4,8", "11,12", "--json")
    assert count == 2 * (4_000 * 4 + 10_000)  # every message handled: both listeners, every count, both drains
    assert result["server"] == {"server_rss_peak_mib": 300.0}
    rabbit = _Cell("rabbitmq", {"handler_bound": {"1": {"msgs_per_s": 340.0}}})
    result = w12_ordered(rabbit, "w12n2")  # type: ignore[arg-type]
    module, args, _count = rabbit.calls[0]
    assert module == "bench.ordered_rabbitmq"
    assert _arg(args, "--url") == "amqp://guest:guest@127.0.0.1:35682/%2F"  # the run's node, not 5672
    assert _arg(args, "--queues") == "16"
    assert result["handler_bound"] == {"sac": {"1": {"msgs_per_s": 340.0}}}


def test_w13_runs_secure_throughput_with_the_runs_knobs_and_names_the_variants() -> None:
    summary = {"W1_msgs_per_s": {"qmq plain": [100.0], "qmq secure": [90.0]}, "W1_ratio_secure_to_plain": 0.9}
    cell = _Cell("qmq-periodic", {"qmq": summary, "qmq_secure_parts": "tls,auth", "repeats": 1})
    result = w13_tls(cell, "w13n1")  # type: ignore[arg-type]
    _module, args, count = cell.calls[0]
    assert (_arg(args, "--flush"), _arg(args, "--peers"), _arg(args, "--repeats"), count) == ("periodic", "", "1", None)
    assert Settings.from_json(_arg(args, "--settings")) == cell.settings
    assert result["ok"]
    assert result["W1_msgs_per_s"] == {"plain": [100.0], "secure": [90.0]}
    assert result["parts"] == "tls,auth"
    rabbit = _Cell("rabbitmq", {"rabbitmq": {"W1_msgs_per_s": {"rabbitmq plain": [5.0]}},
                                "errors": ["rabbitmq tls run 1 W1: boom"]})
    result = w13_tls(rabbit, "w13n2")  # type: ignore[arg-type]
    assert "--no-qmq" in rabbit.calls[0][1]
    assert (result["ok"], result["error"], result["parts"]) == (False, "rabbitmq tls run 1 W1: boom", "tls")
    with pytest.raises(CellError, match="rabbitmq skipped: not installed"):
        w13_tls(_Cell("rabbitmq", {"notes": ["rabbitmq skipped: not installed"]}), "w13n3")  # type: ignore[arg-type]


def test_w14_drains_with_the_broker_of_the_run_watched() -> None:
    cell = _Cell("qmq-sync", {"filtered": {}, "unfiltered": {}})
    w14_filtered(cell, "w14n1")  # type: ignore[arg-type]
    module, args, count = cell.calls[0]
    assert (module, _arg(args, "--broker-pid"), _arg(args, "--subject-prefix")) == ("bench.filter_cost", "12", "w14n1r")
    assert (_arg(args, "--messages"), _arg(args, "--rounds"), count) == ("20000", "2", 40_000)


def test_run_bench_reads_the_last_line_of_a_module_as_json(tmp_path: Path) -> None:
    doc = tmp_path / "doc.json"
    doc.write_text('{"a": [1, 2]}')
    cell = Cell("qmq-sync", None, {}, Settings.for_quick(), str(tmp_path), print)  # type: ignore[arg-type]
    assert cell.run_bench("json.tool", ["--compact", str(doc)], 30.0, "json.tool") == ({"a": [1, 2]}, None)
    with pytest.raises(CellError, match=r"json\.tool exited 2: .*missing\.json"):
        cell.run_bench("json.tool", [str(tmp_path / "missing.json")], 30.0, "json.tool")


# Figures of the quick run of 2026-11-28 (bench/results of that run; counts trimmed to two).
def _cells(*rates: tuple[str, float, float, float]) -> dict[str, Any]:
    return {count: {"msgs_per_s": rate, "speedup_vs_1": speedup, "server_cpu_s_per_100k": cpu}
            for count, rate, speedup, cpu in rates}


W12 = {"ok": True, "consumers": [1, 8], "handler_bound": {
    "ordered": _cells(("1", 417.1, 1.0, 13.5), ("8", 2039.8, 4.891, 14.5)),
    "unordered": _cells(("1", 392.2, 1.0, 12.0), ("8", 2249.0, 5.734, 14.0))},
    "cpu_bound": {"ordered": {"msgs_per_s": 13070.7, "server_cpu_s_per_100k": 1.0},
                  "unordered": {"msgs_per_s": 23529.3, "server_cpu_s_per_100k": 0.4}},
    "server": {"server_rss_peak_mib": 297.2}}
W12_RABBITMQ = {"ok": True, "consumers": [1, 8], "server": {"server_rss_peak_mib": 164.9},
                "handler_bound": {"sac": _cells(("1", 340.0, 1.0, 64.75), ("8", 1247.7, 3.67, 42.75))}}
W13 = {"ok": True, "parts": "tls,auth", "W1_msgs_per_s": {"plain": [16553.8], "secure": [15683.1]},
       "W1_ratio_secure_to_plain": 0.947, "W1_cpu_us_per_msg": {"plain": {"client": 13.75, "server": 18.5},
                                                                "secure": {"client": 20.5, "server": 20.0}},
       "W1_server_rss_peak_mib": {"plain": 294.4, "secure": 321.1}, "W1_cpu_ratio_secure_to_plain": 1.256,
       "W3_latency_ms": {"plain": {"p99": [58.056], "p999": [88.031]}, "secure": {"p99": [506.626], "p999": [542.2]}}}
W14 = {"ok": True, "messages": 20_000, "rounds": 2,
       "filtered": {"received": 2000.0, "consumer_cpu_us_per_matched": 11.3, "consumer_cpu_us_per_received": 11.3,
                    "bytes_per_matched": 1143.3, "broker_cpu_us_per_stored": 37.0},
       "unfiltered": {"received": 20000.0, "consumer_cpu_us_per_matched": 58.2, "consumer_cpu_us_per_received": 5.82,
                      "bytes_per_matched": 11432.2, "broker_cpu_us_per_stored": 4.0},
       "server": {"server_cpu_s": 2.548, "server_rss_peak_mib": 299.0}}


def _entry(system: str, workloads: dict[str, Any]) -> dict[str, Any]:
    kind = "qmq" if system.startswith("qmq-") else "peer"
    guarantee = system.removeprefix("qmq-") if kind == "qmq" else "sync"
    return {"system": system, "kind": kind, "guarantee": guarantee, "client": "c", "workloads": workloads}


def _doc() -> dict[str, Any]:
    once = "runs once, on qmq-sync (its backlogs are sent before any clock starts)"
    return {
        "started": "2026-11-28T23:56:30", "mode": "quick", "command": "python -m bench run --quick --only W12,W13,W14",
        "workloads": list(FEATURES), "settings": {**Settings.for_quick().__dict__, "ordered_consumer_counts": [1, 8]},
        "machine": {"load_avg_at_start": [1.0, 1.0, 1.0]}, "versions": {"debian": {}, "pypi": {}},
        "systems": {
            "qmq-sync": _entry("qmq-sync", {"W12": W12, "W13": W13, "W14": W14}),
            "qmq-periodic": _entry("qmq-periodic", {"W12": {"skipped": once}, "W14": {"skipped": once},
                                                    "W13": {"ok": False, "error": "qmq secure run 1 W1: boom"}}),
            "rabbitmq": _entry("rabbitmq", {"W12": W12_RABBITMQ, "W14": {"skipped": "no server-side filter"}}),
        },
    }


def test_ordered_rows_put_each_listener_beside_the_ceiling_and_the_peer() -> None:
    text = "\n".join(ordered_lines(_doc()))
    assert text.startswith("## W12 ordered — 2,000 order keys × 2 messages drained by 1, 8 consumer processes")
    assert "| qmq-sync (sync) | ordered | 417 | 2,040 (4.89×) | 13.50 / 14.50 | 13,071 | 1.00 | 297 |" in text
    assert "| qmq-sync (sync) | unordered (the ceiling) | 392 | 2,249 (5.73×) | 12.00 / 14.00 | 23,529 | 0.40 |" in text
    assert ("| rabbitmq (sync) | single-active-consumer queues | 340 | 1,248 (3.67×) | 64.75 / 42.75 | – | – "
            "| 165 |") in text
    assert "| qmq-periodic (periodic) | runs once, on qmq-sync (its backlogs are sent before any clock" in text


def test_tls_rows_pair_plain_with_secured() -> None:
    text = "\n".join(tls_lines(_doc()))
    assert text.startswith("## W13 TLS — TLS + auth against plain: W1 publish (20,000 messages)")
    assert ("| qmq-sync (sync) | TLS + auth | 16,554 / 15,683 | 0.95 | 1.85 / 2.00 | 13.8 / 20.5 | 1.26 | 294 / 321 "
            "| 58.06 / 506.63 | 88.03 / 542.20 |") in text
    assert "| qmq-periodic (periodic) | FAILED: qmq secure run 1 W1: boom |" in text
    assert "| rabbitmq (sync) | not run |" in text


def test_filter_rows_show_what_a_wanted_message_costs_with_and_without() -> None:
    text = "\n".join(filter_lines(_doc()))
    assert text.startswith("## W14 filtered — 20,000 JSON messages of ~1 KiB on one subject, 1 in 10 wanted")
    assert ("| qmq-sync (sync) | filtered (`body.match` on the broker) | 2,000 | 11.3 | 11.3 | 1,143 | 3.70 | 6.37 "
            "| 299 |") in text
    assert "| qmq-sync (sync) | unfiltered | 20,000 | 58.2 | 5.8 | 11,432 | 0.40 |  |  |" in text
    assert "| qmq-sync (sync) | filtered ÷ unfiltered, per wanted |  | 0.19 |  | 0.10 |  |  |  |" in text
    assert "| rabbitmq (sync) | no server-side filter |  |" in text


def test_goals_mark_each_feature_and_say_why_a_system_has_none() -> None:
    doc = _doc()
    goals = {text.split()[0]: fn for text, fn in feature_goals(doc)}
    assert goals["W12"]("qmq-sync") == "4.89× with 8 ✗ (unordered 5.73×, RabbitMQ SAC 3.67×)"
    assert goals["W12"]("qmq-periodic").startswith("runs once, on qmq-sync")
    assert goals["W13"]("qmq-sync") == "0.95× plain ✓ (CPU 1.26× plain's)"
    assert goals["W13"]("qmq-periodic") == "FAILED: qmq secure run 1 W1: boom"
    assert goals["W14"]("qmq-sync") == ("11.3 µs per wanted against 5.8 per received without = 1.94× ✗ "
                                        "(unfiltered: 58.2 µs per wanted)")
    doc["systems"]["qmq-sync"]["workloads"]["W12"]["handler_bound"]["ordered"]["8"]["speedup_vs_1"] = 7.2
    assert goals["W12"]("qmq-sync").startswith("7.20× with 8 ✓")


def test_the_report_has_the_feature_sections_and_lists_only_real_failures() -> None:
    doc = _doc()
    text = markdown(doc)
    for heading in ("## W12 ordered", "## W13 TLS", "## W14 filtered", "| W12 ordered: 8 consumers ≥ 7× one"):
        assert heading in text
    assert "## W1 publish" not in text
    assert failure_lines(doc) == ["## Failures", "", "- qmq-periodic W13 run 1: qmq secure run 1 W1: boom", ""]
    doc["workloads"] = ["W14"]
    assert "## W12" not in markdown(doc)
