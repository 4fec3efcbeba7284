"""Backlog alarms: ``qmq alarm add``, ``qmq alarm list``, ``qmq alarm remove``.

The meta server keeps the alarms (``/meta/alarms``, qmq.meta.alarms) and checks them against
what the broker masters report left of each consumer group; it POSTs one signed notification to
the webhook when a breach starts and one when it ends (docs/observability.md, "Backlog alarms").
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import click
from rich.table import Table

from qmq.cli.client_commands import meta_server_option, parse_duration_s
from qmq.cli.main import cli
from qmq.cli.output import echo_json, json_option, print_table, stdout_console
from qmq.cli.push_commands import _base, _meta_request


@cli.group()
def alarm() -> None:
    """Backlog alarms kept by the meta server: a webhook is told when a consumer group falls behind."""


def _for_ms(_ctx: click.Context, _param: click.Parameter, value: str) -> int:
    try:
        seconds = parse_duration_s(value)
    except click.BadParameter as exc:
        raise click.BadParameter(str(exc.message).replace("--delay", "--for")) from None
    if not 0 <= seconds <= 7 * 86_400:
        raise click.BadParameter(f"{value!r} must be from 0 to 7 days")
    return round(seconds * 1000)


@alarm.command("add")
@click.argument("subject")
@click.option("--group", required=True, help="consumer group whose backlog is watched")
@click.option(
    "--lag-over",
    type=click.IntRange(0, 1 << 62),
    required=True,
    help="breached while more than this many messages are left to the group (not pulled, or not acked)",
)
@click.option(
    "--for",
    "for_ms",
    default="60s",
    show_default=True,
    callback=_for_ms,
    help="a breach (and its end) must last this long before it is notified: 90s, 5m, 0",
)
@click.option("--webhook", required=True, help="http(s) URL that each notification is POSTed to")
@click.option(
    "--secret",
    default="",
    help="key of the X-Qmq-Signature HMAC-SHA256 of each notification, as for HTTP push (default: unsigned)",
)
@meta_server_option
@json_option("document", "the alarm stored (secret shown as ***)")
def alarm_add(
    subject: str, group: str, lag_over: int, for_ms: int, webhook: str, secret: str, meta_server: str, as_json: bool
) -> None:
    """Tell WEBHOOK once when GROUP's backlog on SUBJECT goes over --lag-over for --for, and once
    when it is back under for as long."""
    body = {
        "subject": subject,
        "group": group,
        "lag_over": lag_over,
        "for_ms": for_ms,
        "webhook": webhook,
        "secret": secret,
    }
    answer = asyncio.run(_meta_request("POST", _base(meta_server) + "/meta/alarms", body))
    if as_json:
        echo_json(answer["alarm"])
        return
    click.echo(f"alarm {subject} / {group}: over {lag_over:,} for {for_ms / 1000:g} s -> {webhook}: added")


@alarm.command("list")
@meta_server_option
@json_option(
    "document",
    "{time_ms, alarms: [{subject, group, lag_over, for_ms, webhook, secret, created_at_ms, state, state_since_ms, "
    "lag, checked_ms}]}",
)
def alarm_list(meta_server: str, as_json: bool) -> None:
    """Every alarm, its state (ok, pending, firing, clearing) and the lag last seen."""
    doc: dict[str, Any] = asyncio.run(_meta_request("GET", _base(meta_server) + "/meta/alarms"))
    if as_json:
        echo_json(doc)
        return
    table = Table("subject", "group", "lag over", "for", "state", "since (UTC)", "lag", "webhook")
    for a in doc["alarms"]:
        table.add_row(
            a["subject"],
            a["group"],
            f"{a['lag_over']:,}",
            f"{a['for_ms'] / 1000:g} s",
            a["state"],
            datetime.fromtimestamp(a["state_since_ms"] / 1000, tz=UTC).isoformat(timespec="seconds"),
            "?" if a["lag"] is None else f"{a['lag']:,}",
            a["webhook"],
        )
    print_table(stdout_console(), table)


@alarm.command("remove")
@click.argument("subject")
@click.option("--group", required=True, help="consumer group of the alarm")
@meta_server_option
def alarm_remove(subject: str, group: str, meta_server: str) -> None:
    """Remove the alarm of SUBJECT and GROUP (a breach in progress is not notified as ended)."""
    asyncio.run(
        _meta_request("DELETE", _base(meta_server) + "/meta/alarms", params={"subject": subject, "group": group})
    )
    click.echo(f"alarm {subject} / {group}: removed")
