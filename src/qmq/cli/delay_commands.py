"""``qmq delay-stats``: what every delay group holds, per time bucket, and how fast it is handing
over; ``qmq cancel-delay``: cancel a pending delay message; ``qmq delay-list``: the pending delay
messages of a subject, by due time."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import click
from rich.table import Table

from qmq.cli.admin import ask_each
from qmq.cli.client_commands import meta_server_option, parse_duration_s
from qmq.cli.main import CommandError, cli
from qmq.cli.output import echo_json, json_option, print_table, stdout_console
from qmq.common.errors import NoBrokerError, QmqError
from qmq.protocol.codes import RequestCode

_TIMEOUT_MS = 10_000
# the delay server's STATS_BUCKETS_MAX (qmq.delay.handlers), which the CLI does not import: it
# would load the delay server's store for one number
_BUCKETS_MAX = 20_000
# messages `qmq delay-list` prints at most (read page by page: memory holds a page per group)
_LIST_LIMIT_MAX = 1_000_000


async def ask_every_delay_group(meta_server: str, header: dict[str, Any]) -> dict[str, dict[str, Any] | QmqError]:
    """``{delay group: DELAY_STATS answer or the error it answered}``."""
    from qmq.cli.auth_commands import cli_authorization, cli_credentials, cli_tls
    from qmq.client.connection import Connection
    from qmq.client.meta import DELAY_TARGET_PREFIX, MetaClient

    meta = MetaClient(meta_server, timeout_ms=_TIMEOUT_MS, authorization=cli_authorization(), ssl=cli_tls(meta_server))
    await meta.start()
    try:
        groups = {name[len(DELAY_TARGET_PREFIX) :]: g.address for name, g in meta.delay_groups.items()}
    finally:
        await meta.close()
    if not groups:
        raise NoBrokerError(
            f"the meta server {meta_server} knows no available delay group; "
            "is a delay server running (`qmq delay`, or `qmq standalone`)?"
        )
    credentials, tls = cli_credentials(), cli_tls(meta_server)
    conns = {
        name: Connection(address, connect_timeout_ms=_TIMEOUT_MS, credentials=credentials, ssl=tls)
        for name, address in groups.items()
    }
    try:
        return await ask_each(conns, RequestCode.DELAY_STATS, header)
    finally:
        await asyncio.gather(*(c.close() for c in conns.values()))


def _time(ms: object) -> str:
    if not isinstance(ms, int) or ms <= 0:
        return "–"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@cli.command("delay-stats")
@meta_server_option
@click.option(
    "--buckets", type=click.IntRange(0, _BUCKETS_MAX), default=24, show_default=True, help="time buckets to list"
)
@json_option("document", "{groups: {DELAY GROUP: its answer}, errors: {DELAY GROUP: why it did not answer}}")
def delay_stats(meta_server: str, buckets: int, as_json: bool) -> None:
    """What every delay group holds: pending messages per time bucket (soonest first), the next
    due time, and how many messages it handed to brokers in the last minute."""
    answers = asyncio.run(ask_every_delay_group(meta_server, {"buckets_max": buckets}))
    failed = {name: str(a) for name, a in answers.items() if isinstance(a, QmqError)}
    ok = {name: a for name, a in answers.items() if not isinstance(a, QmqError)}
    if as_json:
        echo_json({"groups": ok, "errors": failed})
        if failed and not ok:
            raise CommandError("no delay group answered")
        return
    console = stdout_console()
    for name, h in sorted(ok.items()):
        table = Table("bucket start (UTC)", "messages", "dispatched", "pending", "next due (UTC)", "loaded")
        for b in h["buckets"]:
            table.add_row(
                _time(b["start_ms"]),
                f"{b['messages']:,}",
                f"{b['dispatched']:,}",
                f"{b['pending']:,}",
                _time(b["next_due_ms"]),
                "yes" if b["loaded"] else "",
            )
        more = h["buckets_total"] - len(h["buckets"])
        table.caption = (
            f"{more:,} more bucket(s) not listed; " if more > 0 else ""
        ) + f"bucket length {h['bucket_ms'] // 60_000 or h['bucket_ms']} {'min' if h['bucket_ms'] >= 60_000 else 'ms'}"
        console.print(
            f"[bold]delay group {name}[/bold]: {h['pending']:,} pending, next due {_time(h['next_due_ms'])}, "
            f"{h['dispatched_last_minute']:,} dispatched in the last minute, {h['handover_in_flight']:,} in flight",
            soft_wrap=True,
        )
        print_table(console, table)
    for name, text in sorted(failed.items()):
        click.echo(f"delay group {name}: error: {text}", err=True)
    if failed and not ok:
        raise CommandError("no delay group answered")


@cli.command("cancel-delay")
@click.argument("message_id")
@meta_server_option
@json_option("document", "{message_id, cancelled}")
def cancel_delay(message_id: str, meta_server: str, as_json: bool) -> None:
    """Cancel the pending delay message MESSAGE_ID (every copy still pending of a repeating one).

    Says "cancelled" when it was pending and will now never be delivered, "not pending" when it
    was already handed to a broker or no delay group knows it; both exit 0. Every delay group
    is asked; exit status 1 when one that did not answer may hold it.
    """
    from qmq.aio import Producer
    from qmq.cli.auth_commands import cli_app_code

    async def run() -> bool:
        # the app and secret of `qmq --app-code/--secret` ($QMQ_APP_CODE, $QMQ_SECRET)
        async with Producer(
            app_code=cli_app_code("qmq-cli"), meta_server=meta_server, send_timeout_ms=_TIMEOUT_MS
        ) as producer:
            return await producer.cancel_delay(message_id)

    cancelled = asyncio.run(run())
    if as_json:
        echo_json({"message_id": message_id, "cancelled": cancelled})
    elif cancelled:
        click.echo(f"cancelled {message_id}: it will never be delivered")
    else:
        click.echo(f"not pending: {message_id} was already handed to a broker, or no delay group knows it")


def _moment(text: str | None, option: str) -> datetime | None:
    """``--from``/``--to``: an ISO 8601 time with its offset, ``now``, or a duration from now (``90s``, ``2h``)."""
    if text is None:
        return None
    if text.strip() == "now":
        return datetime.now(UTC)
    try:
        when: datetime | None = datetime.fromisoformat(text.strip())
    except ValueError:
        try:
            return datetime.now(UTC) + timedelta(seconds=parse_duration_s(text))
        except click.BadParameter:
            when = None
    if when is None or when.tzinfo is None:
        raise click.BadParameter(
            f"{text!r} is not a time: use ISO 8601 with an offset (2026-12-24T18:00:00+08:00), now, "
            "or a duration from now (90s, 5m, 2h, 1d)",
            param_hint=option,
        )
    return when


@cli.command("delay-list")
@click.argument("subject")
@meta_server_option
@click.option(
    "--from", "from_text", metavar="TIME", help="due at or after: ISO 8601 with offset, now, or 2h (from now)"
)
@click.option("--to", "to_text", metavar="TIME", help="due before: ISO 8601 with offset, now, or 2h (from now)")
@click.option("--limit", type=click.IntRange(1, _LIST_LIMIT_MAX), default=100, show_default=True, help="most messages")
@json_option(
    "lines", "each message: {message_id, subject, due_at, due_ms, copy, times, created_at, tags, bytes, group}"
)
def delay_list(
    subject: str, meta_server: str, from_text: str | None, to_text: str | None, limit: int, as_json: bool
) -> None:
    """The delay messages of SUBJECT not yet handed to a broker, soonest first: every delay
    group is read page by page, so a backlog of any size is listed in bounded memory."""
    from qmq.aio import Producer
    from qmq.cli.auth_commands import cli_app_code

    start, end = _moment(from_text, "--from"), _moment(to_text, "--to")

    async def run() -> None:
        # the app and secret of `qmq --app-code/--secret` ($QMQ_APP_CODE, $QMQ_SECRET)
        async with Producer(
            app_code=cli_app_code("qmq-cli"), meta_server=meta_server, send_timeout_ms=_TIMEOUT_MS
        ) as producer:
            listed = 0
            pending = producer.delay_pending(subject, start, end)
            try:
                async for p in pending:
                    if as_json:
                        echo_json(
                            {
                                "message_id": p.message_id,
                                "subject": p.subject,
                                "due_at": _time(p.due_ms),
                                "due_ms": p.due_ms,
                                "copy": p.copy,
                                "times": p.times,
                                "created_at": _time(p.created_ms),
                                "tags": list(p.tags),
                                "bytes": p.size_bytes,
                                "group": p.group,
                            }
                        )
                    else:  # printed as they come: a long listing is never held whole
                        if not listed:
                            click.echo("due (UTC)\tmessage id\tcopy\ttags\tdelay group")
                        click.echo(f"{_time(p.due_ms)}\t{p.message_id}\t{p.copy or ''}\t{','.join(p.tags)}\t{p.group}")
                    listed += 1
                    if listed >= limit:
                        break
            finally:
                await pending.aclose()

    asyncio.run(run())
