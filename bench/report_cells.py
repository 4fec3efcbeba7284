"""The report's tables of the cells named by what they measure: W9 "fan-out to 70 groups",
W15 "fan-out to 700 groups", W10 "40,000 subjects", W11 "64 KiB" and "1 MiB" messages, and
their goals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.report import Getter, dig, fmt, label, mark, ok_runs, state, table

PEERS = ("rabbitmq", "nats", "redis")
# Goals (reported, never asserted).
FANOUT_VS_BEST_PEER = 2.0
FANOUT_LIVE_P99_MS = 20.0
SUBJECT_BROKER_BYTES_MAX = 2048
NEW_SUBJECTS_PER_S_MIN = 5_000
RESTART_S_MAX = 10.0


def run_of(entry: dict[str, Any], workload: str) -> dict[str, Any] | None:
    """The one run of a cell: its first successful run, else its first (the failed parts say why)."""
    runs: Any = ok_runs(entry, workload) or entry.get("workloads", {}).get(workload)
    if isinstance(runs, list):
        runs = runs[0] if runs else None
    return runs if isinstance(runs, dict) else None


def figures_of(entry: dict[str, Any], workload: str, key: str) -> dict[str, Any] | None:
    """The workload's run when it has figures (``key`` in it); None when it was skipped or failed
    before any."""
    run = run_of(entry, workload)
    return run if run is not None and key in run else None


def not_run_row(entry: dict[str, Any], workload: str, blanks: int) -> list[str]:
    """A table row of a system with no figures for ``workload``: why, then ``blanks`` empty cells."""
    return [label(entry), state(entry, workload) or "not run"] + [""] * blanks


RowsOf = Callable[[dict[str, Any], dict[str, Any]], list[list[str]]]


def cell_section(doc: dict[str, Any], workload: str, key: str, heading: list[str], header: list[str],
                 rows_of: RowsOf) -> list[str]:
    """A named cell's section: ``heading`` (its title and notes, each a paragraph), then a table of
    each system's rows: ``rows_of(entry, run)`` where its run has figures (``key`` in it), else
    one row saying why not."""
    rows = []
    for entry in doc["systems"].values():
        run = figures_of(entry, workload, key)
        rows += [not_run_row(entry, workload, len(header) - 2)] if run is None else rows_of(entry, run)
    return [line for paragraph in heading for line in (paragraph, "")] + [*table(header, rows), ""]


def best_peer(doc: dict[str, Any], workload: str, get: Getter) -> tuple[float, str] | None:
    """The highest figure of any peer (the fan-out goal compares with every peer)."""
    found = []
    for name in PEERS:
        entry = doc["systems"].get(name)
        if not entry:
            continue
        run = run_of(entry, workload)
        value = get(run) if run else None
        if value is not None:
            found.append((value, name))
    return max(found) if found else None


def fanout_shape(settings: dict[str, Any], workload: str) -> tuple[int, int, int, float]:
    """Groups, messages drained by each, prefetch per group and live msg/s of W9 or W15."""
    wide = "_wide" if workload == "W15" else ""
    return (settings.get(f"fanout{wide}_groups", 0), settings.get(f"fanout{wide}_messages", 0),
            settings.get(f"fanout{wide}_prefetch_per_group", 0), settings.get(f"fanout{wide}_live_rate_per_s", 0.0))


def fanout_lines(doc: dict[str, Any], workload: str = "W9") -> list[str]:
    s = doc["settings"]
    drained_rate: Getter = lambda r: dig(r, "drained", "deliveries_per_s")  # noqa: E731
    peer = best_peer(doc, workload, drained_rate)

    def rows_of(entry: dict[str, Any], run: dict[str, Any]) -> list[list[str]]:
        d, live = run.get("drained") or {}, run.get("live") or {}
        mine = d.get("deliveries_per_s") if d.get("ok") else None
        vs = f"{mine / peer[0]:.2f}× {peer[1]}" if mine and peer and entry.get("kind") == "qmq" else ""
        return [[
            label(entry), fmt(d.get("publish_msgs_per_s")),
            fmt(mine) if d.get("ok") else "FAIL: " + str(d.get("error"))[:80], vs,
            fmt(dig(d, "fanout", "slowest_group_behind_when_first_done")),
            fmt(dig(d, "fanout", "last_group_done_after_first_s"), 2),
            fmt(dig(d, "server", "server_cpu_s_per_100k"), 2), fmt(dig(d, "server", "server_rss_peak_mib")),
            fmt(live.get("achieved_rate_per_s")) if live.get("ok") else "FAIL: " + str(live.get("error"))[:80],
            " / ".join(fmt(dig(live, "latency_ms", k), 1) for k in ("p50", "p99", "p999")),
            fmt(dig(live, "fanout", "slowest_group_latency_p99_ms"), 1),
            fmt(dig(live, "latency_from_schedule_ms", "p99"), 1),
            fmt(dig(live, "server", "server_cpu_s_per_100k"), 2),
        ]]

    header = ["system", "publish msg/s", "drained deliveries/s", "÷ best peer", "slowest group behind (msgs)",
              "last group done after first (s)", "server CPU s/100k deliveries", "server RSS peak MiB",
              "live msg/s in", "live p50 / p99 / p99.9 ms", "slowest group's p99 ms", "p99 from schedule ms",
              "live server CPU s/100k deliveries"]
    groups, messages, prefetch, rate = fanout_shape(s, workload)
    return cell_section(doc, workload, "drained", [
            f"## {workload} fan-out to {groups} groups — {messages:,} × 1 KiB drained by each group; "
            f"live {rate:,.0f} msg/s for {s.get('fanout_live_duration_s', 0):.0f} s "
            f"({rate * groups:,.0f} deliveries/s)",
            f"One subject, {groups} consumer groups each reading every message, one consumer process reading "
            "them all. RabbitMQ: a fanout exchange to a quorum queue per group; NATS: a durable push consumer per "
            f"group on one stream (AckAll); Redis: {groups} groups on one stream (an XREADGROUP per group, one "
            f"pipeline); qmq: {groups} groups of one subject (PULL_MANY, 100 groups a request). Prefetch "
            f"{prefetch} per group. *Slowest group behind*: messages the slowest "
            "group still had to read when the first group had read them all. Live latency: send stamp to receipt, "
            "every delivery of every group."], header, rows_of)


def many_subjects_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]

    def rows_of(entry: dict[str, Any], run: dict[str, Any]) -> list[list[str]]:
        per = run.get("rss_bytes_per_subject") or {}
        roles = " / ".join(f"{role} {fmt(v)}" for role, v in per.items() if role in ("broker", "meta", "server"))
        grow_cpu = dig(run, "grow", "server", "server_cpu_s")
        reached = run.get("reached") or 0
        restart = run.get("restart") or {}
        listing = run.get("listing")
        return [[
            label(entry), f"{fmt(reached)} of {fmt(run.get('asked'))}", run.get("stopped") or "–",
            fmt(run.get("new_subjects_per_s")),
            fmt(grow_cpu * 1000 / reached, 2) if grow_cpu is not None and reached else "–", roles or "–",
            fmt(dig(run, "drain", "msgs_per_s")) if dig(run, "drain", "ok") is not False
            else "FAIL: " + str(dig(run, "drain", "error"))[:80],
            (restart.get("skipped") or fmt(restart.get("restart_s"), 1)) if restart.get("ok")
            else "FAIL: " + str(restart.get("error"))[:80],
            "–" if listing is None else (f"{fmt(listing.get('seconds'), 1)} ({fmt(listing.get('subjects_listed'))} "
                                        "listed)" if listing.get("ok") else "FAIL: " + str(listing.get("error"))[:80]),
        ]]

    header = ["system", "subjects", "stopped", "new subjects/s", "server CPU ms per new subject",
              "RSS B per idle subject", "drain msg/s", "restart s", "`qmq subjects` s"]
    return cell_section(doc, "W10", "reached", [
            f"## W10 {s.get('many_subjects', 0):,} subjects — one message each",
            f"Made {s.get('many_subjects_chunk', 0):,} at a time and sent their first message (batches of 1), by one "
            f"process, until all, {s.get('many_subjects_limit_s', 0):.0f} s, the first error or "
            f"{s.get('many_subjects_server_rss_max_mib', 0):,} MiB of server RSS; *new subjects/s* counts making "
            "them (queues, streams; qmq and NATS make one at its first send) and the first sends. RSS per idle "
            "subject: growth by role from before to 2 s after (qmq: broker / meta server; peers: the server). "
            "Then one consumer drains them all; then the server is stopped and started on its data (restart: "
            "until it serves: qmq's `qmq ready` line, a peer's port), and `qmq subjects` lists them. RabbitMQ: "
            "a quorum queue per subject; NATS: one stream, a subject per subject, one wildcard consumer; Redis: "
            "a stream per subject."], header, rows_of)


def large_lines(doc: dict[str, Any]) -> list[str]:
    s = doc["settings"]

    def rows_of(entry: dict[str, Any], run: dict[str, Any]) -> list[list[str]]:
        rows = []
        for size, r in (run.get("sizes") or {}).items():
            pub, drain, disk = r.get("publish") or {}, r.get("drain") or {}, r.get("disk") or {}
            gb = (r.get("messages") or 0) * (r.get("body_bytes") or 0) / 1e9
            cpu = dig(pub, "server", "server_cpu_s")
            pub_mb, disk_mb = pub.get("MB_per_s"), disk.get("MB_per_s")
            rows.append([
                label(entry), f"{size} × {fmt(r.get('messages'))}, batch {r.get('batch')}",
                f"{fmt(disk_mb, 0)} ({fmt(disk.get('fdatasync_per_s'))}/s)",
                fmt(pub_mb, 1) if pub.get("ok") else "FAIL: " + str(pub.get("error"))[:80],
                f"{pub_mb / disk_mb:.2f}" if pub.get("ok") and pub_mb and disk_mb else "–",
                fmt(drain.get("MB_per_s"), 1) if drain.get("ok") else "FAIL: " + str(drain.get("error"))[:80],
                fmt(cpu / gb, 2) if cpu is not None and gb else "–",
                fmt(dig(pub, "server", "server_rss_peak_mib")),
            ])
        return rows

    header = ["system", "size × messages", "disk MB/s (fdatasync/s)", "W1 publish MB/s", "÷ disk",
              "W2 drain MB/s", "server CPU s/GB published", "server RSS peak MiB"]
    return cell_section(doc, "W11", "sizes", [
            "## W11 64 KiB and 1 MiB messages — W1 publish / W2 drain in MB/s beside the disk",
            f"The W1 and W2 cells with large bodies, about {s.get('large_bytes_per_size', 0) / 2**20:,.0f} MiB a size, "
            f"batches of about {s.get('large_batch_bytes', 0) / 2**20:,.0f} MiB and "
            f"{s.get('large_window_bytes', 0) / 2**20:,.0f} MiB unacknowledged (prefetch half that). "
            "*Disk*: the same batch bytes appended and fdatasynced in a loop "
            "(2 s) in the server's directory, just before: the rate a log that fsyncs every batch could reach."],
        header, rows_of)


def cell_goals(doc: dict[str, Any]) -> list[tuple[str, Callable[[str], str]]]:
    """Goal rows of the named cells: (text, figure of a qmq system)."""

    def fanout(name: str, workload: str = "W9") -> str:
        entry = doc["systems"][name]
        run = run_of(entry, workload)
        if run is None or "drained" not in run:
            return state(entry, workload) or "–"
        mine = dig(run, "drained", "deliveries_per_s")
        p99 = dig(run, "live", "latency_ms", "p99")
        peer = best_peer(doc, workload, lambda r: dig(r, "drained", "deliveries_per_s"))
        parts = []
        if mine is not None:
            ratio = mine / peer[0] if peer else None
            parts.append(f"{fmt(mine)}/s" + (f" = {ratio:.2f}× {peer[1]}{mark(ratio >= FANOUT_VS_BEST_PEER)}"
                                              if ratio is not None and peer else ""))
        if p99 is not None:
            parts.append(f"live p99 {p99:.1f} ms{mark(p99 <= FANOUT_LIVE_P99_MS)}")
        return ", ".join(parts) or "–"

    def subjects(name: str) -> str:
        entry = doc["systems"][name]
        run = run_of(entry, "W10")
        if run is None or "reached" not in run:
            return state(entry, "W10") or "–"
        reached, asked = run.get("reached") or 0, run.get("asked") or 0
        broker = (run.get("rss_bytes_per_subject") or {}).get("broker")
        rate = run.get("new_subjects_per_s")
        restart = dig(run, "restart", "restart_s")
        parts = [f"{fmt(reached)} of {fmt(asked)}{mark(reached >= asked)}"]
        if broker is not None:
            parts.append(f"broker {fmt(broker)} B/subject{mark(broker <= SUBJECT_BROKER_BYTES_MAX)}")
        if rate is not None:
            parts.append(f"{fmt(rate)} new/s{mark(rate >= NEW_SUBJECTS_PER_S_MIN)}")
        if restart is not None:
            parts.append(f"restart {restart:.1f} s{mark(restart < RESTART_S_MAX)}")
        return ", ".join(parts)

    goal = f"drained ≥ {FANOUT_VS_BEST_PEER:.0f}× the best peer, live p99 ≤ {FANOUT_LIVE_P99_MS:.0f} ms"
    return [
        (f"W9 fan-out to 70 groups: {goal}", fanout),
        (f"W15 fan-out to 700 groups: {goal} (live at the same deliveries/s)", lambda name: fanout(name, "W15")),
        (f"W10 40,000 subjects: all held, ≤ {SUBJECT_BROKER_BYTES_MAX:,} B broker RSS per idle subject, ≥ "
         f"{NEW_SUBJECTS_PER_S_MIN:,} new subjects/s, restart < {RESTART_S_MAX:.0f} s", subjects),
    ]
