"""The markdown report of one run: every table, ratios against the peers of the same
guarantee, and the goals next to the figures. It reports; it never judges a run."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

Row = list[str]
Getter = Callable[[dict[str, Any]], float | None]
PERIODIC_PEERS = ("nats", "redis")
SYNC_PEERS = ("rabbitmq",)


# -- small helpers ---------------------------------------------------------------------
def fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | float):
        return f"{value:,.{digits}f}"
    return str(value)


def dig(data: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def runs_of(entry: dict[str, Any], workload: str) -> list[dict[str, Any]]:
    value = entry.get("workloads", {}).get(workload)
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def ok_runs(entry: dict[str, Any], workload: str) -> list[dict[str, Any]]:
    return [r for r in runs_of(entry, workload) if r.get("ok")]


def best(entry: dict[str, Any], workload: str, get: Getter, higher_is_better: bool) -> float | None:
    values = [v for v in (get(r) for r in ok_runs(entry, workload)) if v is not None]
    if not values:
        return None
    return max(values) if higher_is_better else min(values)


def table(header: Row, rows: Iterable[Row]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out.extend("| " + " | ".join(row) + " |" for row in rows)
    return out


def short(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- cell states -------------------------------------------------------------------------
def mark(met: bool | None) -> str:
    """A goal's mark after its figure: ✓ met, ✗ not, nothing when it cannot be told."""
    return "" if met is None else (" ✓" if met else " ✗")


def state(entry: dict[str, Any], workload: str) -> str | None:
    """Why a system has no figure for a workload ('skipped: …', 'FAILED: …'), or None."""
    if entry.get("skipped"):
        return short(entry["skipped"])
    runs = runs_of(entry, workload)
    if not runs:
        return short(f"FAILED: {entry['error']}") if entry.get("error") else "not run"
    if all("skipped" in r for r in runs):
        return short(runs[0]["skipped"])
    if not any(r.get("ok") for r in runs):
        return short("FAILED: " + (runs[0].get("error") or "see json"))
    return None


def per_run(entry: dict[str, Any], workload: str, get: Getter, digits: int = 0) -> str:
    """The figure of every run, `a / b`, FAIL for a failed run."""
    parts = [fmt(get(r), digits) if r.get("ok") else "FAIL" for r in runs_of(entry, workload)]
    return " / ".join(parts) if parts else "–"


# -- ratios against the peers of the same guarantee ----------------------------------------
def peer_best(
    doc: dict[str, Any], guarantee: str, workload: str, get: Getter, higher: bool
) -> tuple[float, str] | None:
    names = SYNC_PEERS if guarantee == "sync" else PERIODIC_PEERS
    found = []
    for name in names:
        entry = doc["systems"].get(name)
        if entry:
            value = best(entry, workload, get, higher)
            if value is not None:
                found.append((value, name))
    if not found:
        return None
    return max(found) if higher else min(found)


def ratio(doc: dict[str, Any], system: str, workload: str, get: Getter, higher: bool) -> str:
    entry = doc["systems"][system]
    if entry.get("kind") != "qmq":
        return ""
    mine = best(entry, workload, get, higher)
    theirs = peer_best(doc, entry["guarantee"], workload, get, higher)
    if mine is None or theirs is None or not theirs[0]:
        return "–"
    return f"{mine / theirs[0]:.2f}× {theirs[1]}"


def label(entry: dict[str, Any]) -> str:
    return f"{entry['system']} ({entry['guarantee']})"


