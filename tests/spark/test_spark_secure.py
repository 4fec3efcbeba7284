"""Spark jobs against a qmq with an auth file and TLS: the data source reads and writes with
the options app_code, secret and tls_ca (each executor's connections authenticate and trust
that CA), and the jobs behind `qmq archive` (batch and `--follow`) and `qmq trace` take the
app, secret and CA of the `qmq` command ($QMQ_APP_CODE, $QMQ_SECRET, $QMQ_TLS_CA)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from followhelpers import FollowProcess, committed_offsets
from pyspark.sql import SparkSession

import qmq
from qmq.auth.secrets import hash_secret
from qmq.spark.archive import run_archive, source_options
from qmq.spark.trace import trace
from qmq.testing import ReadyProcess, running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

SECRETS = {"qmq-cluster": "cluster-secret", "jobs": "jobs-secret"}
AUTH = f"""
[apps.qmq-cluster]
secret_hash = "{hash_secret(SECRETS["qmq-cluster"], log2_n=8)}"
cluster = true
[apps.jobs]
secret_hash = "{hash_secret(SECRETS["jobs"], log2_n=8)}"
produce = ["sec.*"]
consume = ["sec.*"]
"""
FOLLOW_ARGS = (
    "--spark-master",
    "local[2]",
    "--trigger-interval",
    "1s",
    "--spark-conf",
    "spark.driver.extraJavaOptions=-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
)


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The CA file, and the directory of the server's certificate and key and the auth file."""
    where = tmp_path_factory.mktemp("spark-pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    ca.cert_pem.write_to_path(str(where / "ca.pem"))
    (where / "cert.pem").write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(where / "key.pem"))
    (where / "auth.toml").write_text(AUTH)
    return where / "ca.pem", where


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, ca_file: tuple[Path, Path]) -> Iterator[ReadyProcess]:
    ca, where = ca_file
    args = ["--auth-file", str(where / "auth.toml"), "--app-code", "qmq-cluster"]
    args += ["--tls-cert", str(where / "cert.pem"), "--tls-key", str(where / "key.pem")]
    env = {"SSL_CERT_FILE": str(ca), "QMQ_SECRET": SECRETS["qmq-cluster"]}
    with running_standalone(tmp_path_factory.mktemp("spark-secure") / "data", extra_args=args, env=env) as proc:
        assert proc.meta_server.startswith("https://")
        yield proc


def _options(meta_server: str, ca: Path) -> dict[str, str]:
    return {"meta_server": meta_server, "app_code": "jobs", "secret": SECRETS["jobs"], "tls_ca": str(ca)}


def test_the_data_source_writes_and_reads_with_app_secret_and_ca(
    spark: SparkSession, secured: ReadyProcess, ca_file: tuple[Path, Path]
) -> None:
    ca, _ = ca_file
    options = _options(secured.meta_server, ca)
    rows = spark.createDataFrame([(f"row {i}".encode(),) for i in range(5)], "body binary")
    rows.write.format("qmq").options(**options).option("subject", "sec.written").mode("append").save()
    df = spark.read.format("qmq").options(**options).option("subscribe", "sec.written").load()
    assert sorted(r.body for r in df.select("body").collect()) == [f"row {i}".encode() for i in range(5)]

    # without the secret the meta server refuses the job; without the CA it does not trust the servers
    no_secret = {k: v for k, v in options.items() if k != "secret"}
    with pytest.raises(Exception, match="AuthError"):
        spark.read.format("qmq").options(**no_secret).option("subscribe", "sec.written").load().collect()
    no_ca = {k: v for k, v in options.items() if k != "tls_ca"}
    with pytest.raises(Exception, match=r"(?i)certificate"):
        spark.read.format("qmq").options(**no_ca).option("subscribe", "sec.written").load().collect()


def _send(meta_server: str, ca: Path, subject: str, n: int) -> list[str]:
    import ssl

    ctx = ssl.create_default_context(cafile=str(ca))
    ids = []
    with qmq.Producer(app_code="jobs", meta_server=meta_server, secret=SECRETS["jobs"], ssl=ctx) as producer:
        for i in range(n):
            m = producer.generate_message(subject)
            m.body = f"archived {i}".encode()
            producer.send(m)
            ids.append(m.message_id)
    return ids


def test_archive_and_trace_take_the_commands_app_secret_and_ca(
    spark: SparkSession, secured: ReadyProcess, ca_file: tuple[Path, Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    ca, _ = ca_file
    url = secured.meta_server
    ids = _send(url, ca, "sec.archived", 30)
    env = {"QMQ_APP_CODE": "jobs", "QMQ_SECRET": SECRETS["jobs"], "QMQ_TLS_CA": str(ca)}

    # qmq archive --follow, with the identity and trust in the environment
    archive = tmp_path / "archive"
    follow = FollowProcess(archive, ("--meta-server", url), FOLLOW_ARGS, env={**os.environ, **env})
    try:
        follow.wait_for(lambda: committed_offsets(archive).get(("broker-1", "sec.archived")) == 30, "30 archived")
    finally:
        assert follow.interrupt() == 0, follow.stderr()
    got = spark.read.parquet(str(archive)).where("subject = 'sec.archived'").select("message_id").collect()
    assert sorted(r.message_id for r in got) == sorted(ids)

    # the batch archive and the trace, as the command runs them (the environment of the driver)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    more = _send(url, ca, "sec.archived", 5)
    assert run_archive(spark, source_options(url, None, None), archive).per_subject == {"sec.archived": 5}
    found = trace(spark, more[2], meta_server=url)
    assert [(s.subject, s.sequence) for s in found.stored] == [("sec.archived", 32)]
