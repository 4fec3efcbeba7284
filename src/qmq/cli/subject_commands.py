"""``qmq subject create|list|delete``: subject records with a description and an owner, kept by
the meta server (``/meta/subjects``, qmq.meta.subjects), listed with what the brokers hold.

Registered on the ``qmq`` group when imported (``qmq.cli.main.main`` imports it).
"""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any

import click

from qmq.cli.client_commands import meta_server_option
from qmq.cli.limits_commands import _request as meta_request
from qmq.cli.listing_commands import _by_subject
from qmq.cli.main import cli
from qmq.cli.output import echo_json, json_option
from qmq.client.failure import is_internal
from qmq.common.config import meta_base_url


@cli.group("subject")
def subject_cli() -> None:
    """Subjects with a description and an owner: create, list, delete an empty one."""


@subject_cli.command("create")
@click.argument("subject")
@click.option("--owner", required=True, help="the team or person who answers for SUBJECT")
@click.option("--description", default="", help="what SUBJECT carries")
@meta_server_option
def subject_create(subject: str, owner: str, description: str, meta_server: str) -> None:
    """Record SUBJECT with its owner and description (sending to it needs no record)."""
    body = {"subject": subject, "owner": owner, "description": description}
    meta_request("POST", f"{meta_base_url(meta_server)}/meta/subjects", body)
    click.echo(f"created: {subject} (owner {owner})")


async def held_by_brokers(meta_server: str) -> dict[str, dict[str, Any]]:
    """``{subject: {messages, consumer_groups}}`` of what the brokers hold, user subjects only."""
    from qmq.cli.admin import broker_connections
    from qmq.client.pages import subjects as subjects_of

    out: dict[str, dict[str, Any]] = {}
    async with broker_connections(meta_server) as conns:
        async for name, items in _by_subject({group: subjects_of(c) for group, c in conns.items()}):
            if is_internal(name):
                continue
            out[name] = {
                "messages": sum(int(item.get("messages", 0)) for item in items.values()),
                "consumer_groups": sorted({g for item in items.values() for g in item.get("groups", [])}),
            }
    return out


@subject_cli.command("list")
@meta_server_option
@json_option("lines", "each subject: {subject, owner, description, created_ms, messages, consumer_groups}")
def subject_list(meta_server: str, as_json: bool) -> None:
    """Every created subject and every subject the brokers hold, with owner, messages and groups."""
    records = {r["subject"]: r for r in meta_request("GET", f"{meta_base_url(meta_server)}/meta/subjects")["subjects"]}
    held = asyncio.run(held_by_brokers(meta_server))
    if not as_json:
        click.echo("subject\towner\tmessages\tconsumer groups\tdescription")
    for name in sorted(set(records) | set(held)):
        record = records.get(name, {})
        doc = {
            "subject": name,
            "owner": record.get("owner"),
            "description": record.get("description"),
            "created_ms": record.get("created_ms"),
            **held.get(name, {"messages": 0, "consumer_groups": []}),
        }
        if as_json:
            echo_json(doc)
        else:
            groups = ", ".join(doc["consumer_groups"])
            click.echo(f"{name}\t{doc['owner'] or '-'}\t{doc['messages']:,}\t{groups}\t{doc['description'] or ''}")


@subject_cli.command("delete")
@click.argument("subject")
@click.option("--force", is_flag=True, help="delete the record although messages of SUBJECT remain")
@meta_server_option
def subject_delete(subject: str, force: bool, meta_server: str) -> None:
    """Delete the record of SUBJECT; the meta server refuses while a consumer group has not consumed
    all of it, messages of it wait with no group, or delay messages of it are pending (unless --force)."""
    query = urllib.parse.urlencode({"subject": subject, "force": "true" if force else "false"})
    meta_request("DELETE", f"{meta_base_url(meta_server)}/meta/subjects?{query}")
    click.echo(f"deleted: {subject}{' (forced)' if force else ''}")
