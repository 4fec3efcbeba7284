"""The report's tables of the feature cells, each named by what it measures: W12 "ordered", W13
"TLS" (TLS + auth against plain), W14 "filtered" (the server-side filter), and their goals."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from bench.report import dig, fmt, label, mark, state
from bench.report_cells import cell_section, run_of

# Goals (reported, never asserted).
ORDERED_SPEEDUP_MIN = 7.0
TLS_W1_RATIO_MIN = 0.85
FILTER_CPU_RATIO_MAX = 1.5
LISTENERS = {"ordered": "ordered", "unordered": "unordered (the ceiling)", "sac": "single-active-consumer queues"}
SECURED = {"tls,auth": "TLS + auth", "tls": "TLS", "auth": "auth"}


def _median(values: Any) -> float | None:
    return statistics.median(values) if values else None


def ordered_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]
    counts = [str(c) for c in s.get("ordered_consumer_counts") or ()]

    def rows_of(entry: dict[str, Any], run: dict[str, Any]) -> list[list[str]]:
        rows = []
        drained = run.get("cpu_bound") or {}
        for listener, cells in run["handler_bound"].items():

            def rate(count: str, cells: dict[str, Any] = cells) -> str:
                cell = cells.get(count) or {}
                speed = cell.get("speedup_vs_1")
                return fmt(cell.get("msgs_per_s")) + (f" ({speed:.2f}×)" if speed and count != counts[0] else "")

            drain = drained.get(listener) or {}
            rows.append([
                label(entry), LISTENERS.get(listener, listener), *(rate(c) for c in counts),
                " / ".join(fmt(dig(cells, c, "server_cpu_s_per_100k"), 2) for c in counts),
                fmt(drain.get("msgs_per_s")), fmt(drain.get("server_cpu_s_per_100k"), 2),
                fmt(dig(run, "server", "server_rss_peak_mib")),
            ])
        return rows

    header = ["system", "listener", *(f"×{c} msg/s" for c in counts), "server CPU s/100k handled (×" +
              " / ×".join(counts) + ")", "CPU-bound drain msg/s", "server CPU s/100k drained", "server RSS peak MiB"]
    keys, per_key = s.get("ordered_keys", 0), s.get("ordered_per_key", 0)
    drain = s.get("ordered_drain_keys", 0) * s.get("ordered_drain_per_key", 0)
    return cell_section(doc, "W12", "handler_bound", [
            f"## W12 ordered — {keys:,} order keys × {per_key} messages drained by {', '.join(counts)} consumer "
            f"processes, {s.get('ordered_handler_ms', 0):g} ms a message; CPU-bound drain of {drain:,}",
            "Handler-bound: one subject of ordered messages (100 B), a new group per cell, each consumer process "
            "handling one message at a time with an `asyncio.sleep` of the handler's time; the clock runs from "
            "the release of every connected consumer to the last message handled (speed-up against ×"
            f"{counts[0] if counts else 1}). *Unordered*: the same cell with a plain listener, the machine's "
            "ceiling for that load. CPU-bound: one consumer with an empty handler drains its own backlog, ordered "
            f"against unordered. RabbitMQ: {s.get('ordered_rabbitmq_queues', 0)} single-active-consumer quorum "
            "queues, a key's messages to queue crc32(key) mod their count, each consumer subscribed first to its "
            "own share (given by hand: RabbitMQ leaves a queue with its first subscriber) and to the rest as a "
            "standby (`bench/ordered_rabbitmq.py`); it has no CPU-bound drain. Server CPU per cell (consumer "
            "start-up included); RSS: the peak over the whole cell."], header, rows_of)


def tls_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]

    def rows_of(entry: dict[str, Any], run: dict[str, Any]) -> list[list[str]]:
        latency, server_cpu = run.get("W3_latency_ms") or {}, dig(run, "W1_cpu_us_per_msg") or {}
        per = {variant: {
            "rate": _median(dig(run, "W1_msgs_per_s", variant)),
            "server": dig(server_cpu, variant, "server") / 10 if dig(server_cpu, variant, "server") else None,
            "client": dig(server_cpu, variant, "client"), "rss": dig(run, "W1_server_rss_peak_mib", variant),
            "p99": _median(dig(latency, variant, "p99")), "p999": _median(dig(latency, variant, "p999")),
        } for variant in ("plain", "secure")}  # server CPU: µs/msg → s/100k

        def pair(key: str, digits: int = 0) -> str:
            return " / ".join(fmt(per[variant][key], digits) for variant in ("plain", "secure"))

        return [[
            label(entry), SECURED.get(run.get("parts") or "", run.get("parts") or "–"), pair("rate"),
            fmt(run.get("W1_ratio_secure_to_plain"), 2), pair("server", 2), pair("client", 1),
            fmt(run.get("W1_cpu_ratio_secure_to_plain"), 2), pair("rss"), pair("p99", 2), pair("p999", 2),
        ]]

    header = ["system", "secured with", "W1 msg/s plain / secured", "secured ÷ plain",
              "server CPU s/100k plain / secured", "client CPU µs/msg plain / secured", "CPU (client + server) "
              "secured ÷ plain", "server RSS peak MiB plain / secured", "W3 p99 ms plain / secured",
              "W3 p99.9 ms plain / secured"]
    repeats = s.get("tls_repeats", 1)
    return cell_section(doc, "W13", "W1_msgs_per_s", [
            f"## W13 TLS — TLS + auth against plain: W1 publish ({s['w1_messages']:,} messages) and W3 latency "
            f"({s['w3_rate_per_s']:,.0f} msg/s for {s['w3_duration_s']:.0f} s)",
            "The W1 and W3 cells themselves (`bench/secure_throughput.py`), each variant on a server of its own "
            f"started for it, {repeats} run(s) each, which variant goes first alternating; medians. qmq (under the "
            "row's flush policy): TLS on every port (a throw-away CA) and an auth file, the clients authenticating "
            "once per connection and every send and pull checked against their app's patterns. RabbitMQ: a "
            "private node (its own name, ports and epmd, apart from the run's) with a plain and a TLS listener; "
            "its clients log in (guest) either way, so its ratio is the cost of TLS alone. CPU per message from "
            "W1 (the producer process; the server's processes)."], header, rows_of)


def filter_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]

    def rows_of(entry: dict[str, Any], run: dict[str, Any]) -> list[list[str]]:
        stored = (run.get("messages") or 0) * (run.get("rounds") or 0)
        server = run.get("server") or {}
        whole = [fmt(server["server_cpu_s"] * 100_000 / stored if stored and "server_cpu_s" in server else None, 2),
                 fmt(server.get("server_rss_peak_mib"))]
        f, u = run["filtered"], run.get("unfiltered") or {}
        rows = []
        for i, (name, g) in enumerate((("filtered (`body.match` on the broker)", f), ("unfiltered", u))):
            broker = g.get("broker_cpu_us_per_stored")
            rows.append([
                label(entry), name, fmt(g.get("received")), fmt(g.get("consumer_cpu_us_per_matched"), 1),
                fmt(g.get("consumer_cpu_us_per_received"), 1), fmt(g.get("bytes_per_matched")),
                fmt(broker / 10 if broker is not None else None, 2), *(whole if i == 0 else ["", ""]),
            ])

        def per_wanted(key: str) -> str:
            return f"{f[key] / u[key]:.2f}" if f.get(key) and u.get(key) else "–"

        return [*rows, [label(entry), "filtered ÷ unfiltered, per wanted", "",
                        per_wanted("consumer_cpu_us_per_matched"), "", per_wanted("bytes_per_matched"), "", "", ""]]

    header = ["system", "group", "received", "consumer CPU µs / wanted", "consumer CPU µs / received",
              "bytes read / wanted", "broker CPU s/100k stored (its drain)", "server CPU s/100k stored (whole cell)",
              "server RSS peak MiB"]
    every = s.get("filter_match_every", 10)
    return cell_section(doc, "W14", "filtered", [
            f"## W14 filtered — {s.get('filter_messages', 0):,} JSON messages of ~1 KiB on one subject, 1 in {every} "
            "wanted, drained by a group with a server-side filter and one without",
            f"`bench/filter_cost.py`, {s.get('filter_rounds', 0)} rounds (each on a subject of its own, which group "
            "drains first alternating; medians), one pull consumer per group (pulls of 500, `ack_all`). *Wanted*: "
            "the messages the filter `body.match` passes; the unfiltered group receives every message and would "
            "drop the others itself. Consumer CPU: its process's user + system time around its drain; bytes: what "
            "it read from its socket. Broker CPU: the broker process around each drain; the whole cell's server "
            "CPU (sends and both drains, every process) and RSS peak beside it. No peer filters on a message body "
            "expression on the server."], header, rows_of)


def feature_goals(doc: dict[str, Any]) -> list[tuple[str, Callable[[str], str]]]:
    """Goal rows of the feature cells: (text, figure of a qmq system)."""

    def ordered(name: str) -> str:
        entry = doc["systems"][name]
        run = run_of(entry, "W12")
        last = str((doc["settings"].get("ordered_consumer_counts") or [8])[-1])
        speed = dig(run, "handler_bound", "ordered", last, "speedup_vs_1")
        if speed is None:
            return state(entry, "W12") or "–"
        others = [f"unordered {v:.2f}×" for v in [dig(run, "handler_bound", "unordered", last, "speedup_vs_1")] if v]
        rabbit = run_of(doc["systems"].get("rabbitmq") or {}, "W12")
        others += [f"RabbitMQ SAC {v:.2f}×" for v in [dig(rabbit, "handler_bound", "sac", last, "speedup_vs_1")] if v]
        return f"{speed:.2f}× with {last}{mark(speed >= ORDERED_SPEEDUP_MIN)}" + (f" ({', '.join(others)})"
                                                                                  if others else "")

    def tls(name: str) -> str:
        entry = doc["systems"][name]
        run = run_of(entry, "W13") or {}
        ratio = run.get("W1_ratio_secure_to_plain")
        if ratio is None:
            return state(entry, "W13") or "–"
        cpu = run.get("W1_cpu_ratio_secure_to_plain")
        return f"{ratio:.2f}× plain{mark(ratio >= TLS_W1_RATIO_MIN)}" + (f" (CPU {cpu:.2f}× plain's)" if cpu else "")

    def filtered(name: str) -> str:
        entry = doc["systems"][name]
        run = run_of(entry, "W14") or {}
        wanted = dig(run, "filtered", "consumer_cpu_us_per_matched")
        received = dig(run, "unfiltered", "consumer_cpu_us_per_received")
        if not wanted or not received:
            return state(entry, "W14") or "–"
        ratio = wanted / received
        unfiltered = dig(run, "unfiltered", "consumer_cpu_us_per_matched")
        return (f"{wanted:.1f} µs per wanted against {received:.1f} per received without = {ratio:.2f}×"
                f"{mark(ratio <= FILTER_CPU_RATIO_MAX)}"
                + (f" (unfiltered: {unfiltered:.1f} µs per wanted)" if unfiltered else ""))

    return [
        (f"W12 ordered: 8 consumers ≥ {ORDERED_SPEEDUP_MIN:.0f}× one (handler-bound, ordered)", ordered),
        (f"W13 TLS + auth: W1 ≥ {TLS_W1_RATIO_MIN:.2f}× plain", tls),
        (f"W14 filtered: the consumer's CPU per wanted message with the filter ≤ {FILTER_CPU_RATIO_MAX:g}× its CPU "
         "per message received without (the passed-over messages cost it nothing)", filtered),
    ]
