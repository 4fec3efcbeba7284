"""Long lists through a real standalone (issue 16, item 3): 5,000 subjects of 100 characters,
2,000 consumer groups on one subject, 2,000 consumers of one group and 1,000 dead letters with
600-character Chinese error texts. ``qmq subjects``, ``qmq lag``, ``qmq dead-letters``, the
Spark reader and the archive's broker requests all list everything. Each list is far past a
64 KiB frame header; the answers are paged in the body (docs/protocol.md).

Here beside the Spark tests, so the reader shares their Spark session."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from pyspark.sql import SparkSession

from qmq.client.connection import Connection
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.message import encode_message, encode_properties
from qmq.spark.access import Access
from qmq.spark.archive import ArchiveState, _remote_dead, _remote_lag
from qmq.spark.offsets import parse_options
from qmq.spark.sources import broker_groups, fetch_bounds
from qmq.testing import running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

SUBJECTS = 5_000
GROUPS = 2_000
CONSUMERS = 2_000
LETTERS = 1_000
ERROR = ("订单处理失败：库存不足，请稍后重试。" * 40)[:600]


def name(prefix: str, i: int, chars: int) -> str:
    head = f"{prefix}.{i:05d}."
    return head + "x" * (chars - len(head))


@dataclass
class Lists:
    meta_server: str
    subjects: list[str]
    groups: list[str]  # of subjects[0]
    consumers: list[str]  # of group "g" of subjects[1]
    dead_of: str  # subjects[2]: LETTERS dead letters of group "g"


def message(subject: str, message_id: str, props: dict[str, str] | None = None) -> bytes:
    return encode_message(subject.encode(), message_id.encode(), b"", 0, encode_properties(props or {}), b"m", 1)


async def _fill(address: str, lists: Lists) -> None:
    conn = Connection(address, connect_timeout_ms=5_000)
    try:
        sends = [b"".join(message(s, f"m{i}") for i, s in enumerate(lists.subjects))]
        dead = f"%DEAD_RETRY%{lists.dead_of}%g"
        sends.append(b"".join(message(dead, f"dead-{i:04d}", {"qmq.error": ERROR}) for i in range(LETTERS)))
        for body in sends:
            assert answer_of(await conn.request(RequestCode.SEND_MESSAGES, {}, [body]))["errors"] == []

        def pull(subject: str, group: str, consumer_id: str) -> dict[str, object]:
            return {"subject": subject, "group": group, "consumer_id": consumer_id, "session": "s", "max": 1}

        # groups and consumers are made by pulls, many in flight on the connection
        pulls = [pull(lists.subjects[0], g, "c") for g in lists.groups]
        pulls += [pull(lists.subjects[1], "g", c) for c in lists.consumers]
        pulls.append(pull(lists.dead_of, "g", "c"))
        answers = await asyncio.gather(*(conn.request(RequestCode.PULL, p) for p in pulls))
        assert {a.status for a in answers} == {Status.OK}
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def lists(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lists]:
    data_dir = tmp_path_factory.mktemp("long-lists") / "qmq-data"
    with running_standalone(data_dir) as proc:
        made = Lists(
            proc.meta_server,
            [name("long", i, 100) for i in range(SUBJECTS)],
            [name("group", i, 60) for i in range(GROUPS)],
            [name("consumer", i, 60) for i in range(CONSUMERS)],
            name("long", 2, 100),
        )
        [address] = asyncio.run(broker_groups(proc.meta_server, Access())).values()
        asyncio.run(_fill(address, made))
        yield made


def qmq(*args: str, meta_server: str) -> list[str]:
    env = {**os.environ, "QMQ_META_SERVER": meta_server}
    done = subprocess.run([sys.executable, "-m", "qmq", *args], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_qmq_subjects_prints_every_subject_and_every_group(lists: Lists) -> None:
    lines = qmq("subjects", meta_server=lists.meta_server)
    rows = {line.split("\t")[0]: line.split("\t") for line in lines[1:]}
    assert set(lists.subjects) <= set(rows)
    assert rows[lists.subjects[0]][2].split(", ") == lists.groups
    assert rows[lists.subjects[3]][1:] == ["1", ""]


def test_qmq_lag_prints_every_consumer(lists: Lists) -> None:
    lines = qmq("lag", lists.subjects[1], "--group", "g", meta_server=lists.meta_server)
    listed = [line.split("\t")[0] for line in lines if "\tbroker-1\t" in line]
    assert listed == lists.consumers
    assert any("2,000" in line for line in lines)  # the group's consumers, counted


def test_qmq_dead_letters_prints_up_to_its_limit_with_whole_errors(lists: Lists) -> None:
    default = qmq("dead-letters", lists.dead_of, "--group", "g", meta_server=lists.meta_server)
    assert len([line for line in default if line.startswith("broker-1\t")]) == 100
    lines = qmq("dead-letters", lists.dead_of, "--group", "g", "--limit", "1000", meta_server=lists.meta_server)
    letters = [line.split("\t") for line in lines if line.startswith("broker-1\t")]
    assert [row[1] for row in letters] == [f"dead-{i:04d}" for i in range(LETTERS)]
    assert {row[4] for row in letters} == {ERROR}
    assert lines[-1] == f"{LETTERS} dead letter(s) of {lists.dead_of} / g"


def test_the_spark_reader_and_the_archives_broker_requests_see_everything(spark: SparkSession, lists: Lists) -> None:
    bounds = fetch_bounds(parse_options({"meta_server": lists.meta_server, "subscribePattern": ".*"}, streaming=False))
    assert {s for _g, s in bounds.bounds} >= set(lists.subjects)
    df = spark.read.format("qmq").option("meta_server", lists.meta_server).option("subscribe", lists.subjects[4])
    assert [r.message_id for r in df.load().collect()] == ["m4"]
    options = parse_options({"meta_server": lists.meta_server, "subscribePattern": ".*"}, streaming=False)
    lag = asyncio.run(_remote_lag(options, 0))
    assert sorted(r["consumer_group"] for r in lag if r["subject"] == lists.subjects[0]) == lists.groups
    dead = asyncio.run(_remote_dead(options, ArchiveState()))
    assert len(dead) == LETTERS
    assert {r["error"] for r in dead} == {ERROR}
