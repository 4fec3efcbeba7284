"""The gateway against its own OpenAPI 3.1 document (GET /openapi.json), with schemathesis: for
requests it generates from the document (good and bad), every answer must be one the document
lists, in the shape it gives, never a server error. A gateway of its own standalone, so the
subjects it makes up land on no other test's broker."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case
from schemathesis.specs.openapi.checks import positive_data_acceptance

from qmq.testing import ReadyProcess, running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def gateway_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadyProcess]:
    with running_standalone(tmp_path_factory.mktemp("openapi") / "qmq-data") as proc:
        yield proc


def test_every_route_answers_as_its_document_says(gateway_standalone: ReadyProcess) -> None:
    # schemathesis's pytest plugin does not run under this pytest; its strategies are driven here
    schema = schemathesis.openapi.from_url(f"{gateway_standalone.gateway}/openapi.json")
    checked = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def answers_as_documented(case: Case) -> None:
            if isinstance(case.body, dict):
                timeout_ms = case.body.get("timeout_ms")
                if isinstance(timeout_ms, int | float) and not isinstance(timeout_ms, bool):
                    # a long poll at most this long (15369.0 is an integer to JSON Schema too)
                    case.body["timeout_ms"] = min(timeout_ms, 200)
                elif case.operation.path.endswith("/pull") and "timeout_ms" not in case.body:
                    case.body["timeout_ms"] = 200  # not the default second: 15 examples of a pull
                for m in case.body.get("messages", [case.body]):
                    if isinstance(m, dict) and "deliver_at" in m:
                        # the document cannot say "within the delay server's horizon" of a date-time
                        m["deliver_at"] = _within_horizon(m["deliver_at"])
            # a loaded machine can hold an fsync for seconds: the answer's deadline is generous. A receipt
            # the document allows is still refused unless a gateway signed it (no schema can say that)
            excluded = [positive_data_acceptance] if case.operation.path == "/v1/acks" else []
            case.call_and_validate(timeout=60, excluded_checks=excluded)

        answers_as_documented()
        checked.append(operation.label)
    # every route but the document itself, which schemathesis leaves out
    assert len(checked) == 9, sorted(checked)


def _within_horizon(text: object) -> object:
    try:
        when = datetime.fromisoformat(str(text).upper())
    except ValueError:
        return text
    latest = datetime.now(UTC) + timedelta(days=700)
    return latest.isoformat() if when.tzinfo is not None and when > latest else text


def test_the_document_names_every_route(tmp_path: Path, gateway_standalone: ReadyProcess) -> None:
    import json
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{gateway_standalone.gateway}/openapi.json", timeout=10) as resp:
        doc = json.loads(resp.read())
    assert doc["openapi"] == "3.1.0"
    assert sorted(doc["paths"]) == [
        "/health",
        "/openapi.json",
        "/v1/acks",
        "/v1/subjects",
        "/v1/subjects/{subject}/groups/{group}/dead-letters",
        "/v1/subjects/{subject}/groups/{group}/dead-letters/purge",
        "/v1/subjects/{subject}/groups/{group}/dead-letters/resend",
        "/v1/subjects/{subject}/groups/{group}/lag",
        "/v1/subjects/{subject}/groups/{group}/pull",
        "/v1/subjects/{subject}/messages",
    ]
