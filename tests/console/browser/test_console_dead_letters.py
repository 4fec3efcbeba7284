"""The console's dead letters in a real browser: a group's letters with their last error, one
letter's body, resend one, purge the rest."""

from __future__ import annotations

import time
from typing import Any

import pytest
from playwright.sync_api import expect
from tests.console.browser.conftest import Cluster, kill, send

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(120)]


def test_dead_letters_are_listed_shown_resent_and_purged(page: Any, console_cluster: Cluster, shoot: Any) -> None:
    subject, group = "console.dead", "fragile"
    ids = send(console_cluster, subject, 3, body='{"order": 7}')
    assert kill(console_cluster, subject, group, 3, "the payment service said no") == 3
    page.goto(console_cluster.console + "dead-letters")
    page.click(f"a:text('{subject} / {group}')")
    deadline = time.monotonic() + 15  # a nack reaches the broker with the consumer's next ack flush
    while page.locator("#dl-total").inner_text() != "3" and time.monotonic() < deadline:
        page.wait_for_timeout(500)
        page.reload()
    expect(page.locator("#dl-total")).to_have_text("3")
    expect(page.locator("#letters-table")).to_contain_text("the payment service said no")
    shoot(page, "console-dead-letters")

    page.click(f"a:text('{ids[0]}')")
    expect(page.locator("#letter-body")).to_have_text('{"order": 7}')
    expect(page.locator("#last-error")).to_contain_text("the payment service said no")
    shoot(page, "console-dead-letter")
    page.click("#resend-one")
    expect(page.locator("#flash")).to_contain_text("resent 1 dead letter(s)")

    page.go_back()
    page.reload()
    expect(page.locator("#dl-total")).to_have_text("2")
    page.click("#purge-all")  # confirmed by the page fixture
    expect(page.locator("#flash")).to_contain_text("purged 2 dead letter(s)")
    expect(page.locator("#dl-total")).to_have_text("0")