# -- sections ---------------------------------------------------------------------------------
def header_lines(doc: dict[str, Any]) -> list[str]:
    m = doc["machine"]
    s = doc["settings"]
    deb = doc["versions"]["debian"]
    pypi = doc["versions"]["pypi"]
    qmq_version = dig(doc, "systems", "qmq-sync", "server_version") or dig(
        doc, "systems", "qmq-periodic", "server_version")
    lines = [
        f"# qmq and its peers — {doc['started']} ({doc['mode']} run, wall {fmt(doc.get('wall_s'))} s)",
        "",
        f"`{doc['command']}`",
        "",
        f"- machine: {m.get('cpu_model')}, {m.get('cores')} cores ({m.get('cores_usable')} usable), "
        f"{fmt((m.get('memory_mib') or 0) / 1024, 1)} GiB, kernel {m.get('kernel')}, {m.get('os')}, "
        f"Python {m.get('python')}; load average at start {m.get('load_avg_at_start')} "
        "(the cores are shared with other work: figures are noisy)",
        f"- servers: rabbitmq-server {deb.get('rabbitmq-server')} (erlang-base {deb.get('erlang-base')}), "
        f"nats-server {deb.get('nats-server')}, redis-server {deb.get('redis-server')}, "
        f"qmq {qmq_version or pypi.get('qmq') or '?'} (package version and git commit)",
        f"- clients: pika {pypi.get('pika')} (AsyncioConnection), nats-py {pypi.get('nats-py')}, "
        f"redis-py {pypi.get('redis')} + hiredis {pypi.get('hiredis')}, qmq.aio; event loop {s['event_loop']} "
        f"(uvloop {pypi.get('uvloop')}) in every client process",
        f"- shape: 1 KiB messages; producer window {s['window_messages']:,} unacked in batches of "
        f"{s['batch_messages']}; consumer prefetch {s['prefetch_messages']:,}, ack per received batch "
        f"(≤ {s['recv_max_messages']}); one producer process and one consumer process unless stated; "
        f"{s['repeats']} run(s) per cell, shown `run 1 / run 2`",
        "- ratio columns: **qmq-sync ÷ RabbitMQ** (both fsync before the ack) and **qmq-periodic ÷ best "
        "of NATS/Redis** (both fsync on a timer); > 1 is better for rates, < 1 is better for latencies",
        "- server CPU: utime + stime of every server process (all of qmq standalone's, beam + epmd) over "
        "the cell, per 100k messages; RSS: sum over those processes, sampled every 100 ms",
        "",
    ]
    rows = []
    for entry in doc["systems"].values():
        load = entry.get("load_avg_at_start")
        rows.append([label(entry), entry.get("reported", {}).get("client") or entry.get("client", "–"),
                     fmt(load[0], 2) if load else "–",
                     short(entry.get("durability") or entry.get("skipped") or entry.get("error") or "–", 140)])
    header = ["system (guarantee)", "client", "load avg when it started", "what an ack means here"]
    return [*lines, *table(header, rows), ""]


def throughput_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]
    rate: Getter = lambda r: r.get("msgs_per_s")  # noqa: E731
    cpu: Getter = lambda r: dig(r, "server", "server_cpu_s_per_100k")  # noqa: E731
    rss: Getter = lambda r: dig(r, "server", "server_rss_peak_mib")  # noqa: E731
    rows = []
    for name, entry in doc["systems"].items():
        w1, w2 = state(entry, "W1"), state(entry, "W2")
        rows.append([
            label(entry),
            w1 or per_run(entry, "W1", rate), "" if w1 else ratio(doc, name, "W1", rate, True),
            "" if w1 else per_run(entry, "W1", cpu, 2), "" if w1 else per_run(entry, "W1", rss, 0),
            w2 or per_run(entry, "W2", rate), "" if w2 else ratio(doc, name, "W2", rate, True),
            "" if w2 else per_run(entry, "W2", cpu, 2),
        ])
    header = ["system", "W1 publish msg/s", "ratio", "server CPU s/100k", "server RSS peak MiB",
              "W2 drain msg/s", "ratio", "server CPU s/100k"]
    return [f"## W1 publish / W2 drain — {s['w1_messages']:,} messages", "", *table(header, rows), ""]


