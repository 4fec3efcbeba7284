"""Listings for people and scripts: ``qmq subjects`` and ``qmq lag``, merged across every broker
group of a meta server and read page by page (``qmq.client.pages``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import click
from rich.table import Table

from qmq.cli.client_commands import meta_server_option
from qmq.cli.main import CommandError, cli
from qmq.cli.output import echo_json, json_option, print_table, stdout_console
from qmq.client.failure import is_internal
from qmq.common.errors import QmqError
from qmq.protocol.codes import RequestCode


@cli.command()
@meta_server_option
@click.option(
    "--all",
    "all_",
    is_flag=True,
    help="list the retry and dead-letter subjects (%RETRY%SUBJECT%GROUP, %DEAD_RETRY%SUBJECT%GROUP) too",
)
@json_option("lines", "each subject: {subject, messages, consumer_groups, broker_groups, internal}")
def subjects(meta_server: str, all_: bool, as_json: bool) -> None:
    """List the subjects every broker group holds, with message counts and consumer groups:
    one subject a line (tab-separated), by name, printed as the brokers' pages come.

    The retry and dead-letter subjects qmq makes for each consumer group are left out
    unless --all is given; stderr says how many were left out.
    """
    hidden = asyncio.run(_print_subjects(meta_server, all_, as_json))
    if hidden:
        click.echo(f"({hidden:,} retry and dead-letter subject(s) not listed; --all lists them)", err=True)


async def _print_subjects(meta_server: str, all_: bool, as_json: bool) -> int:
    """Print the subjects; returns how many internal ones were left out."""
    from qmq.cli.admin import broker_connections
    from qmq.client.pages import subjects as subjects_of

    hidden = 0
    async with broker_connections(meta_server) as conns:
        if not as_json:
            click.echo("subject\tmessages\tconsumer groups")
        async for name, items in _by_subject({group: subjects_of(c) for group, c in conns.items()}):
            internal = is_internal(name)
            if internal and not all_:
                hidden += 1
                continue
            groups = sorted({g for item in items.values() for g in item.get("groups", [])})
            messages = sum(int(item.get("messages", 0)) for item in items.values())
            if as_json:
                echo_json(
                    {
                        "subject": name,
                        "messages": messages,
                        "consumer_groups": groups,
                        "broker_groups": {g: int(item.get("messages", 0)) for g, item in items.items()},
                        "internal": internal,
                    }
                )
            else:
                click.echo(f"{name}\t{messages:,}\t{', '.join(groups)}")
    return hidden


async def _by_subject(
    streams: dict[str, AsyncIterator[dict[str, Any]]],
) -> AsyncIterator[tuple[str, dict[str, dict[str, Any]]]]:
    """Merge each broker group's subjects, listed by name, into one listing by name: each name
    with its item from every broker group that holds it."""
    heads: dict[str, dict[str, Any]] = {}
    for group, stream in streams.items():
        item = await anext(stream, None)
        if item is not None:
            heads[group] = item
    while heads:
        name = min(str(h["subject"]) for h in heads.values())
        holding = {group: h for group, h in heads.items() if h["subject"] == name}
        yield name, holding
        for group in holding:
            item = await anext(streams[group], None)
            if item is None:
                del heads[group]
            else:
                heads[group] = item


@cli.command()
@click.argument("subject")
@click.option("--group", required=True, help="consumer group")
@meta_server_option
@json_option(
    "document",
    "{subject, group, broker_groups: {NAME: {messages, pull_offset, backlog, unacked, consumers_total, "
    "consumers_offline, ...}}, consumers: [{consumer_id, broker_group, pulled, ack_offset, unacked, "
    "last_seen_ms, last_seen, offline}]}",
)
def lag(subject: str, group: str, meta_server: str, as_json: bool) -> None:
    """How far GROUP is behind on SUBJECT, per broker group, then each consumer one a line with
    when its broker last saw it (a pull or an ack) and whether it is offline: silent for the
    broker's consumer_offline_ms (3 minutes by default), so what it left unacknowledged goes
    to retry. Exit status 1 when no broker group knows the subject or the group."""
    answers, consumers = asyncio.run(_lag(meta_server, subject, group))
    if as_json:
        echo_json(
            {
                "subject": subject,
                "group": group,
                "broker_groups": {
                    name: {k: v for k, v in h.items() if k not in ("consumers", "next")} for name, h in answers.items()
                },
                "consumers": consumers,
            }
        )
        return
    console = stdout_console()
    table = Table("broker group", "messages", "group pulled up to", "backlog", "unacked", "consumers", "offline")
    for name, h in answers.items():
        table.add_row(
            name,
            f"{h['messages']:,}",
            f"{h['pull_offset']:,}",
            f"{h['backlog']:,}",
            f"{h['unacked']:,}",
            f"{h['consumers_total']:,}",
            f"{h.get('consumers_offline', 0):,}",
        )
    print_table(console, table)
    click.echo("consumer\tbroker group\tpulled\tack offset\tunacked\tlast seen (UTC)\tseen ago\tstate")
    for c in consumers:
        ago_s = max(0, answers[c["broker_group"]]["time_ms"] - c["last_seen_ms"]) / 1000
        click.echo(
            f"{c['consumer_id']}\t{c['broker_group']}\t{c['pulled']:,}\t{c['ack_offset']:,}\t{c['unacked']:,}\t"
            f"{c['last_seen']}\t{ago_s:,.0f} s\t{'offline' if c['offline'] else 'online'}"
        )


async def _lag(meta_server: str, subject: str, group: str) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """``({broker group: its LAG figures}, every consumer of the group)`` of the broker groups
    the group has pulled on; CommandError when it has pulled on none."""
    from qmq.cli.admin import ask_each, broker_connections, is_never_pulled, is_unknown_subject
    from qmq.client.pages import pages

    header = {"subject": subject, "group": group}
    answers: dict[str, dict[str, Any]] = {}
    consumers: list[dict[str, Any]] = []
    async with broker_connections(meta_server) as conns:
        unknown = 0
        for name, answer in (await ask_each(conns, RequestCode.LAG, header)).items():
            if isinstance(answer, QmqError):
                if is_never_pulled(answer):
                    unknown += is_unknown_subject(answer)
                    continue
                raise answer
            answers[name] = answer
        if not answers:
            if unknown == len(conns):
                raise CommandError(
                    f"subject {subject!r} is unknown: no broker group holds a message of it or a consumer group "
                    "pulling it (`qmq subjects` lists the subjects there are)"
                )
            raise CommandError(
                f"consumer group {group!r} has never pulled {subject!r} on any broker group "
                f"(`qmq subjects` lists each subject's consumer groups)"
            )
        for name, first in answers.items():
            consumers.extend(_consumers(name, first))
            if first.get("next") is not None:
                async for doc in pages(conns[name], RequestCode.LAG, {**header, "after": first["next"]}):
                    consumers.extend(_consumers(name, doc))
    return answers, consumers


def _consumers(broker_group: str, page: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            **c,
            "broker_group": broker_group,
            "last_seen": datetime.fromtimestamp(c["last_seen_ms"] / 1000, tz=UTC).isoformat(timespec="seconds"),
        }
        for c in page.get("consumers", [])
    ]
