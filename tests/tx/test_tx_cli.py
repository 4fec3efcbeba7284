"""``qmq tx init``, ``qmq tx unblock`` and ``qmq watchdog`` (once, --list-blocked), driven through
the ``qmq`` command group against SQLite and a real `qmq standalone`."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from outbox_helpers import consume, leave_rows, outbox_rows

import qmq.cli.tx_commands as tx_commands
from qmq.cli.main import cli
from qmq.client.message import Message
from qmq.tx import schema


@pytest.fixture
def db_url(tmp_path: object) -> str:
    return f"sqlite:///{tmp_path}/app.db"


def _qmq(*args: str) -> tuple[int, str]:
    # Wide enough that rich's table keeps each cell on one line.
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False, env={"COLUMNS": "250"})
    return result.exit_code, result.output


def test_defaults_agree_with_the_schema() -> None:
    assert tx_commands.DEFAULT_OUTBOX_TABLE == schema.DEFAULT_OUTBOX_TABLE
    assert tx_commands.DEFAULT_LEASE_TABLE == schema.DEFAULT_LEASE_TABLE


def test_init_creates_the_tables_once(db_url: str) -> None:
    for _ in range(2):
        code, out = _qmq("tx", "init", "--db", db_url, "--table", "shop_outbox")
        assert code == 0, out
        assert "has tables shop_outbox and qmq_watchdog_lease" in out
    engine = sa.create_engine(db_url)
    try:
        assert {"shop_outbox", "qmq_watchdog_lease"} <= set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.integration
def test_watchdog_once_resends(db_url: str, meta_server: str, subject: str) -> None:
    assert _qmq("tx", "init", "--db", db_url)[0] == 0
    engine = sa.create_engine(db_url)
    try:
        msg = Message(subject, body="left behind")
        leave_rows(engine, [msg], int(time.time() * 1000) - 120_000)
        code, out = _qmq("watchdog", "--db", db_url, "--meta-server", meta_server, "--once")
        assert code == 0, out
        assert "leased: resent 1, failed 0, blocked 0" in out
        assert outbox_rows(engine) == 0
        assert consume(meta_server, subject, 1) == [(msg.message_id, b"left behind")]
    finally:
        engine.dispose()


def test_list_blocked_and_unblock(db_url: str) -> None:
    assert _qmq("tx", "init", "--db", db_url)[0] == 0
    code, out = _qmq("watchdog", "--db", db_url, "--list-blocked")
    assert (code, out.strip()) == (0, "no blocked rows in qmq_msg_queue")
    engine = sa.create_engine(db_url)
    try:
        leave_rows(engine, [Message("orders.paid", message_id="stuck-1")], 1_700_000_000_000)
        with engine.begin() as conn:
            conn.execute(
                schema.outbox_table("qmq_msg_queue").update().values(status="blocked", attempts=10, last_error="boom")
            )
        code, out = _qmq("watchdog", "--db", db_url, "--list-blocked")
        assert code == 0, out
        assert "stuck-1" in out
        assert "orders.paid" in out
        assert "boom" in out
        assert "1 blocked row(s)" in out
        code, out = _qmq("tx", "unblock", "--db", db_url)
        assert (code, out.strip()) == (0, "qmq tx unblock: 1 row(s) pending again")
        assert _qmq("watchdog", "--db", db_url, "--list-blocked")[1].startswith("no blocked rows")
    finally:
        engine.dispose()


def test_errors_say_what_to_do(db_url: str) -> None:
    code, out = _qmq("watchdog", "--db", db_url)
    assert code == 2
    assert "--meta-server is required" in out
    code, out = _qmq("tx", "init", "--db", "no-such-scheme://x")
    assert code == 2
    assert "--db 'no-such-scheme://x' is not a usable SQLAlchemy database URL" in out
    code, out = _qmq("tx", "init", "--db", db_url, "--table", "drop table")
    assert code == 2
    assert "table='drop table' is not a plain table name" in out


@pytest.mark.integration
def test_missing_tables_are_named(db_url: str, meta_server: str) -> None:
    code, out = _qmq("watchdog", "--db", db_url, "--meta-server", meta_server, "--once")
    assert code == 1
    assert "outbox table qmq_msg_queue or its lease table is missing" in out
    assert "qmq tx init --db URL" in out
    code, out = _qmq("watchdog", "--db", db_url, "--list-blocked")
    assert code == 1
    assert "the database refused" in out
    assert "qmq tx init --db URL" in out
