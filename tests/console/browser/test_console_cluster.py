"""The console's cluster page in a real browser, and who may open the console."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from tests.console.browser.conftest import SECRETS, Cluster

from qmq.auth.http import basic_authorization

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(120)]


def _status(url: str, authorization: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": authorization} if authorization else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_only_an_admin_app_opens_the_console(console_cluster: Cluster) -> None:
    assert console_cluster.console.endswith("/console/")
    assert _status(console_cluster.console, None) == 401
    assert _status(console_cluster.console, basic_authorization("shop", SECRETS["shop"])) == 403
    assert _status(console_cluster.console, basic_authorization("ops", "wrong")) == 401
    assert _status(console_cluster.console, basic_authorization("ops", SECRETS["ops"])) == 200


def test_the_cluster_page_shows_groups_servers_and_disk(page: Any, console_cluster: Cluster, shoot: Any) -> None:
    page.goto(console_cluster.console)
    groups = page.locator("#groups")
    assert "broker" in groups.inner_text()
    assert "delay" in groups.inner_text()
    servers = page.locator("#servers tr")
    assert servers.count() >= 3  # the header, the broker and the delay server
    text = page.locator("#servers").inner_text()
    assert "master" in text
    assert "%" in text  # the disk used, from the servers' /metrics
    path: Path = shoot(page, "console-cluster")
    assert path.stat().st_size > 10_000


def _post(url: str, headers: dict[str, str]) -> int:
    request = urllib.request.Request(url, data=b"subject=console.forged&owner=x", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_an_action_needs_htmx_and_the_consoles_own_origin(console_cluster: Cluster) -> None:
    """A forged cross-site form post carries the browser's Basic credentials but neither
    HX-Request nor this origin: refused (CSRF)."""
    url = console_cluster.console + "subjects/create"
    admin = {"Authorization": basic_authorization("ops", SECRETS["ops"])}
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    assert _post(url, {**admin, **form}) == 403
    assert _post(url, {**admin, **form, "HX-Request": "true", "Origin": "http://evil.example"}) == 403
    assert _post(url, {**form, "HX-Request": "true"}) == 401
    base = console_cluster.console.removesuffix("/console/")
    assert _post(url, {**admin, **form, "HX-Request": "true", "Origin": base}) == 200
