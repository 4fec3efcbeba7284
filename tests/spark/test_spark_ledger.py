"""The archive's bookkeeping on real files: manifests as commits, workspaces of stopped
writers rolled back, committed batches rolled forward, two writers never both committing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qmq.common.errors import ConfigError
from qmq.spark.follow import lag_of, parse_interval
from qmq.spark.ledger import LEGACY_STATE_FILE, MANIFESTS_KEPT, ArchiveState, ConflictError, Ledger, Workspace

PAIR = ("broker-1", "order.paid")


def stage(ws: Workspace, name: str, text: str = "rows") -> str:
    rel = f"subject=order.paid/date=2026-11-24/{name}.parquet"
    (ws.path / rel).parent.mkdir(parents=True, exist_ok=True)
    (ws.path / rel).write_text(text)
    return rel


def files(archive: Path) -> list[str]:
    return sorted(p.relative_to(archive).as_posix() for p in archive.glob("subject=*/date=*/*.parquet"))


def test_a_commit_moves_the_files_into_place_and_records_the_offsets(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    before = ledger.load()
    assert before == ArchiveState()
    with ledger.workspace() as ws:
        rel = stage(ws, "part-1")
        (ws.path / "_temporary").mkdir()
        (ws.path / "_temporary" / "x.parquet").write_text("half written")
        after = ArchiveState({PAIR: 10}, {}, before.number)
        assert ledger.commit(before, after, ws, {"writer": "test"}) == 1
    assert files(tmp_path) == [rel]
    state = Ledger(tmp_path).load()
    assert (state.offsets, state.number) == ({PAIR: 10}, 1)
    assert os.listdir(tmp_path / "_qmq" / "work") == []


def test_a_writer_stopped_before_its_commit_leaves_nothing_behind(tmp_path: Path) -> None:
    """A child process stages a file and is killed with SIGKILL while it holds its workspace."""
    script = (
        "import os, sys, signal\n"
        "from pathlib import Path\n"
        "from qmq.spark.ledger import Ledger\n"
        "with Ledger(Path(sys.argv[1])).workspace() as ws:\n"
        "    (ws.path / 'subject=a').mkdir()\n"
        "    (ws.path / 'subject=a' / 'part-0.parquet').write_text('x')\n"
        "    print(ws.token, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL
    token = done.stdout.strip()
    assert (tmp_path / "_qmq" / "work" / token / "subject=a" / "part-0.parquet").exists()
    ledger = Ledger(tmp_path)
    with ledger.workspace() as mine:  # a live writer's workspace is left alone
        assert ledger.load() == ArchiveState()
        assert sorted(os.listdir(tmp_path / "_qmq" / "work")) == sorted([mine.token, f"{mine.token}.lock"])
    assert files(tmp_path) == []


def test_a_writer_stopped_after_its_commit_has_its_files_moved_by_the_next_load(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    before = ledger.load()
    with ledger.workspace() as ws:
        rel = [stage(ws, "part-1"), stage(ws, "part-2")]
        ledger.write_manifest(before, ArchiveState({PAIR: 5}, {}, 0), ws, {})
        # stopped here: committed, files still in the workspace; one of them was already moved
        (tmp_path / rel[0]).parent.mkdir(parents=True)
        os.replace(ws.path / rel[0], tmp_path / rel[0])
        assert files(tmp_path) == [rel[0]]
        state = Ledger(tmp_path).load()
        assert (state.offsets, state.number) == ({PAIR: 5}, 1)
        assert files(tmp_path) == sorted(rel)


def test_of_two_writers_on_the_same_state_only_one_commits(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    before = ledger.load()
    with ledger.workspace() as first, ledger.workspace() as second:
        mine = stage(first, "part-first")
        stage(second, "part-second")
        ledger.commit(before, ArchiveState({PAIR: 3}, {}, 0), first, {})
        with pytest.raises(ConflictError, match="committed batch 1"):
            ledger.commit(before, ArchiveState({PAIR: 3}, {}, 0), second, {})
    assert files(tmp_path) == [mine]
    assert Ledger(tmp_path).load().number == 1


def test_an_archive_of_the_state_file_era_goes_on_from_it(tmp_path: Path) -> None:
    doc = {"version": 1, "offsets": {"order.paid": {"broker-1": 42}}, "dead": {"broker-1/%DEAD_RETRY%a%g": 3}}
    (tmp_path / LEGACY_STATE_FILE).write_text(json.dumps(doc))
    ledger = Ledger(tmp_path)
    before = ledger.load()
    assert (before.offsets, before.dead, before.number) == ({PAIR: 42}, {"broker-1/%DEAD_RETRY%a%g": 3}, 0)
    with ledger.workspace() as ws:
        ledger.commit(before, ArchiveState({PAIR: 50}, before.dead, 0), ws, {})
    assert not (tmp_path / LEGACY_STATE_FILE).exists()
    assert Ledger(tmp_path).load().offsets == {PAIR: 50}


def test_a_broken_manifest_is_named(tmp_path: Path) -> None:
    (tmp_path / "_qmq" / "manifests").mkdir(parents=True)
    (tmp_path / "_qmq" / "manifests" / "000000000001.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"000000000001\.json is not valid JSON"):
        Ledger(tmp_path).load()


def test_trigger_intervals_and_lag() -> None:
    assert [parse_interval(t) for t in ("10s", "500ms", "2m", "3")] == [10.0, 0.5, 120.0, 3.0]
    for bad in ("soon", "0s", "-1s"):
        with pytest.raises(ConfigError, match="trigger interval"):
            parse_interval(bad)
    # stored 0..99 (10.. kept) archived to 50: 50 behind; a subject never archived: all it keeps
    assert lag_of({PAIR: (10, 100), ("broker-1", "b"): (5, 8)}, {PAIR: 50}) == 50 + 3


def test_old_manifests_are_removed_once_their_files_are_in_place(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    for i in range(MANIFESTS_KEPT + 5):
        state = ledger.load()
        with ledger.workspace() as ws:
            stage(ws, f"part-{i}")
            ledger.commit(state, ArchiveState({PAIR: i + 1}, {}, state.number), ws, {})
    kept = sorted(os.listdir(tmp_path / "_qmq" / "manifests"))
    assert len(kept) == MANIFESTS_KEPT
    assert kept[-1] == f"{MANIFESTS_KEPT + 5:012d}.json"
    assert Ledger(tmp_path).load().offsets == {PAIR: MANIFESTS_KEPT + 5}
    assert len(files(tmp_path)) == MANIFESTS_KEPT + 5
