"""Where the ``qmq`` data source gets records: brokers through the meta server, or a broker's
data directory read offline.

``fetch_bounds`` runs where Spark plans (it asks every available broker group for its
subjects: SUBJECTS, and READ for the first kept sequence when SUBJECTS does not say);
``read_task`` runs in an executor and yields Arrow batches of one ``ReadTask`` — READ requests
over a connection opened there (one request ahead of the batch being converted), or
``StoreReader`` over the files. A ``ReadTask`` carries everything its read needs, since it
is pickled to a process that has seen nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from qmq.client.connection import Connection
from qmq.client.meta import MetaClient
from qmq.client.pages import subjects as subjects_of
from qmq.common.errors import ConnectionLostError, QmqError
from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame
from qmq.spark.access import Access
from qmq.spark.offsets import Pair, SourceOptions
from qmq.spark.records import record_starts, records_to_batch
from qmq.store.reader import StoreReader

log = logging.getLogger(__name__)

# A READ asks for at most this many records (the broker's pull_messages_max).
READ_RECORDS_MAX = 10_000
# Records per Arrow batch handed to Spark, and its bytes: Spark takes large batches far faster
# than small ones (measured: 2,000 rows a batch 0.48 M rows/s, 50,000 rows 0.7 M rows/s).
BATCH_RECORDS_MAX = 50_000
BATCH_BYTES_MAX = 32 * 1024 * 1024
_CONNECT_TIMEOUT_MS = 5_000
_META_TIMEOUT_MS = 10_000
_REQUEST_TIMEOUT_S = 60.0
# Reconnects (through the meta server, for a broker group that failed over) per read task.
_RECONNECTS_MAX = 3

Bounds = dict[Pair, tuple[int, int]]


class DataLossError(QmqError):
    """Records a read was to return are gone (retention removed them, or a broker lost them)."""


@dataclass(frozen=True, slots=True)
class ReadTask:
    """One slice of a read, with what an executor needs to read it."""

    meta_server: str | None
    path: str | None
    broker_group: str
    address: str  # of the broker group's master when planned; "" for path
    subject: str
    start: int
    end: int
    fail_on_data_loss: bool
    access: Access  # the app, secret and CA of its connections


@dataclass(frozen=True, slots=True)
class SourceState:
    """What planning found: each selected pair's (first kept, next) sequences and group addresses."""

    bounds: Bounds
    addresses: dict[str, str]


def fetch_bounds(options: SourceOptions) -> SourceState:
    """Bounds of every selected (broker group, subject); groups that are unavailable are left out."""
    if options.path is not None:
        reader = StoreReader(options.path)
        bounds = {
            (options.broker_group, subject): reader.bounds(subject)
            for subject in reader.subjects()
            if options.selects(subject)
        }
        return SourceState(bounds, {options.broker_group: ""})
    assert options.meta_server is not None
    return asyncio.run(_remote_bounds(options.meta_server, options.selects, options.access))


async def broker_groups(meta_server: str, access: Access) -> dict[str, str]:
    """Available broker groups and the addresses of their masters."""
    meta = MetaClient(
        meta_server, timeout_ms=_META_TIMEOUT_MS, authorization=access.authorization(), ssl=access.tls(meta_server)
    )
    await meta.start()
    try:
        return {name: g.address for name, g in meta.groups.items()}
    finally:
        await meta.close()


def connect(address: str, meta_server: str | None, access: Access) -> Connection:
    """A connection to a broker with the job's identity and trust."""
    return Connection(
        address, connect_timeout_ms=_CONNECT_TIMEOUT_MS, credentials=access.credentials(), ssl=access.tls(meta_server)
    )


async def _remote_bounds(meta_server: str, selects: Callable[[str], bool], access: Access) -> SourceState:
    addresses = await broker_groups(meta_server, access)
    results = await asyncio.gather(
        *(
            _group_bounds(connect(address, meta_server, access), group, selects)
            for group, address in sorted(addresses.items())
        ),
        return_exceptions=True,
    )
    bounds: Bounds = {}
    for (group, _address), result in zip(sorted(addresses.items()), results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, QmqError | OSError):
                raise result
            # like an unavailable group: left out now, read when it is back
            log.warning("broker group %s is left out of this read: %s", group, result)
            continue
        bounds.update(result)
    return SourceState(bounds, addresses)


async def _group_bounds(conn: Connection, group: str, selects: Callable[[str], bool]) -> Bounds:
    try:
        async with asyncio.timeout(_REQUEST_TIMEOUT_S):
            out: Bounds = {}
            async for item in subjects_of(conn):
                subject = item.get("subject")
                if not isinstance(subject, str) or not selects(subject):
                    continue
                end = int(item.get("messages", 0))
                first = item.get("first")
                if not isinstance(first, int):
                    first = 0
                    if end:
                        probe = await conn.request(RequestCode.READ, {"subject": subject, "from": 0, "max": 1})
                        first = int(probe.header.get("start", 0))
                out[(group, subject)] = (min(first, end), end)
            return out
    finally:
        await conn.close()


def read_task(task: ReadTask) -> Iterator[pa.RecordBatch]:
    """The records of ``task`` as Arrow batches (one per READ answer or per file read)."""
    if task.start >= task.end:
        return iter(())
    if task.path is not None:
        return _read_files(task)
    return _read_remote(task)


