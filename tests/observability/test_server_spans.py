"""Server spans (``trace_spans = true``, qmq.serving.tracing): a standalone's broker and delay
server export, to a real OTLP/HTTP receiver, spans of what they did with a traced message —
the delay server's schedule and fire, the broker's store — each a child of the producer's send
span; an untraced message makes none; spans off (the default) export nothing; without the
otel-server extra a server with spans on refuses to start, naming it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from tests.observability.test_tracing import scenario

from qmq.testing import ReadyProcess
from qmq.testing.processes import qmq_argv, start_ready

pytestmark = pytest.mark.integration

_KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1 (protobuf bodies), in a thread of its own."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.services: set[str] = set()
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _export(self, request: web.Request) -> web.Response:
        body = ExportTraceServiceRequest.FromString(await request.read())
        for rs in body.resource_spans:
            service = {a.key: a.value.string_value for a in rs.resource.attributes}.get("service.name", "")
            self.services.add(service)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attributes: dict[str, Any] = {}
                    for a in s.attributes:
                        v = a.value
                        attributes[a.key] = v.string_value if v.HasField("string_value") else v.int_value
                    self.spans.append(
                        {
                            "service": service,
                            "name": s.name,
                            "kind": _KINDS.get(s.kind, str(s.kind)),
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_id": s.parent_span_id.hex(),
                            "start_ns": s.start_time_unix_nano,
                            "end_ns": s.end_time_unix_nano,
                            "status": s.status.code,
                            "attributes": attributes,
                        }
                    )
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._export)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/v1/traces"
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(10), "the OTLP receiver did not start"

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def wait_for(self, predicate: Any, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = list(self.spans)
            if predicate(spans):
                return spans
            time.sleep(0.1)
        raise AssertionError(f"the spans the servers exported never matched: {self.spans}")


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    c.start()
    yield c
    c.stop()


def _standalone(tmp_path: Path, extra: str) -> ReadyProcess:
    config = tmp_path / "qmq.toml"
    config.write_text(extra)
    return start_ready(qmq_argv("standalone", "--data-dir", str(tmp_path / "data"), "--config", str(config)))


@pytest.mark.timeout(150)
def test_the_delay_server_and_the_broker_export_spans_that_are_children_of_the_send(
    tmp_path: Path, collector: Collector
) -> None:
    spans_on = f'trace_spans = true\ntrace_endpoint = "{collector.url}"\n'
    proc = _standalone(tmp_path, f"[broker]\n{spans_on}\n[delay]\n{spans_on}")
    try:
        subject = "traced.order"
        client_spans = scenario("trace", proc.meta_server, subject)
        [send] = [s for s in client_spans if s["name"] == f"send {subject}"]
        trace_id = send["trace_id"]

        def complete(spans: list[dict[str, Any]]) -> bool:
            names = [s["name"] for s in spans if s["trace_id"] == trace_id]
            fires = [n for n in names if n.startswith("fire ")]
            stores = [n for n in names if n.startswith("store ")]
            return f"schedule {subject}" in names and len(fires) >= 3 and len(stores) >= 3

        spans = [s for s in collector.wait_for(complete) if s["trace_id"] == trace_id]
    finally:
        proc.stop()
    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    message_id = send["attributes"]["messaging.message.id"]
    [schedule] = by_name[f"schedule {subject}"]
    [fire] = by_name[f"fire {subject}"]
    [store, *_] = sorted(by_name[f"store {subject}"], key=lambda s: s["start_ns"])
    assert schedule["service"] == fire["service"] == "qmq-delay"
    assert store["service"] == "qmq-broker"
    assert (schedule["kind"], fire["kind"], store["kind"]) == ("SERVER", "PRODUCER", "SERVER")
    for s in (schedule, fire, store):
        assert s["parent_id"] == send["span_id"], f"{s['name']} is a child of the send"
        assert s["attributes"]["messaging.message.id"] == message_id
        assert s["attributes"]["messaging.system"] == "qmq"
        assert s["attributes"]["messaging.destination.name"] == subject
        assert s["end_ns"] >= s["start_ns"]
        assert s["status"] == 0, "stored and handed over: no error"
    assert "messaging.qmq.deliver_at" in schedule["attributes"]
    # the delay (0.5 s in the scenario) passed between the schedule and the fire, and the
    # broker stored the message once the delay server handed it over
    assert fire["start_ns"] - schedule["start_ns"] >= 400_000_000
    assert store["start_ns"] >= fire["start_ns"]
    # the two failed attempts went back through the retry subject: their hand-overs are traced too
    retries = [s for s in spans if s["name"].startswith(("fire ", "store ")) and not s["name"].endswith(subject)]
    assert len(retries) >= 4, sorted(by_name)  # at least two hand-overs to the broker, each stored
    assert {s["parent_id"] for s in retries} == {send["span_id"]}


@pytest.mark.timeout(180)
def test_spans_are_off_by_default_and_untraced_or_unsampled_messages_make_none(
    tmp_path: Path, collector: Collector
) -> None:
    # spans off: a traced message goes through, nothing is exported
    proc = _standalone(tmp_path, f'[broker]\ntrace_endpoint = "{collector.url}"\n')
    try:
        scenario("trace", proc.meta_server, "off.subject")
    finally:
        proc.stop()
    assert collector.spans == []
    # spans on, a message sent by an application with no tracer: no span either (the
    # scenario's "plain" mode sends and handles one message with no provider set)
    spans_on = f'trace_spans = true\ntrace_endpoint = "{collector.url}"\n'
    proc = _standalone(tmp_path, f"[broker]\n{spans_on}\n[delay]\n{spans_on}")
    try:
        out = scenario("plain", proc.meta_server, "plain.subject")
        assert "traceparent" not in out["properties"]
    finally:
        proc.stop()  # a clean stop exports what was queued
    assert collector.spans == []
    # spans on with a sample ratio of 0: a traced message makes none
    proc = _standalone(
        tmp_path, f"[broker]\n{spans_on}trace_sample_ratio = 0\n[delay]\n{spans_on}trace_sample_ratio = 0\n"
    )
    try:
        scenario("trace", proc.meta_server, "unsampled.subject")
    finally:
        proc.stop()
    assert collector.spans == []


def test_a_server_with_spans_on_but_no_sdk_refuses_to_start_naming_the_extra(tmp_path: Path) -> None:
    # the interpreter is the suite's, with the SDK; hide it as an application without the extra would
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')):\n"
        "            raise ImportError(f'No module named {name!r}')\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Hide())\n"
    )
    config = tmp_path / "broker.toml"
    config.write_text("[broker]\ntrace_spans = true\n")
    done = subprocess.run(
        [sys.executable, "-m", "qmq", "broker", "--data-dir", str(tmp_path / "b"), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(hide)},
        check=False,
    )
    assert done.returncode == 3, done.stderr
    assert "trace_spans = true" in done.stderr
    assert "qmq[otel-server]" in done.stderr
