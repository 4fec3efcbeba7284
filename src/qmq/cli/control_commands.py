"""``qmq group pause|resume|paused|filter|transform|consumers``: control-plane records of
consumer groups, kept by the meta server (``/meta/controls``, qmq.meta.controls) and applied by
every broker (filters, pauses) or gateway (transforms) within a second.

Registered on the ``qmq`` group when imported (``qmq.cli.main.main`` imports it).
"""

from __future__ import annotations

import asyncio
import re
import urllib.parse
from datetime import UTC, datetime
from typing import Any

import click

from qmq.cli.client_commands import meta_server_option
from qmq.cli.limits_commands import _request as meta_request
from qmq.cli.listing_commands import _lag
from qmq.cli.main import CommandError, cli
from qmq.cli.output import echo_json, json_option
from qmq.common.config import meta_base_url


@cli.group("group")
def group_cli() -> None:
    """Consumer groups on every broker: list them with their consumers, pause, resume, filter and transform them."""


def _set(subject: str, group: str, meta_server: str, action: str, **extra: object) -> dict[str, object]:
    body = {"subject": subject, "group": group, **extra}
    answer: dict[str, object] = meta_request("POST", f"{meta_base_url(meta_server)}/meta/controls/{action}", body)
    return answer


@group_cli.command("pause")
@click.argument("subject")
@click.option("--group", "group", required=True, help="consumer group")
@meta_server_option
def group_pause(subject: str, group: str, meta_server: str) -> None:
    """Stop delivering SUBJECT to GROUP's consumers; messages and progress are kept."""
    answer = _set(subject, group, meta_server, "pause")
    was = " (it was paused already)" if answer.get("was") else ""
    click.echo(f"paused: {subject} for group {group}{was}; brokers hold it back within a second")


@group_cli.command("resume")
@click.argument("subject")
@click.option("--group", "group", required=True, help="consumer group")
@meta_server_option
def group_resume(subject: str, group: str, meta_server: str) -> None:
    """Deliver SUBJECT to GROUP's consumers again, from where they stopped."""
    answer = _set(subject, group, meta_server, "resume")
    was = "" if answer.get("was") else " (it was not paused)"
    click.echo(f"resumed: {subject} for group {group}{was}; brokers deliver again within a second")


@group_cli.command("filter")
@click.argument("subject")
@click.option("--group", "group", required=True, help="consumer group")
@click.option("--expr", default=None, help='JMESPath over {properties, tags, body}, e.g. "body.amount > `100`"')
@click.option("--clear", is_flag=True, help="remove the group's filter: it gets every message again")
@meta_server_option
def group_filter(subject: str, group: str, expr: str | None, clear: bool, meta_server: str) -> None:
    """Deliver to GROUP only the messages of SUBJECT the expression matches; the others count as
    consumed for GROUP on the brokers and never reach its consumers."""
    answer = _set_expr("filter", subject, group, expr, clear, meta_server)
    if clear:
        was = "" if answer.get("was") else " (it had none)"
        click.echo(f"filter cleared: {subject} for group {group}{was}; brokers deliver every message within a second")
    else:
        click.echo(f"filter set: {subject} for group {group}: {expr}; brokers apply it within a second")


@group_cli.command("transform")
@click.argument("subject")
@click.option("--group", "group", required=True, help="consumer group")
@click.option("--expr", default=None, help='JMESPath over {properties, tags, body}, e.g. "{id: body.id}"')
@click.option("--clear", is_flag=True, help="remove the group's transform: its HTTP consumers get the stored body")
@meta_server_option
def group_transform(subject: str, group: str, expr: str | None, clear: bool, meta_server: str) -> None:
    """Give GROUP's HTTP consumers (gateway pulls, push) the expression's result as the body of
    each message of SUBJECT; a message it cannot be evaluated over goes to GROUP's dead letters."""
    answer = _set_expr("transform", subject, group, expr, clear, meta_server)
    if clear:
        was = "" if answer.get("was") else " (it had none)"
        click.echo(
            f"transform cleared: {subject} for group {group}{was}; gateways deliver stored bodies within a second"
        )
    else:
        click.echo(f"transform set: {subject} for group {group}: {expr}; gateways apply it within a second")


@group_cli.command("paused")
@meta_server_option
@json_option("lines", "each paused group")
def group_paused(meta_server: str, as_json: bool) -> None:
    """Every paused group."""
    rows = meta_request("GET", f"{meta_base_url(meta_server)}/meta/controls").get("paused", [])
    for subject, group in rows:
        if as_json:
            echo_json({"subject": subject, "group": group})
        else:
            click.echo(f"{subject}\t{group}")