def latency_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]
    rows = []
    for name, entry in doc["systems"].items():
        why = state(entry, "W3")
        if why:
            rows.append([label(entry), why] + [""] * 9)
            continue

        def lat(key: str, sub: str = "latency_ms") -> Getter:
            return lambda r: dig(r, sub, key)

        rows.append([
            label(entry), per_run(entry, "W3", lambda r: r.get("achieved_rate_per_s")),
            per_run(entry, "W3", lat("p50"), 2), per_run(entry, "W3", lat("p99"), 2),
            per_run(entry, "W3", lat("p999"), 2), per_run(entry, "W3", lat("max"), 2),
            per_run(entry, "W3", lat("p99", "latency_from_schedule_ms"), 2),
            per_run(entry, "W3", lat("p999", "latency_from_schedule_ms"), 2),
            ratio(doc, name, "W3", lat("p99"), False),
            per_run(entry, "W3", lambda r: r.get("missing")),
            per_run(entry, "W3", lambda r: dig(r, "server", "server_cpu_s_per_100k"), 2),
        ])
    header = ["system", "achieved msg/s", "p50", "p99", "p99.9", "max", "p99 from schedule",
              "p99.9 from schedule", "ratio p99", "lost", "server CPU s/100k"]
    return [
        f"## W3 end-to-end latency at {s['w3_rate_per_s']:,.0f} msg/s for {s['w3_duration_s']:.0f} s (ms)",
        "",
        "Send stamp (CLOCK_MONOTONIC) in the message to receipt in the consumer; *from schedule* "
        "measures from the intended send time, so a producer held up by the server counts "
        "(no coordinated omission).",
        "",
        *table(header, rows),
        "",
    ]


def delay_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]
    notes = ("Redis: ZADD with score = due time, a Lua poller every "
             f"{s['delay_poll_interval_ms']:.0f} ms in the consumer process moves due members to a ready stream. "
             "Lateness = receipt − due (wall clock); early = received before due; *due before sent*: messages whose "
             "due time had passed when the producer got to them, sent due at once (the producer schedules in "
             "random order from t = 0). RSS per pending = RSS growth, while the messages were scheduled (after "
             "a warm-up of 500 sends due an hour later, not per message), of the process holding them "
             "(qmq's delay server; all of Redis) ÷ messages not yet due when scheduling ended.")
    rows4, rows5 = [], []
    for name, entry in doc["systems"].items():
        late: Callable[[str], Getter] = lambda key: (lambda r: dig(r, "lateness_ms", key))  # noqa: E731
        why = state(entry, "W4")
        if why:
            rows4.append([label(entry), why] + [""] * 8)
        else:
            rows4.append([
                label(entry), per_run(entry, "W4", late("p50"), 1), per_run(entry, "W4", late("p99"), 1),
                per_run(entry, "W4", late("max"), 1), per_run(entry, "W4", lambda r: r.get("early_count")),
                per_run(entry, "W4", lambda r: r.get("rss_bytes_per_pending")),
                per_run(entry, "W4", lambda r: dig(r, "server", "server_rss_peak_mib"), 1),
                ratio(doc, name, "W4", late("p99"), False),
                per_run(entry, "W4", lambda r: r.get("clamped_to_send_time")),
                per_run(entry, "W4", lambda r: r.get("missing")),
            ])
        why = state(entry, "W5")
        if why:
            rows5.append([label(entry), why] + [""] * 4)
        else:
            rows5.append([
                label(entry), per_run(entry, "W5", lambda r: r.get("seconds_until_all_delivered"), 2),
                per_run(entry, "W5", late("p50"), 1), per_run(entry, "W5", late("p99"), 1),
                per_run(entry, "W5", late("max"), 1),
                ratio(doc, name, "W5", lambda r: r.get("seconds_until_all_delivered"), False),
            ])
    header4 = ["system", "lateness p50 ms", "p99 ms", "max ms", "early", "RSS bytes / pending",
               "server RSS peak MiB", "ratio p99", "due before sent", "lost"]
    header5 = ["system", "all delivered after s", "lateness p50 ms", "p99 ms", "max ms", "ratio"]
    return [
        f"## W4 delayed delivery — {s['w4_messages']:,} messages due uniformly over {s['w4_spread_s']:.0f} s",
        "",
        notes,
        "",
        *table(header4, rows4),
        "",
        f"## W5 thundering second — {s['w5_messages']:,} messages due within one second",
        "",
        "Time from the start of the due second until the last message was received.",
        "",
        *table(header5, rows5),
        "",
    ]


