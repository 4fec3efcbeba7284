"""The console's push subscriptions and alarms in a real browser: added, listed (and shown on
the group's page), refused with the meta server's words when wrong, removed."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect
from tests.console.browser.conftest import Cluster, send

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(120)]

_NOWHERE = "http://127.0.0.1:9/hook"  # the discard port: nothing listens, deliveries just fail


def test_push_subscriptions_are_added_shown_and_removed(page: Any, console_cluster: Cluster, shoot: Any) -> None:
    subject, group = "console.pushed", "hooked"
    send(console_cluster, subject, 1)
    page.goto(console_cluster.console + "push")
    page.fill("#push-subject", subject)
    page.fill("#push-group", group)
    page.fill("#push-url", "ftp://example.org/x")
    page.click("#push-add")
    expect(page.locator("#flash .error")).to_contain_text("url")
    page.fill("#push-url", _NOWHERE)
    page.click("#push-add")
    expect(page.locator("#flash")).to_contain_text(f"push {subject} / {group} -> {_NOWHERE}: added")
    expect(page.locator("#subscriptions")).to_contain_text(_NOWHERE)
    shoot(page, "console-push")
    page.goto(console_cluster.console + f"subjects/{subject}/groups/{group}")
    expect(page.locator("#push-now")).to_contain_text(_NOWHERE)
    page.goto(console_cluster.console + "push")
    page.click(f"[data-remove='{subject}/{group}']")
    expect(page.locator("#flash")).to_contain_text("removed")
    expect(page.locator("#subscriptions tr", has_text=_NOWHERE)).to_have_count(0)


def test_alarms_are_added_shown_and_removed(page: Any, console_cluster: Cluster, shoot: Any) -> None:
    subject, group = "console.watched", "slow"
    page.goto(console_cluster.console + "alarms")
    page.fill("#alarm-subject", subject)
    page.fill("#alarm-group", group)
    page.fill("#alarm-lag", "1000")
    page.fill("#alarm-for", "30")
    page.fill("#alarm-webhook", _NOWHERE)
    page.click("#alarm-add")
    expect(page.locator("#flash")).to_contain_text(f"alarm {subject} / {group}: over 1,000: added")
    row = page.locator("#alarms tr", has_text=subject)
    expect(row).to_contain_text("1,000")
    expect(row).to_contain_text("30.0 s")
    shoot(page, "console-alarms")
    page.click(f"[data-remove='{subject}/{group}']")
    expect(page.locator("#flash")).to_contain_text("removed")
    expect(page.locator("#alarms tr", has_text=subject)).to_have_count(0)
