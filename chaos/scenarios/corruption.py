"""Corruption: random bytes flipped in, or the tail cut off, each kind of file a broker and a
delay server keep, while they are stopped; then they start again. A server must start or
refuse with a clear error; it must never serve a damaged record as valid (every message's
body is its id, so a damaged one shows); nothing but the messages whose own records were
damaged may be lost: those, without a slave to copy them from, are counted apart."""

from __future__ import annotations

import asyncio
import glob
import random
import shutil
import time
from pathlib import Path

from chaos.checker import History
from chaos.cluster import ChaosCluster
from chaos.history import HistoryFile, now_ms
from chaos.scenario import Result, Settings
from chaos.worker import SUBJECT
from qmq.cli.cluster_launch import StartupFailedError, log_tail
from qmq.protocol.message import decode_message
from qmq.protocol.record import RECORD_HEADER_BYTES, read_record_header
from qmq.store.file_header import HEAD_BYTES, MAGIC
from qmq.store.held import HELD_SEQUENCE

# (file kind, glob under the cluster's directory, whether its files hold records of messages
# (message log, write-ahead log, schedule logs): then a message whose record the damage touched
# and that no intact copy in the broker's message log holds is lost to the damage itself)
KINDS: list[tuple[str, str, bool]] = [
    ("message log", "b1-m/log/*.log", True),
    ("consume log", "b1-m/consume/*/*.cl", False),
    ("action log", "b1-m/action/*.act", False),
    ("dead letters", "b1-m/dead/*/*", False),
    ("broker checkpoint", "b1-m/checkpoint", False),
    ("delay write-ahead log", "d1/wal/*.log", True),
    ("schedule log", "d1/schedule/*/messages", True),
    ("schedule index", "d1/schedule/*/index", False),
    ("dispatch log", "d1/schedule/*/dispatch", False),
    ("delay checkpoint", "d1/checkpoint", False),
]
BROKER_LOG = "b1-m/log/*.log"
# the delay server replays its write-ahead log from its checkpoint, which a clean stop leaves at
# the log's end: damage below it is never read, and what the log held is in the schedule logs
SERVED_FROM_ELSEWHERE = ("delay write-ahead log",)
# the quick form: five kinds, each damaged the way that once lost messages (or the other way)
QUICK_CASES = {
    "message log": "flip",
    "consume log": "flip",
    "broker checkpoint": "truncate",
    "delay write-ahead log": "truncate",
    "schedule index": "flip",
}
FAR_DELAY_S = 25.0  # delay messages still waiting in the delay server while its files are damaged
VERIFY_TIMEOUT_S = 40.0


def run(settings: Settings) -> list[Result]:
    result = Result(
        "corruption",
        "bytes flipped in, or the tail cut off, each of: message, consume, action and dead-letter logs, broker "
        "and delay checkpoints, the delay write-ahead log, schedule logs, their index and dispatch logs",
        command="none when it starts; when it refuses, the error names the file (move it away, restart)",
    )
    t0 = time.monotonic()
    root = settings.work_dir / "corruption"
    try:
        prepared, history, far_due_ms = _prepare(root / "prepared", settings)
        rng = random.Random(17)
        cases = [(k, how) for k in KINDS for how in ("flip", "truncate")]
        if settings.quick:
            cases = [(k, QUICK_CASES[k[0]]) for k in KINDS if k[0] in QUICK_CASES]
        for i, ((kind, pattern, ordered), how) in enumerate(cases):
            case = root / f"case-{i}"
            shutil.copytree(prepared, case, symlinks=True)
            outcome = _damage_and_check(case, kind, pattern, ordered, how, history, far_due_ms, rng, result)
            result.fault_count += 1
            result.notes.append(f"{kind} ({how}): {outcome}")
            settings.log(f"  {kind} ({how}): {outcome}")
            shutil.rmtree(case, ignore_errors=True)
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.duration_s = time.monotonic() - t0
    return [result]