def elasticity_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]
    counts = [str(c) for c in s["w6_consumer_counts"]]
    cpu_counts = [str(c) for c in s["w6_cpu_consumer_counts"]]
    rows = []
    for _name, entry in doc["systems"].items():
        why = state(entry, "W6")
        if why:
            rows.append([label(entry), why] + [""] * (len(counts) + len(cpu_counts) + 1))
            continue
        run = (ok_runs(entry, "W6") or runs_of(entry, "W6"))[0]

        def cell(group: str, count: str, run: dict[str, Any] = run) -> str:
            r = dig(run, group, count) or {}
            if not r.get("ok"):
                return "FAIL"
            speed = f" ({r.get('speedup_vs_1'):.2f}×)" if count != "1" and r.get("speedup_vs_1") else ""
            return fmt(r.get("msgs_per_s")) + speed

        per_member = dig(run, "handler_bound", counts[-1], "per_consumer") or []
        rows.append([label(entry), *(cell("handler_bound", c) for c in counts),
                     *(cell("cpu_bound", c) for c in cpu_counts), " ".join(str(x) for x in per_member)])
    header = ["system", *(f"handler-bound ×{c}" for c in counts), *(f"CPU-bound ×{c}" for c in cpu_counts),
              f"messages per consumer at ×{counts[-1]}"]
    return ["## W6 elasticity — one consumer group, consumers in separate processes", "",
            f"Handler-bound: a {s['w6_messages']:,} backlog, each consumer handling one message at a time with "
            f"{s['w6_handler_sleep_ms']:.0f} ms of simulated I/O (prefetch {s['w6_prefetch']} per consumer), acking "
            f"each. CPU-bound: a {s['w6_cpu_messages']:,} backlog drained as fast as possible. msg/s over all "
            "consumers, from the release of all consumers to the last message (speed-up vs 1 consumer). "
            "RabbitMQ: competing consumers on one queue; NATS: one durable push consumer with a deliver "
            "(queue) group, explicit acks; Redis: one consumer group; qmq: one consumer group.", "",
            *table(header, rows), ""]


def subjects_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]
    rows = []
    for name, entry in doc["systems"].items():
        why = state(entry, "W7")
        if why:
            rows.append([label(entry), why] + [""] * 5)
            continue
        pub: Getter = lambda r: r.get("publish_msgs_per_s")  # noqa: E731
        drain: Getter = lambda r: r.get("drain_msgs_per_s")  # noqa: E731
        rows.append([
            label(entry), per_run(entry, "W7", lambda r: r.get("setup_s"), 1),
            per_run(entry, "W7", pub), ratio(doc, name, "W7", pub, True),
            per_run(entry, "W7", drain), ratio(doc, name, "W7", drain, True),
            per_run(entry, "W7", lambda r: dig(r, "publish_server", "server_cpu_s_per_100k"), 2) + " / "
            + per_run(entry, "W7", lambda r: dig(r, "drain_server", "server_cpu_s_per_100k"), 2),
        ])
    return [f"## W7 many subjects — {s['w7_subjects']:,} subjects × {s['w7_messages_per_subject']:,} messages",
            "", "Published round-robin over the subjects (one batch per subject at a time), then drained by one "
            "consumer process reading every subject. RabbitMQ: one quorum queue per subject (prefetch split over "
            "the queues: quorum queues have no channel-wide prefetch); NATS: one stream with a subject per "
            "subject and one wildcard durable consumer (a consumer per subject would measure nats-py's "
            "per-subscription cost); Redis: one stream per subject, read 50 streams per XREADGROUP; qmq: one "
            "pull consumer per subject, pulled 20 subjects at a time.", "",
            *table(["system", "setup s", "publish msg/s", "ratio", "drain msg/s", "ratio",
                    "server CPU s/100k pub / drain"], rows), ""]