def _lost(task: ReadTask, expected: int, got: int) -> None:
    """Records ``expected .. got-1`` are gone: fail, or go on past them (failOnDataLoss=false)."""
    what = (
        f"subject {task.subject!r} of broker group {task.broker_group}: sequences {expected}..{got - 1} "
        f"were removed (retention) before this read reached them"
    )
    if task.fail_on_data_loss:
        raise DataLossError(f"{what}; read from a later offset, or set failOnDataLoss=false to skip them")
    log.warning("%s; skipped (failOnDataLoss=false)", what)


def _read_files(task: ReadTask) -> Iterator[pa.RecordBatch]:
    assert task.path is not None
    yield from _gathered(_file_batches(task, StoreReader(task.path)))


def _file_batches(task: ReadTask, reader: StoreReader) -> Iterator[pa.RecordBatch]:
    seq = task.start
    while seq < task.end:  # bounded: every run moves seq forward, or the loop ends
        run = reader.read(task.subject, seq, min(task.end, seq + READ_RECORDS_MAX))
        if run.first > seq:
            _lost(task, seq, min(run.first, task.end))
        if run.records == 0:
            if run.first < task.end:
                raise DataLossError(
                    f"subject {task.subject!r} in {task.path!r} has no good record at sequence {run.first} "
                    f"though the read was planned up to {task.end}; was the data directory cut or restored?"
                )
            return
        yield records_to_batch(run.data, task.subject, task.broker_group)
        seq = run.first + run.records


def _gathered(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Batches of about BATCH_RECORDS_MAX records made of smaller ones (converted small: they
    stay in the CPU's caches; handed over large: Spark takes them faster)."""
    held: list[pa.RecordBatch] = []
    records = size = 0
    for batch in batches:
        held.append(batch)
        records += batch.num_rows
        size += batch.nbytes
        if records >= BATCH_RECORDS_MAX or size >= BATCH_BYTES_MAX:
            yield held[0] if len(held) == 1 else pa.concat_batches(held)
            held, records, size = [], 0, 0
    if held:
        yield held[0] if len(held) == 1 else pa.concat_batches(held)


def _read_remote(task: ReadTask) -> Iterator[pa.RecordBatch]:
    loop = asyncio.new_event_loop()
    reader = _RemoteReader(task, loop)
    try:
        yield from reader.batches()
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(reader.close())
        loop.close()


class _RemoteReader:
    """READ requests for one task on a private event loop, driven between yields."""

    def __init__(self, task: ReadTask, loop: asyncio.AbstractEventLoop) -> None:
        self.task = task
        self.loop = loop
        self.address = task.address
        self.conn: Connection | None = None
        self.reconnects = 0

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, _REQUEST_TIMEOUT_S))

    def _start(self, seq: int) -> asyncio.Future[Frame]:
        if self.conn is None:
            self.conn = connect(self.address, self.task.meta_server, self.task.access)
        header = {"subject": self.task.subject, "from": seq, "max": min(READ_RECORDS_MAX, self.task.end - seq)}
        fut: asyncio.Future[Frame] = self._run(self.conn.start_request(RequestCode.READ, header))
        return fut

    def _reconnect(self, exc: Exception) -> None:
        self.reconnects += 1
        if self.reconnects > _RECONNECTS_MAX or self.task.meta_server is None:
            raise ConnectionLostError(
                f"reading {self.task.subject!r} from broker group {self.task.broker_group}: {exc} "
                f"(after {self.reconnects - 1} reconnects)"
            ) from exc
        if self.conn is not None:
            self._run(self.conn.close())
            self.conn = None
        groups = self._run(broker_groups(self.task.meta_server, self.task.access))
        address = groups.get(self.task.broker_group)
        if address is None:
            raise ConnectionLostError(
                f"broker group {self.task.broker_group} is not available (meta server {self.task.meta_server}); "
                f"cannot read {self.task.subject!r}: {exc}"
            ) from exc
        self.address = address

    def _answer(self, seq: int, fut: asyncio.Future[Frame] | None) -> Frame:
        while True:  # bounded by _RECONNECTS_MAX
            try:
                if fut is None:
                    fut = self._start(seq)
                frame: Frame = self._run(fut)
                return frame
            except (ConnectionLostError, TimeoutError) as exc:
                fut = None
                self._reconnect(exc)

    def batches(self) -> Iterator[pa.RecordBatch]:
        task = self.task
        return _gathered(records_to_batch(data, task.subject, task.broker_group) for data, _n in self._answers())

    def _answers(self) -> Iterator[tuple[bytes, int]]:
        """The records of each READ answer in ``[start, end)`` and how many they are."""
        task = self.task
        seq = task.start
        pending: asyncio.Future[Frame] | None = None
        while seq < task.end:  # bounded: each answer moves seq forward, or the loop ends
            frame = self._answer(seq, pending)
            pending = None
            first = int(frame.header["first"])
            count = int(frame.header["count"])
            if first > seq:
                _lost(task, seq, min(first, task.end))
            if count == 0:
                if first < task.end:
                    raise DataLossError(
                        f"broker group {task.broker_group} has {frame.header.get('end')} messages of "
                        f"{task.subject!r}, fewer than the {task.end} this read was planned for; "
                        "did the broker lose its files?"
                    )
                return
            n = min(count, task.end - first)
            seq = first + n
            if seq < task.end:
                pending = self._start(seq)
            body = bytes(frame.body)
            if n < count:  # retention moved the start: the answer ran past this task's end
                body = body[: int(record_starts(body)[n])]
            yield body, n

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()
