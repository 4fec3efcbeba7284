"""The exactly-once example (examples/exactly_once) against a real `qmq standalone` and PostgreSQL:
the payment service dies between a commit and its send, the ledger service dies between a
commit and its ack, and every payment is applied exactly once."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

from scratch_dbs import fresh_database

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_SCENARIO = Path(__file__).resolve().parents[2] / "examples" / "exactly_once" / "scenario.py"


def _load_scenario() -> ModuleType:
    spec = importlib.util.spec_from_file_location("exactly_once_scenario", _SCENARIO)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def two_pg_databases(tmp_path: Path) -> Iterator[tuple[str, str]]:
    fresh = contextmanager(fresh_database)
    with fresh("postgresql", tmp_path) as payments, fresh("postgresql", tmp_path) as ledger:
        yield payments.url, ledger.url


def test_each_payment_applied_exactly_once(
    two_pg_databases: tuple[str, str], meta_server: str, subject: str, capsys: pytest.CaptureFixture[str]
) -> None:
    payments_db, ledger_db = two_pg_databases
    outcome = _load_scenario().run(payments_db, ledger_db, meta_server, payments=10, subject=subject)
    out = capsys.readouterr().out
    assert "crashing after the commit of payment 3" in out
    assert "crashing after payment 5 committed, before its ack" in out
    assert "payment 5 duplicate" in out, "the redelivered payment is recognised"
    assert (outcome.payments, outcome.ledger_entries, outcome.distinct_payments_in_ledger) == (10, 10, 10)
    assert outcome.balance_cents == outcome.expected_balance_cents
    assert outcome.outbox_rows_left == 0
    assert outcome.exactly_once