def gateway_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]
    rows = []
    for entry in doc["systems"].values():
        if entry.get("kind") != "qmq":
            continue
        why = state(entry, "W8")

        def get(key: str, digits: int = 0, entry: dict[str, Any] = entry) -> str:
            return per_run(entry, "W8", lambda r: r.get(key), digits)

        rows.append([
            label(entry),
            why or get("sdk_publish_per_s"), "" if why else get("http_publish_per_s"),
            "" if why else get("publish_ratio", 2),
            "" if why else get("sdk_drain_per_s"), "" if why else get("http_drain_per_s"),
            "" if why else get("drain_ratio", 2),
            "" if why else get("gateway_cpu_s_per_100k_publish", 2) + " / " + get("gateway_cpu_s_per_100k_drain", 2),
        ])
    if not rows:
        return []
    header = ["system", "SDK publish msg/s", "HTTP publish msg/s", "HTTP ÷ SDK", "SDK drain msg/s",
              "HTTP drain msg/s", "HTTP ÷ SDK", "gateway CPU s/100k (publish / drain)"]
    return [f"## W8 HTTP gateway beside the SDK — {s.get('w8_messages', 0):,} messages a row, batches of "
            f"{s['batch_messages']}, {s.get('w8_connections', 0)} HTTP connections", "", *table(header, rows), ""]


def goals_lines(doc: dict[str, Any]) -> list[str]:
    qmq = [n for n, e in doc["systems"].items() if e.get("kind") == "qmq"]
    if not qmq:
        return []
    rate: Getter = lambda r: r.get("msgs_per_s")  # noqa: E731

    def w1(name: str) -> str:
        entry = doc["systems"][name]
        mine = best(entry, "W1", rate, True)
        if mine is None:
            return state(entry, "W1") or "–"
        floor = 35_000 if entry["guarantee"] == "sync" else 65_000
        peer = peer_best(doc, entry["guarantee"], "W1", rate, True)
        need = max(floor, 1.2 * peer[0]) if peer else floor
        return f"{fmt(mine)} msg/s (need ≥ {fmt(need)}){mark(mine >= need)}"

    def w2(name: str) -> str:
        mine = best(doc["systems"][name], "W2", rate, True)
        return state(doc["systems"][name], "W2") or "–" if mine is None else f"{fmt(mine)} msg/s{mark(mine >= 140_000)}"

    def w3(name: str) -> str:
        entry = doc["systems"][name]
        p99 = best(entry, "W3", lambda r: dig(r, "latency_ms", "p99"), False)
        p999 = best(entry, "W3", lambda r: dig(r, "latency_ms", "p999"), False)
        if p99 is None or p999 is None:
            return state(entry, "W3") or "–"
        return f"p99 {p99:.2f} ms, p99.9 {p999:.2f} ms{mark(p99 <= 2 and p999 <= 5)}"

    def w4(name: str) -> str:
        entry = doc["systems"][name]
        p99 = best(entry, "W4", lambda r: dig(r, "lateness_ms", "p99"), False)
        per = best(entry, "W4", lambda r: r.get("rss_bytes_per_pending"), False)
        if p99 is None:
            return state(entry, "W4") or "–"
        return f"p99 {p99:.1f} ms, {fmt(per)} B/pending{mark(p99 <= 10 and per is not None and per <= 64)}"

    def w6(name: str) -> str:
        entry = doc["systems"][name]
        runs = ok_runs(entry, "W6") or runs_of(entry, "W6")
        counts = [str(c) for c in doc["settings"]["w6_consumer_counts"]]
        speed = dig(runs[0], "handler_bound", counts[-1], "speedup_vs_1") if runs else None
        if speed is None:
            return state(entry, "W6") or "–"
        return f"{speed:.2f}× with {counts[-1]}{mark(speed >= 7)}"

    def w8(name: str) -> str:
        entry = doc["systems"][name]
        r = best(entry, "W8", lambda r: r.get("publish_ratio"), True)
        return state(entry, "W8") or "–" if r is None else f"{r:.2f} of the SDK's publish rate{mark(r >= 0.5)}"

    goals: list[tuple[str, Callable[[str], str]]] = [
        ("W1 ≥ 1.2× best peer of the same guarantee (sync ≥ 35k msg/s, periodic ≥ 65k)", w1),
        ("W2 ≥ 140k msg/s", w2),
        ("W3 p99 ≤ 2 ms and p99.9 ≤ 5 ms", w3),
        ("W4 lateness p99 ≤ 10 ms and ≤ 64 B RSS per pending delayed message", w4),
        ("W6 8 consumers ≥ 7× one (handler-bound)", w6),
        ("W8 HTTP gateway publish ≥ 0.5× the SDK's", w8),
    ]
    from bench.report_cells import cell_goals  # it builds on this module's helpers
    from bench.report_features import feature_goals

    workloads = set(doc.get("workloads", []))
    goals += cell_goals(doc) + feature_goals(doc)
    # a goal of a workload the run left out (`--only`) has no row
    goals = [(text, fn) for text, fn in goals if text.split()[0] in workloads]
    rows = [[text, *(fn(name) for name in qmq)] for text, fn in goals]
    if not rows:
        return []
    return ["## Goals (reported next to the figures, never asserted)", "", *table(["goal", *qmq], rows), ""]


