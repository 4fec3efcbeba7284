"""The console's browser tests: one `qmq standalone` with an auth file, Debian's chromium driven
headless by Playwright (never a downloaded browser), signed in as an admin app with HTTP Basic.

Every page a test opens is watched: a console error, an uncaught exception, a failed request or
an answer of HTTP 400 or more fails the test. ``shoot(page, name)`` saves a screenshot to the
session's screenshot folder (and to $QMQ_CONSOLE_SCREENSHOTS too, when set: docs/images)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tests.auth_files import write_auth_file

from qmq.auth.secrets import hash_secret
from qmq.testing import ReadyProcess, running_standalone

CHROMIUM = Path("/usr/bin/chromium")
SECRETS = {"qmq-cluster": "c-secret", "ops": "o-secret", "shop": "s-secret"}


@dataclass
class Cluster:
    process: ReadyProcess
    auth_file: Path

    @property
    def meta_server(self) -> str:
        return self.process.meta_server

    @property
    def console(self) -> str:
        return self.process.ready["console"]


@dataclass
class Watch:
    """What went wrong in a page: console errors, page errors, failed and refused requests."""

    problems: list[str] = field(default_factory=list)


@pytest.fixture(scope="session")
def console_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("console")
    shop = f'[apps.shop]\nsecret_hash = "{hash_secret(SECRETS["shop"], log2_n=8)}"\nproduce = ["*"]\nconsume = ["*"]'
    grants = 'produce = ["*"]\nconsume = ["*"]'
    auth = write_auth_file(root / "auth.toml", SECRETS["qmq-cluster"], SECRETS["ops"], shop, ops_grants=grants)
    args = ["--auth-file", str(auth), "--app-code", "qmq-cluster"]
    with running_standalone(root / "data", extra_args=args, env={"QMQ_SECRET": SECRETS["qmq-cluster"]}) as proc:
        yield Cluster(proc, auth)


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("console-screenshots")


# per module: Playwright's sync API runs an event loop of its own while it is open, kept out of
# the rest of the suite's asyncio tests
@pytest.fixture(scope="module")
def chromium() -> Iterator[object]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"the console's browser tests need Debian's chromium at {CHROMIUM}: apt-get install chromium "
            "(they never download a browser)"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def watch() -> Watch:
    return Watch()


@pytest.fixture
def page(chromium: object, console_cluster: Cluster, watch: Watch) -> Iterator[object]:
    """A page signed in as the admin app ``ops``; the test fails on any problem it saw."""
    from playwright.sync_api import Browser

    assert isinstance(chromium, Browser)
    context = chromium.new_context(
        http_credentials={"username": "ops", "password": SECRETS["ops"]}, viewport={"width": 1280, "height": 800}
    )
    context.set_default_timeout(15_000)
    p = context.new_page()
    p.on("console", lambda m: watch.problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    p.on("pageerror", lambda e: watch.problems.append(f"page error: {e}"))
    p.on("requestfailed", lambda r: watch.problems.append(f"request failed: {r.method} {r.url}: {r.failure}"))
    p.on("response", lambda r: watch.problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    p.on("dialog", lambda d: d.accept())  # the confirmations of reset, purge and remove
    try:
        yield p
    finally:
        context.close()
    assert watch.problems == [], "the console page had problems:\n" + "\n".join(watch.problems)


@pytest.fixture
def shoot(screenshots: Path) -> object:
    def take(p: object, name: str) -> Path:
        from playwright.sync_api import Page

        assert isinstance(p, Page)
        path = screenshots / f"{name}.png"
        p.screenshot(path=str(path), full_page=True)
        extra = os.environ.get("QMQ_CONSOLE_SCREENSHOTS")
        if extra:
            shutil.copy(path, Path(extra) / path.name)
        return path

    return take


def send(cluster: Cluster, subject: str, count: int, body: str = "{}") -> list[str]:
    """``count`` messages to ``subject`` as the app ``shop``, through the SDK; their ids."""
    from qmq.client.message import Message
    from qmq.client.sync import Producer

    ids = []
    with Producer(app_code="shop", secret=SECRETS["shop"], meta_server=cluster.meta_server) as producer:
        for _ in range(count):
            message = Message(subject, body=body)
            producer.send(message)
            ids.append(message.message_id)
    return ids


def consume(cluster: Cluster, subject: str, group: str, count: int, *, ack: bool = True) -> int:
    """Pull up to ``count`` messages of ``subject`` as ``group`` (app ``shop``), acknowledging them
    when ``ack``; returns how many came."""
    from qmq.client.sync import Consumer

    got = 0
    with Consumer(app_code="shop", secret=SECRETS["shop"], meta_server=cluster.meta_server) as consumer:
        pull = consumer.pull_consumer(subject, group=group, start_from="earliest")
        for _ in range(20):
            messages = pull.pull(max_messages=count - got, timeout_ms=500)
            for m in messages:
                if ack:
                    m.ack()
            got += len(messages)
            if got >= count:
                break
    return got


def kill(cluster: Cluster, subject: str, group: str, count: int, error: str) -> int:
    """Pull ``count`` messages of ``subject`` as ``group`` with no retries and fail each with
    ``error``: they become dead letters. Returns how many."""
    from qmq.client.sync import Consumer

    failed = 0
    with Consumer(app_code="shop", secret=SECRETS["shop"], meta_server=cluster.meta_server) as consumer:
        pull = consumer.pull_consumer(subject, group=group, start_from="earliest", max_retries=0)
        for _ in range(50):
            for m in pull.pull(max_messages=count - failed, timeout_ms=300):
                m.nack(RuntimeError(error))
                failed += 1
            if failed >= count:
                break
    return failed
