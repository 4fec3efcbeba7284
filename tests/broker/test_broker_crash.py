"""kill -9 during a sustained send: every acknowledged send survives, acked messages are not redelivered."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rawclient import RawClient, message, split_records

from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.message import decode_message
from qmq.testing import running_role

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _ids(frame_body: bytes) -> list[str]:
    return [decode_message(m).message_id for _seq, m in split_records(frame_body)]


def test_kill_9_during_sends_loses_no_acknowledged_message(tmp_path: Path) -> None:
    data = str(tmp_path / "broker")
    acked_sends: list[str] = []
    consumed_and_acked: set[str] = set()
    enough = threading.Event()

    with running_role(["broker", "--data-dir", data, "--checkpoint-interval-ms", "50"]) as proc:
        address = proc.ready["address"]

        def sender() -> None:
            c = RawClient(address)
            n = 0
            try:
                while True:
                    batch = [f"m{n + i}" for i in range(50)]
                    resp = c.send(*[message("crash.s", i, b"x" * 200) for i in batch])
                    assert resp.status == Status.OK
                    assert not answer_of(resp)["errors"]
                    acked_sends.extend(batch)
                    n += 50
                    if n >= 3000:
                        enough.set()
            except (ConnectionError, OSError):
                return  # the broker was killed mid-send
            finally:
                c.close()

        t = threading.Thread(target=sender)
        t.start()
        consumer = RawClient(address)
        for _ in range(5):
            got = consumer.pull("crash.s", "g", max_n=200, timeout_ms=2000)
            ids = _ids(bytes(got.body))
            total = sum(n for _p, n in got.header["runs"])
            if total:
                start = got.header["runs"][0][0]
                resp = consumer.call(
                    RequestCode.ACK,
                    {"subject": "crash.s", "group": "g", "consumer_id": "c1", "ranges": [[start, start + total]]},
                )
                assert resp.status == Status.OK
                consumed_and_acked.update(ids)
        consumer.close()
        assert enough.wait(60)
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait()
        t.join(30)
    assert consumed_and_acked
    assert len(acked_sends) >= 3000

    with running_role(["broker", "--data-dir", data]) as proc:
        c = RawClient(proc.ready["address"])
        seen: list[str] = []
        while True:
            got = c.pull("crash.s", "fresh", max_n=5000, timeout_ms=0)
            if not got.header["runs"]:
                break
            seen.extend(_ids(bytes(got.body)))
        assert len(seen) == len(set(seen)), "a message was stored twice"
        missing = set(acked_sends) - set(seen)
        assert not missing, f"{len(missing)} acknowledged sends were lost"
        # the group that acked before the crash never gets those messages again
        again: list[str] = []
        while True:
            got = c.pull("crash.s", "g", session="after-restart", max_n=5000, timeout_ms=0)
            if not got.header["runs"]:
                break
            again.extend(_ids(bytes(got.body)))
        assert not consumed_and_acked & set(again)
        assert set(again) | consumed_and_acked >= set(acked_sends)
        c.close()


def test_held_messages_acknowledged_before_kill_9_are_delivered_once_after_restart(tmp_path: Path) -> None:
    """Held until due (qmq.store.held): some released before the kill, the rest after the
    restart; every one delivered, none twice, none before its time."""
    data = str(tmp_path / "broker")
    with running_role(["broker", "--data-dir", data, "--checkpoint-interval-ms", "50"]) as proc:
        c = RawClient(proc.ready["address"])
        now = int(time.time() * 1000)
        due = {f"h{i}": now + 100 + i * 40 for i in range(20)}  # 100 .. 860 ms ahead
        resp = c.send(*[message("held.s", mid, deliver_at_ms=at) for mid, at in due.items()])
        assert answer_of(resp) == {"errors": [], "duplicates": 0}
        got = c.pull("held.s", "g", max_n=100, timeout_ms=2000)  # woken by the first release
        received_at = int(time.time() * 1000)
        before = _ids(bytes(got.body))
        c.close()
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait()
    assert before
    assert len(before) < len(due), "every message was due before the kill; nothing was held across it"

    with running_role(["broker", "--data-dir", data]) as proc:
        c = RawClient(proc.ready["address"])
        seen: list[str] = []
        deadline = time.monotonic() + 10
        while len(seen) < len(due) and time.monotonic() < deadline:
            got = c.pull("held.s", "fresh", max_n=100, timeout_ms=1000)
            seen.extend(_ids(bytes(got.body)))
        c.close()
    assert sorted(seen) == sorted(due), "a held message was lost or released twice"
    assert all(due[mid] <= received_at for mid in before), "released before it was due"


def test_torn_tail_is_cut_and_logged(tmp_path: Path) -> None:
    data = tmp_path / "broker"
    with running_role(["broker", "--data-dir", str(data)]) as proc:
        c = RawClient(proc.ready["address"])
        c.send(message("torn.s", "a"), message("torn.s", "b"))
        c.close()
    seg = sorted((data / "log").glob("*.log"))[-1]
    with open(seg, "ab") as fh:
        fh.write(b"QMR1" + b"\x00" * 40)  # a record header cut short, as a crash mid-write leaves
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import logging, sys; logging.basicConfig(level=logging.INFO);"
                "from qmq.common.config import BrokerConfig; from qmq.store.broker_store import BrokerStore;"
                f"s = BrokerStore(BrokerConfig(data_dir={str(data)!r})); r = s.open();"
                "print(r.torn_bytes, s.subjects['torn.s'].next_seq)"
            ),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["44", "2"]
    assert "torn tail of 44 bytes" in out.stderr