def failure_lines(doc: dict[str, Any]) -> list[str]:
    found = []
    if doc.get("interrupted"):
        found.append(f"- run interrupted: {doc['interrupted']}")
    for name, entry in doc["systems"].items():
        if entry.get("error"):
            found.append(f"- {name}: {entry['error']}")
        for workload, value in entry.get("workloads", {}).items():
            for i, r in enumerate(value if isinstance(value, list) else [value], 1):
                if not r.get("ok") and "skipped" not in r:
                    found.append(f"- {name} {workload} run {i}: {r.get('error') or 'failed (see json)'}")
                for group in ("handler_bound", "cpu_bound") if workload == "W6" else ():
                    for count, sub in (r.get(group) or {}).items():
                        if not sub.get("ok"):
                            found.append(f"- {name} {workload} {group} ×{count}: {sub.get('error')}")
    return ["## Failures", "", *found, ""] if found else []


def markdown(doc: dict[str, Any]) -> str:
    parts = header_lines(doc)
    workloads = set(doc.get("workloads", []))
    if workloads & {"W1", "W2"}:
        parts += throughput_lines(doc)
    if "W3" in workloads:
        parts += latency_lines(doc)
    if workloads & {"W4", "W5"}:
        parts += delay_lines(doc)
    if "W6" in workloads:
        parts += elasticity_lines(doc)
    if "W7" in workloads:
        parts += subjects_lines(doc)
    if "W8" in workloads:
        parts += gateway_lines(doc)
    from bench.report_cells import fanout_lines, large_lines, many_subjects_lines

    for workload in ("W9", "W15"):
        if workload in workloads:
            parts += fanout_lines(doc, workload)
    if "W10" in workloads:
        parts += many_subjects_lines(doc)
    if "W11" in workloads:
        parts += large_lines(doc)
    from bench.report_features import filter_lines, ordered_lines, tls_lines

    for workload, lines in (("W12", ordered_lines), ("W13", tls_lines), ("W14", filter_lines)):
        if workload in workloads:
            parts += lines(doc)
    parts += goals_lines(doc)
    parts += failure_lines(doc)
    return "\n".join(parts).rstrip() + "\n"
