"""The console's subjects page in a real browser: subjects with their groups and rates, charts
of the rates over time from the meta server's samples, and subject records created and deleted."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from playwright.sync_api import expect
from tests.console.browser.conftest import Cluster, consume, send

pytestmark = [pytest.mark.integration, pytest.mark.browser, pytest.mark.timeout(150)]

_CHART_WAIT_S = 90.0  # samples come every 5 s; a busy machine may be slow


def test_the_subjects_page_charts_rates_and_keeps_records(page: Any, console_cluster: Cluster, shoot: Any) -> None:
    subject = "console.rates"
    page.goto(console_cluster.console + "subjects")  # the console is in use: sampling starts
    deadline = time.monotonic() + _CHART_WAIT_S
    points = 0
    while time.monotonic() < deadline:
        send(console_cluster, subject, 20)
        consume(console_cluster, subject, "rates-reader", 10)
        page.goto(console_cluster.console + "subjects")
        chart = page.locator("[data-chart]").first
        points = int(chart.get_attribute("data-points") or 0)
        row = page.locator("#subjects tr", has_text=subject)
        cells = row.locator("td.num").all_inner_texts() if row.count() else []
        if points >= 3 and cells and cells[1] not in ("–", "0.0") and "rates-reader" in row.inner_text():
            break  # sampled a few times, this subject's rate in among the samples
        page.wait_for_timeout(2_000)
    assert points >= 3, f"the rate chart had {points} sample(s) after {_CHART_WAIT_S} s"
    assert page.locator("[data-chart] canvas").count() == 2  # uPlot drew both charts
    assert int(cells[0].replace(",", "")) >= 20  # messages held
    assert float(cells[1].replace(",", "")) > 0  # a rate in was measured
    shoot(page, "console-subjects")

    page.fill("#new-subject", "console.record")
    page.fill("#new-owner", "payments")
    page.fill("#new-description", "an order was placed")
    page.click("#create-subject")
    expect(page.locator("#flash")).to_contain_text("created: console.record")
    expect(page.locator("#subjects tr", has_text="console.record")).to_contain_text("payments")
    page.click("[data-delete='console.record']")
    expect(page.locator("#flash")).to_contain_text("deleted: console.record")
    expect(page.locator("#subjects tr", has_text="console.record")).to_have_count(0)

    page.fill("#new-subject", subject)  # a record of the subject with a backlog: not deleted unless forced
    page.fill("#new-owner", "metrics")
    page.click("#create-subject")
    expect(page.locator("#flash")).to_contain_text(f"created: {subject}")
    page.click(f"[data-delete='{subject}']")
    expect(page.locator("#flash .error")).to_contain_text("rates-reader")
    page.click(f"[data-force-delete='{subject}']")
    expect(page.locator("#flash")).to_contain_text(f"deleted: {subject} (forced)")

    # an app's produce limit, set and removed as `qmq limits set|remove` do; a bad rate is refused
    page.fill("#produce-app", "shop")
    page.fill("#produce-pattern", "console.*")
    page.fill("#produce-msgs", "0")
    page.fill("#produce-bytes", "0")
    page.click("#produce-limit-set")
    expect(page.locator("#flash .error")).to_contain_text("give a produce rate")
    page.fill("#produce-msgs", "40")
    page.fill("#produce-bytes", "65536")
    page.click("#produce-limit-set")
    expect(page.locator("#flash")).to_contain_text("limit set: app shop produces to console.* at most 40 msgs/s")
    row = page.locator("#produce-limit-rows tr", has_text="console.*")
    expect(row).to_contain_text("shop")
    expect(row).to_contain_text("65536")
    page.click("[data-unlimit='shop:console.*']")
    expect(page.locator("#flash")).to_contain_text("limit removed: app shop, console.*")
    expect(page.locator("#produce-limit-rows tr", has_text="console.*")).to_have_count(0)

    page.click("#subjects a:text('rates-reader')")
    expect(page).to_have_url(console_cluster.console + f"subjects/{subject}/groups/rates-reader")
    lag = page.locator("[data-chart]")
    # the group's backlog, sampled with the rates; the attribute appears once the page's script drew
    expect(lag).to_have_attribute("data-points", re.compile(r"^([2-9]|[1-9][0-9]+)$"))
    assert lag.locator("canvas").count() == 1
    shoot(page, "console-group")