def _prepare(root: Path, settings: Settings) -> tuple[Path, History, int]:
    """A cluster (one broker, one delay server) with every kind of file, stopped cleanly."""
    cluster = ChaosCluster(root, broker_groups=1, slaves=0)
    try:
        cluster.start()
        cluster.start_load(rate=100)
        time.sleep(4)
        far_due_ms = asyncio.run(_extras(cluster.meta_server, root / "history" / "extras.tsv"))
        time.sleep(2)
        cluster.stop_producers()
        time.sleep(3)
        cluster.stop_consumers()
    finally:
        cluster.close()  # SIGTERM: a clean stop, so the damage is the only fault
    history = History()
    history.read_files([*cluster.histories(), root / "history" / "extras.tsv"])
    return root, history, far_due_ms


async def _extras(meta_server: str, path: Path) -> int:
    """Dead letters (a group with no retries failing what it gets) and delay messages due later."""
    from qmq.aio import Consumer, Message, Producer

    out = HistoryFile(path)
    due_ms = now_ms() + int(FAR_DELAY_S * 1000)
    async with Producer(app_code="chaos", meta_server=meta_server) as producer:
        for _ in range(50):
            m = Message.generate(SUBJECT)
            m.body = m.message_id
            m.set_deliver_at(due_ms / 1000)
            out.write([f"S\t{m.message_id}\tdelay\t{m.deliver_at_ms}\n"])
            await producer.send(m)
            out.write([f"A\t{m.message_id}\t{now_ms()}\n"])
    async with Consumer(app_code="chaos", meta_server=meta_server, consumer_id="dead") as consumer:
        pull = consumer.pull_consumer(SUBJECT, "gdead", "earliest", max_retries=0)
        batch = await pull.pull(max_messages=20, timeout_ms=2000)
        await asyncio.gather(*(m.nack() for m in batch))
        await consumer.flush_acks()
    out.close()
    return due_ms


def _records(data: bytes) -> list[tuple[int, int, str, bool]]:
    """(start, end, message id, whether a new group reads it) of the records of a log file's
    bytes, up to the first that does not frame or decode. A new group reads a record of the
    load's subject that is not held (a held delay message is read in its copy made when due)."""
    pos = HEAD_BYTES if data.startswith(MAGIC) else 0
    out: list[tuple[int, int, str, bool]] = []
    while True:
        h = read_record_header(data, pos)
        if h is None or pos + RECORD_HEADER_BYTES + h.length > len(data):
            return out
        start = pos + RECORD_HEADER_BYTES
        try:
            m = decode_message(data, start, h.length)
        except Exception:  # a record of another shape: stop here
            return out
        out.append((pos, start + h.length, m.message_id, m.subject == SUBJECT and h.sequence != HELD_SEQUENCE))
        pos = start + h.length


def _damaged_by(records: list[tuple[int, int, str, bool]], spots: list[int], cut: int | None) -> set[int]:
    """Indexes of ``records`` whose bytes the damage touched: a flipped byte inside, or past ``cut``."""
    out = set()
    for n, (start, end, _mid, _read) in enumerate(records):
        if (cut is not None and end > cut) or any(start <= p < end for p in spots):
            out.add(n)
    return out


def _lost_to_damage(case: Path, target: Path, original: bytes, spots: list[int], cut: int | None) -> set[str]:
    """Ids of messages the damage itself took: a record of theirs in ``target`` was touched and
    no intact copy that a new group reads is in the broker's message log."""
    records = _records(original)
    damaged = _damaged_by(records, spots, cut)
    hit = {records[n][2] for n in damaged}
    intact: set[str] = set()
    for path in glob.glob(str(case / BROKER_LOG)):
        if Path(path) == target:
            intact |= {mid for n, (_s, _e, mid, read) in enumerate(records) if read and n not in damaged}
        else:
            intact |= {mid for _s, _e, mid, read in _records(Path(path).read_bytes()) if read}
    return hit - intact


