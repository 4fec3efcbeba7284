"""Commands on a consumer group's progress and dead letters: ``qmq reset-offset``,
``qmq dead-letters``, ``qmq resend-dead``, ``qmq purge-dead``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import aclosing
from datetime import UTC, datetime
from typing import Any

import click

from qmq.cli.admin import ask_every_broker, broker_connections
from qmq.cli.client_commands import meta_server_option
from qmq.cli.main import cli
from qmq.cli.output import echo_json, json_option
from qmq.common.errors import QmqError
from qmq.protocol.codes import RequestCode


def _answers(meta_server: str, code: int, header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    answers = asyncio.run(ask_every_broker(meta_server, code, header))
    for answer in answers.values():
        if isinstance(answer, QmqError):
            raise answer
    return answers  # type: ignore[return-value]


def _point(text: str) -> str | int:
    if text in ("earliest", "latest"):
        return text
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not earliest, latest or an ISO 8601 time such as 2026-11-21T18:00:00+08:00", param_hint="--to"
        ) from None
    if when.tzinfo is None:
        raise click.BadParameter(f"{text!r} has no UTC offset; add one, e.g. {text}+00:00", param_hint="--to")
    ms = int(when.timestamp() * 1000)
    if ms < 0:
        raise click.BadParameter(
            f"{text!r} is before 1970-01-01T00:00:00Z, and nothing is stored before then; "
            "give a time from 1970 on, or earliest",
            param_hint="--to",
        )
    return ms


@cli.command("reset-offset")
@click.argument("subject")
@click.option("--group", required=True, help="consumer group")
@click.option(
    "--to",
    "to",
    required=True,
    metavar="earliest|latest|TIME",
    help="where the group pulls next (TIME: ISO 8601 with offset)",
)
@meta_server_option
def reset_offset(subject: str, group: str, to: str, meta_server: str) -> None:
    """Move GROUP's progress on SUBJECT (replay or skip); its consumers pick it up without restarting."""
    answers = _answers(meta_server, RequestCode.RESET_OFFSET, {"subject": subject, "group": group, "to": _point(to)})
    for name, h in sorted(answers.items()):
        click.echo(f"{name}: {subject} / {group}: pull offset {h['before']:,} -> {h['pull_offset']:,}")


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="seconds")


@cli.command("dead-letters")
@click.argument("subject")
@click.option("--group", required=True, help="consumer group")
@click.option(
    "--limit", type=click.IntRange(1, 1000), default=100, show_default=True, help="most letters per broker group"
)
@meta_server_option
@json_option(
    "document",
    "{subject, group, total, letters: [{broker_group, message_id, attempts, dead_at_ms, dead_at, error, bytes}]}",
)
def dead_letters(subject: str, group: str, limit: int, meta_server: str, as_json: bool) -> None:
    """List GROUP's dead letters of SUBJECT, oldest first, one a line (tab-separated): broker
    group, id (whole: paste it into `qmq resend-dead --message-id`), attempts, time, last error;
    then how many the broker groups hold."""
    if as_json:
        letters: list[dict[str, Any]] = []
        total = asyncio.run(_dead_letters(meta_server, subject, group, limit, letters.append))
        echo_json({"subject": subject, "group": group, "total": total, "letters": letters})
        return
    click.echo("broker group\tmessage id\tattempts\tdead since (UTC)\tlast error")
    total = asyncio.run(_dead_letters(meta_server, subject, group, limit, _echo_letter))
    click.echo(f"{total} dead letter(s) of {subject} / {group}")


def _echo_letter(letter: dict[str, Any]) -> None:
    error = " ".join(str(letter["error"]).split())
    click.echo(f"{letter['broker_group']}\t{letter['message_id']}\t{letter['attempts']}\t{letter['dead_at']}\t{error}")


async def _dead_letters(
    meta_server: str, subject: str, group: str, limit: int, each: Callable[[dict[str, Any]], None]
) -> int:
    """Hand up to ``limit`` letters of each broker group to ``each`` as they come; returns how
    many the groups hold."""
    from qmq.client.pages import pages

    total = 0
    async with broker_connections(meta_server) as conns:
        for name, conn in conns.items():
            shown = held = 0
            header = {"subject": subject, "group": group, "limit": limit}
            async with aclosing(pages(conn, RequestCode.DEAD_LETTERS, header)) as listing:
                async for page in listing:
                    held = int(page["total"])
                    for letter in page["letters"][: limit - shown]:
                        each({**letter, "broker_group": name, "dead_at": _when(letter["dead_at_ms"])})
                    shown += len(page["letters"])
                    if shown >= limit:
                        break
            total += held
    return total


def _selection(message_id: str | None, all_: bool) -> dict[str, Any]:
    if bool(message_id) == all_:
        raise click.UsageError("give exactly one of --message-id ID or --all")
    return {"message_id": message_id} if message_id else {"all": True}


@cli.command("resend-dead")
@click.argument("subject")
@click.option("--group", required=True, help="consumer group")
@click.option("--message-id", help="resend this dead letter")
@click.option("--all", "all_", is_flag=True, help="resend every dead letter of the group")
@meta_server_option
def resend_dead(subject: str, group: str, message_id: str | None, all_: bool, meta_server: str) -> None:
    """Put dead letters back on SUBJECT for GROUP only, their attempts reset."""
    header = {"subject": subject, "group": group, **_selection(message_id, all_)}
    answers = _answers(meta_server, RequestCode.RESEND_DEAD, header)
    click.echo(f"resent {sum(h['resent'] for h in answers.values())} dead letter(s)")


@cli.command("purge-dead")
@click.argument("subject")
@click.option("--group", required=True, help="consumer group")
@click.option("--message-id", help="purge this dead letter")
@click.option("--all", "all_", is_flag=True, help="purge every dead letter of the group")
@meta_server_option
def purge_dead(subject: str, group: str, message_id: str | None, all_: bool, meta_server: str) -> None:
    """Drop dead letters for good."""
    header = {"subject": subject, "group": group, **_selection(message_id, all_)}
    answers = _answers(meta_server, RequestCode.PURGE_DEAD, header)
    click.echo(f"purged {sum(h['purged'] for h in answers.values())} dead letter(s)")
