"""``qmq delay-stats``: what every delay group holds, per time bucket, and how fast it is handing over."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import click
from rich.table import Table

from qmq.cli.admin import ask_each
from qmq.cli.client_commands import meta_server_option
from qmq.cli.main import CommandError, cli
from qmq.cli.output import echo_json, json_option, print_table, stdout_console
from qmq.common.errors import NoBrokerError, QmqError
from qmq.protocol.codes import RequestCode

_TIMEOUT_MS = 10_000
# the delay server's STATS_BUCKETS_MAX (qmq.delay.handlers), which the CLI does not import: it
# would load the delay server's store for one number
_BUCKETS_MAX = 20_000


async def ask_every_delay_group(meta_server: str, header: dict[str, Any]) -> dict[str, dict[str, Any] | QmqError]:
    """``{delay group: DELAY_STATS answer or the error it answered}``."""
    from qmq.cli.auth_commands import cli_authorization, cli_credentials
    from qmq.client.connection import Connection
    from qmq.client.meta import DELAY_TARGET_PREFIX, MetaClient

    meta = MetaClient(meta_server, timeout_ms=_TIMEOUT_MS, authorization=cli_authorization())
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
    credentials = cli_credentials()
    conns = {
        name: Connection(address, connect_timeout_ms=_TIMEOUT_MS, credentials=credentials)
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