def _damage(path: Path, how: str, rng: random.Random) -> tuple[list[int], int | None]:
    """Damage ``path`` in its second half: the bytes flipped, or where it was cut."""
    size = path.stat().st_size
    start = size // 2 if size > 1 else 0
    if how == "truncate":
        cut = rng.randrange(start, size) if size > start else 0
        with path.open("r+b") as f:
            f.truncate(cut)
        return [], cut
    data = bytearray(path.read_bytes())
    spots = sorted(rng.randrange(start, size) for _ in range(8)) if size else []
    for p in spots:
        data[p] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))
    return spots, None


def _damage_and_check(
    case: Path,
    kind: str,
    pattern: str,
    ordered: bool,
    how: str,
    history: History,
    far_due_ms: int,
    rng: random.Random,
    result: Result,
) -> str:
    files = sorted((Path(p) for p in glob.glob(str(case / pattern))), key=lambda p: p.stat().st_size)
    files = [p for p in files if p.is_file() and p.stat().st_size > 0]
    if not files:
        return "no such file was written (nothing to damage)"
    target = files[-1]
    original = target.read_bytes()
    spots, cut = _damage(target, how, rng)
    acked = set(history.acked)
    inherent: set[str] = set()
    if ordered and kind not in SERVED_FROM_ELSEWHERE:
        inherent = acked & _lost_to_damage(case, target, original, spots, cut)
    expected = acked - inherent
    cluster = ChaosCluster(case, broker_groups=1, slaves=0)
    try:
        try:
            cluster.start()
        except StartupFailedError as exc:
            name = "d1" if target.is_relative_to(case / "d1") else "b1-m"
            tail = log_tail(Path(cluster.member(name).log)) if cluster.state else str(exc)
            return f"refused to start: {tail[-300:]}"
        far = {mid for mid, (k, due) in history.kinds.items() if k == "delay" and due == far_due_ms}
        got, damaged, early = asyncio.run(_verify(cluster.meta_server, expected, far_due_ms, far))
    finally:
        cluster.close()
    lost = len(expected - got)
    result.figures.sent += len(expected)
    result.figures.acked += len(expected)
    result.figures.lost += lost
    result.figures.early += early
    result.figures.delivered += len(got)
    if damaged:
        result.error = (result.error or "") + f"{kind} ({how}): {damaged} damaged record(s) served; "
    for mid in sorted(expected - got)[:3]:
        result.figures.example(f"lost after damage to {kind} ({how}): {mid}")
    own = f", {len(inherent)} whose own record was damaged (lost with it: no slave)" if inherent else ""
    return f"started; {len(expected)} messages expected{own}, {lost} lost, {damaged} damaged served"


async def _verify(meta_server: str, expected: set[str], far_due_ms: int, far: set[str]) -> tuple[set[str], int, int]:
    """A new group reads the subject from the start until it has ``expected`` (or the deadline)."""
    from qmq.aio import Consumer, QmqError

    got: set[str] = set()
    damaged = early = 0
    deadline = time.monotonic() + VERIFY_TIMEOUT_S + max(0.0, (far_due_ms - now_ms()) / 1000)
    async with Consumer(app_code="chaos", meta_server=meta_server, consumer_id="verify") as consumer:
        pull = consumer.pull_consumer(SUBJECT, f"verify{now_ms()}", "earliest", max_retries=0)
        while time.monotonic() < deadline and not expected <= got:
            try:
                batch = await pull.pull(max_messages=500, timeout_ms=1000)
            except QmqError:
                await asyncio.sleep(0.5)  # the broker is still starting
                continue
            for m in batch:
                if m.body != m.message_id.encode():
                    damaged += 1
                if m.message_id in expected and m.body == m.message_id.encode():
                    got.add(m.message_id)
                if m.message_id in far and now_ms() < far_due_ms:
                    early += 1
            batch.ack_all()
    return got, damaged, early
