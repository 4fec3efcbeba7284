"""The console's delay page and message lookup in a real browser: delayed messages pending per
bucket and due within the hour; a message traced from its storing to its acknowledgement."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect
from tests.console.browser.conftest import SECRETS, Cluster, consume, send

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(120)]


def _send_delayed(cluster: Cluster, subject: str, delays_s: list[float]) -> None:
    from qmq.client.message import Message
    from qmq.client.sync import Producer

    with Producer(app_code="shop", secret=SECRETS["shop"], meta_server=cluster.meta_server) as producer:
        for delay_s in delays_s:
            message = Message(subject, body="later")
            message.set_delay(delay_s)
            producer.send(message)


def test_the_delay_page_shows_pending_and_due_within_the_hour(page: Any, console_cluster: Cluster, shoot: Any) -> None:
    _send_delayed(console_cluster, "console.later", [1_200.0, 1_800.0, 2_400.0, 3 * 3_600.0])
    page.goto(console_cluster.console + "delay")
    pending = page.locator("[id^='pending-']").first
    expect(pending).to_have_text("4")
    expect(page.locator("[id^='bucketed-']").first).to_have_text("3")
    assert page.locator(".buckets tr").count() >= 3
    assert page.locator("[data-chart] canvas").count() == 1
    page.fill("#due-subject", "console.later")
    page.click("#due-show")
    expect(page.locator("#due-count")).to_have_text("3")  # the one due in 3 hours is not listed
    shoot(page, "console-delay")


def test_a_message_is_looked_up_by_id(page: Any, console_cluster: Cluster, shoot: Any) -> None:
    subject = "console.traced"
    [message_id] = send(console_cluster, subject, 1, body="where did I go")
    assert consume(console_cluster, subject, "tracker", 1) == 1
    page.goto(console_cluster.console + "messages")
    page.fill("#message-id", message_id)
    page.click("#lookup")
    expect(page).to_have_url(console_cluster.console + f"messages?id={message_id}")
    expect(page.locator("#stored")).to_contain_text(subject)
    trace = page.locator("#trace")
    expect(trace).to_contain_text("pulled")
    expect(trace).to_contain_text("tracker")
    shoot(page, "console-message")
    page.goto(console_cluster.console + "messages?id=no-such-message")
    expect(page.locator("#not-found")).to_be_visible()
