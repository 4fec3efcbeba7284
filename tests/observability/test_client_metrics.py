"""The SDK's OpenTelemetry metrics, read with the SDK's in-memory metric reader in a child
process: sends by outcome and their latency, handled messages by outcome and their latency,
the producer's buffer and retries, a listener's messages in flight and its group's lag."""

from __future__ import annotations

from typing import Any

import pytest
from test_tracing import scenario

pytestmark = pytest.mark.integration


def points(out: dict[str, list[dict[str, Any]]], name: str, subject: str | None = None) -> list[dict[str, Any]]:
    assert name in out, f"metric {name} missing; got {sorted(out)}"
    return [p for p in out[name] if subject is None or p["attributes"].get("messaging.destination.name") == subject]


@pytest.mark.timeout(120)
def test_sends_handling_buffer_in_flight_and_lag_are_measured(meta_server: str, subject: str) -> None:
    out = scenario("metrics", meta_server, subject)
    [sent] = points(out, "messaging.client.sent.messages", subject)
    assert sent["value"] == 20
    assert sent["attributes"]["messaging.system"] == "qmq"
    assert "error.type" not in sent["attributes"]
    [duration] = points(out, "messaging.client.operation.duration", subject)
    assert duration["count"] == 20
    assert duration["unit"] == "s"
    assert 0 < duration["sum"] < 20 * 10
    consumed = {p["attributes"]["qmq.outcome"]: p for p in points(out, "messaging.client.consumed.messages", subject)}
    assert consumed["handled"]["value"] == 20
    assert consumed["failed"]["value"] == 1
    assert consumed["failed"]["attributes"]["error.type"] == "RuntimeError"
    assert consumed["handled"]["attributes"]["messaging.consumer.group.name"] == "g"
    handle_counts = sorted(p["count"] for p in points(out, "messaging.process.duration", subject))
    assert handle_counts == [1, 20]
    [in_flight] = points(out, "qmq.consumer.in_flight", subject)
    assert in_flight["value"] == 0
    [lag] = points(out, "qmq.consumer.lag", subject)
    assert lag["value"] == 0
    assert lag["attributes"]["messaging.consumer.group.name"] == "g"
    for name in ("qmq.producer.buffer.messages", "qmq.producer.buffer.bytes", "qmq.producer.retries"):
        assert [p["value"] for p in points(out, name)] == [0], name