@group_cli.command("consumers")
@click.argument("subject")
@click.option("--group", "group", required=True, help="consumer group")
@meta_server_option
@json_option("document", "{subject, group, paused, backlog, unacked, consumers_total, truncated, consumers: [...]}")
def group_consumers(subject: str, group: str, meta_server: str, as_json: bool) -> None:
    """GROUP's consumers of SUBJECT, as the brokers know them now (through the meta server): id,
    host, broker group, since, last seen, unacknowledged messages."""
    query = urllib.parse.urlencode({"subject": subject, "group": group})
    doc = meta_request("GET", f"{meta_base_url(meta_server)}/meta/groups/consumers?{query}")
    if as_json:
        echo_json(doc)
        return
    state = "paused" if doc["paused"] else "running"
    click.echo(f"{subject} / {group}: {state}, backlog {doc['backlog']:,}, unacked {doc['unacked']:,}")
    click.echo("consumer	host	broker group	since (UTC)	last seen (UTC)	unacked	state")
    for c in doc["consumers"]:
        click.echo(
            f"{c['consumer_id']}	{c['host'] or '-'}	{c['broker_group']}	{_utc(c['since_ms'])}	"
            f"{_utc(c['last_seen_ms'])}	{c['unacked']:,}	{'offline' if c['offline'] else 'online'}"
        )
    if doc["truncated"]:
        click.echo(f"... {doc['consumers_total'] - len(doc['consumers']):,} more not listed")
    for name in doc.get("unreachable", []):
        click.echo(f"broker group {name} could not be asked", err=True)


def _utc(ms: int | None) -> str:
    if not ms:
        return "-"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="seconds")


# the SDK's consumer ids: <hostname>-<pid>-<6 hex> (qmq.client.options.default_consumer_id)
_SDK_ID = re.compile(r"^(?P<host>.+)-(?P<pid>[0-9]+)-[0-9a-f]{6}$")


def host_of(consumer_id: str) -> str | None:
    """The host an SDK-made consumer id names, or None for an id set by hand."""
    m = _SDK_ID.match(consumer_id)
    return m.group("host") if m else None


@group_cli.command("list")
@click.argument("subject")
@meta_server_option
@json_option("lines", "each group: {subject, group, paused, backlog, unacked, consumers: [{id, host, ...}]}")
def group_list(subject: str, meta_server: str, as_json: bool) -> None:
    """SUBJECT's consumer groups, paused or not, with their consumers (id, host, since, last seen, unacked)."""
    from qmq.cli.subject_commands import held_by_brokers

    held = asyncio.run(held_by_brokers(meta_server)).get(subject, {"consumer_groups": []})
    paused = {(s, g) for s, g in meta_request("GET", f"{meta_base_url(meta_server)}/meta/controls")["paused"]}
    for group in sorted({*held["consumer_groups"], *(g for s, g in paused if s == subject)}):
        doc = asyncio.run(_group_doc(meta_server, subject, group, (subject, group) in paused))
        if as_json:
            echo_json(doc)
            continue
        state = "paused" if doc["paused"] else "running"
        click.echo(f"{group}\t{state}\tbacklog {doc['backlog']:,}\tunacked {doc['unacked']:,}")
        for c in doc["consumers"]:
            offline = " (offline)" if c["offline"] else ""
            click.echo(
                f"  {c['consumer_id']}\thost {c['host'] or '-'}\tsince {c['since']}\tlast seen {c['last_seen']}\t"
                f"unacked {c['unacked']:,}{offline}"
            )


async def _group_doc(meta_server: str, subject: str, group: str, paused: bool) -> dict[str, Any]:
    try:
        answers, consumers = await _lag(meta_server, subject, group)
    except CommandError:  # paused before it ever pulled: no broker knows it yet
        answers, consumers = {}, []
    return {
        "subject": subject,
        "group": group,
        "paused": paused,
        "backlog": sum(int(a.get("backlog", 0)) for a in answers.values()),
        "unacked": sum(int(a.get("unacked", 0)) for a in answers.values()),
        "consumers": [
            {
                "consumer_id": c["consumer_id"],
                "host": host_of(c["consumer_id"]),
                "broker_group": c["broker_group"],
                "since": _utc(c.get("since_ms")),
                "last_seen": c["last_seen"],
                "unacked": c["unacked"],
                "offline": c["offline"],
            }
            for c in consumers
        ],
    }


def _set_expr(
    kind: str, subject: str, group: str, expr: str | None, clear: bool, meta_server: str
) -> dict[str, object]:
    """Set (or with ``clear`` remove) GROUP's ``kind`` expression ("filter" or "transform")."""
    if clear == (expr is not None):
        raise CommandError("give either --expr 'EXPRESSION' or --clear")
    return _set(subject, group, meta_server, kind, expr=expr)
