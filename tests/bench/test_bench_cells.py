"""The pure logic of the bench's named cells (W9 fan-out, W10 40,000 subjects, W11 large
messages): how deliveries are counted per group, the shapes and memory figures, and the
report's rows and goals. No timings are asserted here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bench.consumers import FanOut
from bench.payload import BODY_BYTES_MAX, make_body, read_header
from bench.report import markdown
from bench.report_cells import cell_goals, fanout_lines, large_lines, many_subjects_lines
from bench.settings import Settings
from bench.workloads_large import disk_group_commit, large_shape, size_label
from bench.workloads_many import per_subject_bytes

pytestmark = pytest.mark.timeout(30)


def test_fanout_counts_each_group_and_the_slowest_one() -> None:
    fan = FanOut(groups=3, per_group=4)
    assert fan.key(2, 3) == 11
    assert fan.key(3, 0) == 12  # a group out of range lands past the tally: a duplicate
    assert fan.key(0, 4) == 12
    for seq in range(4):
        fan.delivered(0, 1_000 + seq, None)
    fan.delivered(1, 2_000, None)
    for seq in range(4):
        fan.delivered(2, 3_000_000_000 + seq, 5_000_000)
    summary = fan.summary()
    assert summary["groups_complete"] == 2
    assert summary["slowest_group_received"] == 1
    assert summary["slowest_group_behind_when_first_done"] == 4  # group 1 had none when group 0 finished
    assert summary["last_group_done_after_first_s"] == 3.0
    assert summary["slowest_group_latency_p99_ms"] == 5.0


def test_bodies_of_any_size_carry_their_header() -> None:
    for size in (24, 1024, 64 * 1024, 1024 * 1024):
        body = make_body(7, 11, 13, size)
        assert len(body) == size
        assert read_header(body) == (7, 11, 13)
    with pytest.raises(ValueError, match="body size"):
        make_body(0, 0, 0, BODY_BYTES_MAX + 1)


def test_large_shapes_keep_the_bytes_in_flight() -> None:
    settings = Settings.full()
    kib64 = large_shape(settings, 64 * 1024)
    assert (kib64.batch, kib64.window, kib64.prefetch, kib64.messages) == (64, 256, 128, 4096)
    mib = large_shape(settings, 1024 * 1024)
    assert (mib.batch, mib.window, mib.prefetch, mib.messages) == (4, 16, 8, 256)
    huge = large_shape(settings.replace(large_batch_bytes=1, large_window_bytes=1), 1024 * 1024)
    assert (huge.batch, huge.window, huge.prefetch) == (1, 1, 1)
    assert [size_label(s) for s in (64 * 1024, 1024 * 1024, 1000)] == ["64 KiB", "1 MiB", "1000 B"]


def test_settings_travel_as_json_with_the_new_tuples() -> None:
    settings = Settings.for_quick()
    assert Settings.from_json(settings.to_json()) == settings


def test_disk_probe_writes_and_cleans_up(tmp_path: Path) -> None:
    figures = disk_group_commit(str(tmp_path), 4096, seconds=0.05, bytes_max=4096 * 2)
    assert 1 <= figures["writes"] <= 2
    assert figures["batch_bytes"] == 4096
    assert list(tmp_path.iterdir()) == []


def test_memory_per_subject_by_role() -> None:
    before = {"broker": 100_000, "meta": 50_000}
    after = {"broker": 102_000, "meta": 50_500}
    assert per_subject_bytes(before, after, 1_024) == {"broker": 2_000, "meta": 500}
    assert per_subject_bytes(before, after, 0) == {"broker": None, "meta": None}


def _doc(systems: dict[str, dict[str, Any]]) -> dict[str, Any]:
    settings = Settings.full()
    return {
        "started": "2026-11-25T01:00:00", "mode": "full", "command": "python -m bench run --only W9,W10,W11",
        "workloads": ["W9", "W10", "W11"], "settings": {**settings.__dict__},
        "machine": {"load_avg_at_start": [1.0, 1.0, 1.0]},
        "versions": {"debian": {}, "pypi": {}},
        "systems": systems,
    }


def _fanout(rate: float, p99: float) -> dict[str, Any]:
    return {"ok": True, "drained": {"ok": True, "deliveries_per_s": rate, "publish_msgs_per_s": 9_000.0,
                                    "fanout": {"slowest_group_behind_when_first_done": 12},
                                    "server": {"server_cpu_s_per_100k": 0.2}},
            "live": {"ok": True, "achieved_rate_per_s": 1_000.0, "latency_ms": {"p50": 1.0, "p99": p99, "p999": 30.0}}}


def _entry(system: str, kind: str, workloads: dict[str, Any]) -> dict[str, Any]:
    return {"system": system, "kind": kind, "guarantee": "sync", "client": "c", "workloads": workloads}


def test_fanout_rows_compare_qmq_with_the_best_peer() -> None:
    doc = _doc({
        "qmq-sync": _entry("qmq-sync", "qmq", {"W9": _fanout(400_000.0, 12.0)}),
        "redis": _entry("redis", "peer", {"W9": _fanout(150_000.0, 3.0)}),
        "rabbitmq": _entry("rabbitmq", "peer", {"W9": {"ok": False, "error": "drained: boom"}}),
    })
    text = "\n".join(fanout_lines(doc))
    assert "fan-out to 70 groups" in text
    assert "2.67× redis" in text
    assert "FAILED: drained: boom" in text
    failed_goal = dict(cell_goals(_doc({"qmq-sync": _entry("qmq-sync", "qmq", {"W9": {"ok": False, "error": "x"}})})))
    assert next(iter(failed_goal.values()))("qmq-sync") == "FAILED: x"
    goals = dict(cell_goals(doc))
    fanout_goal = next(fn for text, fn in goals.items() if text.startswith("W9"))
    assert fanout_goal("qmq-sync") == "400,000/s = 2.67× redis ✓, live p99 12.0 ms ✓"


def test_the_fanout_to_700_groups_has_a_section_and_a_goal_of_its_own() -> None:
    doc = _doc({
        "qmq-sync": _entry("qmq-sync", "qmq", {"W9": _fanout(400_000.0, 12.0), "W15": _fanout(300_000.0, 30.0)}),
        "nats": _entry("nats", "peer", {"W9": _fanout(100_000.0, 3.0), "W15": _fanout(50_000.0, 9.0)}),
    })
    doc["workloads"] = ["W9", "W15"]
    text = "\n".join(fanout_lines(doc, "W15"))
    assert "## W15 fan-out to 700 groups — 2,000 × 1 KiB drained by each group; live 100 msg/s" in text
    assert "(70,000 deliveries/s)" in text
    assert "6.00× nats" in text  # against W15's peer figures, not W9's
    goals = dict(cell_goals(doc))
    wide = next(fn for text, fn in goals.items() if text.startswith("W15"))
    assert wide("qmq-sync") == "300,000/s = 6.00× nats ✓, live p99 30.0 ms ✗"
    report = markdown(doc)
    assert report.index("## W9 fan-out to 70 groups") < report.index("## W15 fan-out to 700 groups")
    assert "| W15 fan-out to 700 groups: drained ≥ 2× the best peer" in report


def test_many_subjects_rows_say_where_a_system_stopped() -> None:
    qmq = {"ok": True, "asked": 40_000, "reached": 40_000, "stopped": None, "new_subjects_per_s": 6_000.0,
           "grow": {"server": {"server_cpu_s": 40.0}}, "rss_bytes_per_subject": {"broker": 1_500, "meta": 600},
           "drain": {"msgs_per_s": 9_000.0}, "restart": {"ok": True, "restart_s": 4.2},
           "listing": {"ok": True, "seconds": 3.0, "subjects_listed": 40_000}}
    rabbit = {"ok": True, "asked": 40_000, "reached": 17_000, "stopped": "at 17,000 subjects: the cell's time limit",
              "new_subjects_per_s": 50.0, "rss_bytes_per_subject": {"server": 300_000},
              "restart": {"ok": False, "error": "restart on its data failed"}}
    doc = _doc({"qmq-sync": _entry("qmq-sync", "qmq", {"W10": qmq}),
                "rabbitmq": _entry("rabbitmq", "peer", {"W10": rabbit})})
    text = "\n".join(many_subjects_lines(doc))
    assert "40,000 subjects" in text
    assert "17,000 of 40,000 | at 17,000 subjects: the cell's time limit" in text
    assert "broker 1,500 / meta 600" in text
    assert "1.00 |" in text  # 40 s of server CPU over 40,000 new subjects: 1 ms each
    goal = next(fn for text, fn in cell_goals(doc) if text.startswith("W10"))
    assert goal("qmq-sync") == "40,000 of 40,000 ✓, broker 1,500 B/subject ✓, 6,000 new/s ✓, restart 4.2 s ✓"


def test_large_rows_put_mb_per_s_beside_the_disk() -> None:
    size = {"body_bytes": 1 << 20, "messages": 256, "batch": 4,
            "disk": {"MB_per_s": 200.0, "fdatasync_per_s": 48.0},
            "publish": {"ok": True, "MB_per_s": 100.0, "server": {"server_cpu_s": 1.34}},
            "drain": {"ok": True, "MB_per_s": 150.0}}
    doc = _doc({"qmq-sync": _entry("qmq-sync", "qmq", {"W11": {"ok": True, "sizes": {"1 MiB": size}}})})
    text = "\n".join(large_lines(doc))
    assert "64 KiB and 1 MiB" in text
    assert "| 1 MiB × 256, batch 4 | 200 (48/s) | 100.0 | 0.50 | 150.0 | 4.99 |" in text


def test_the_report_shows_only_the_goals_of_the_workloads_run() -> None:
    doc = _doc({"qmq-sync": _entry("qmq-sync", "qmq", {"W9": _fanout(1.0, 1.0)})})
    doc["workloads"] = ["W9"]
    text = markdown(doc)
    assert "W9 fan-out to 70 groups: drained" in text
    assert "W1 ≥" not in text
    assert "W10 40,000" not in text
