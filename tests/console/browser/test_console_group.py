"""The console's page of a consumer group in a real browser: backlog, consumers, pause and
resume, reset offset (confirmed), filter (a bad one refused with its position), a consume limit."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from typing import Any

import pytest
from playwright.sync_api import expect
from tests.console.browser.conftest import SECRETS, Cluster, consume, send

from qmq.auth.http import basic_authorization

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(120)]


def _controls(cluster: Cluster) -> dict[str, Any]:
    base = cluster.meta_server.removesuffix("/meta/address")
    request = urllib.request.Request(
        base + "/meta/controls", headers={"Authorization": basic_authorization("ops", SECRETS["ops"])}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        doc: dict[str, Any] = json.loads(answer.read())
        return doc


def test_the_group_page_shows_and_acts(page: Any, console_cluster: Cluster, shoot: Any) -> None:
    subject, group = "console.orders", "billing"
    send(console_cluster, subject, 5, body='{"amount": 50}')
    assert consume(console_cluster, subject, group, 3) == 3
    send(console_cluster, subject, 4, body='{"amount": 500}')
    url = console_cluster.console + f"subjects/{subject}/groups/{group}"
    page.goto(url)
    expect(page.locator("#backlog")).to_have_text("6")
    expect(page.locator("#group-state")).to_have_text("running")
    assert page.locator("#consumers tr").count() >= 2
    assert socket.gethostname() in page.locator("#consumers").inner_text()  # the SDK's ids: host-pid-random

    page.click("#pause")
    expect(page.locator("#flash")).to_contain_text(f"paused {subject} for group {group}")
    expect(page.locator("#group-state")).to_have_text("paused")
    assert [subject, group] in _controls(console_cluster)["paused"]
    page.click("#resume")
    expect(page.locator("#flash")).to_contain_text("resumed")
    expect(page.locator("#group-state")).to_have_text("running")
    assert [subject, group] not in _controls(console_cluster)["paused"]

    page.fill("#filter-expr", "body.amount >")
    page.click("#filter-set")
    expect(page.locator("#flash .error")).to_contain_text("position")
    page.fill("#filter-expr", "body.amount > `100`")
    page.click("#filter-set")
    expect(page.locator("#filter-now")).to_contain_text("body.amount > `100`")
    assert [subject, group, "body.amount > `100`"] in _controls(console_cluster)["filters"]

    page.fill("#transform-expr", "{id: body.order_id")
    page.click("#transform-set")
    expect(page.locator("#flash .error")).to_contain_text("position")
    page.fill("#transform-expr", "{big: body.amount}")
    page.click("#transform-set")
    expect(page.locator("#transform-now")).to_contain_text("{big: body.amount}")
    assert [subject, group, "{big: body.amount}"] in _controls(console_cluster)["transforms"]
    since = page.locator("#consumers tr").nth(1).locator("td").nth(3).inner_text()
    assert re.fullmatch(r"20\d\d-\d\d-\d\dT\d\d:\d\d:\d\dZ", since), since  # when the broker first saw it

    page.fill("#limit-app", "shop")
    page.fill("#limit-rate", "25")
    page.click("#limit-set")
    expect(page.locator("#limits")).to_contain_text(f"{subject}:{group}")

    page.fill("#reset-to", "earliest")
    page.click("#reset")  # the confirmation is accepted by the page fixture
    expect(page.locator("#flash")).to_contain_text("pull offset")
    expect(page.locator("#backlog")).to_have_text("9")
    shoot(page, "console-group-actions")

    page.click("#filter-clear")
    expect(page.locator("#filter-now")).to_contain_text("No filter")
    page.click("#transform-clear")
    expect(page.locator("#transform-now")).to_contain_text("No transform")
    page.click("[data-unlimit='shop']")
    expect(page.locator("#limits")).to_contain_text("No limit set")
    expect(page.locator("#dead-count")).to_have_text("0")
