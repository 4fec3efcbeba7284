"""HTTP push subscriptions: ``qmq push add``, ``qmq push list``, ``qmq push remove``.

The meta server keeps the subscriptions (``/meta/push``) and a gateway holding a subscription's
lease delivers it (docs/gateway.md, "Push"). ``push add`` first fixes where the consumer group
starts: on every broker group the subject is routed to where the group has never pulled, it
creates the group at the latest message (RESET_OFFSET to "latest"), so every message sent
after the command returns is delivered, however long before a gateway first pulls. With
``--from earliest`` it leaves the group to begin at the oldest message kept.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import aiohttp
import click
from rich.table import Table

from qmq.cli.admin import ask_each, is_never_pulled
from qmq.cli.auth_commands import cli_authorization, cli_credentials, cli_tls
from qmq.cli.client_commands import meta_server_option
from qmq.cli.main import CommandError, cli
from qmq.cli.output import echo_json, json_option, print_table, stdout_console
from qmq.client.connection import Connection
from qmq.client.meta import MetaClient
from qmq.client.options import META_ADDRESS_PATH
from qmq.common.errors import QmqError
from qmq.protocol.codes import RequestCode
from qmq.protocol.push import (
    CONCURRENCY_DEFAULT,
    CONCURRENCY_MAX,
    MAX_RETRIES_DEFAULT,
    MAX_RETRIES_MAX,
    RATE_PER_S_MAX,
    TIMEOUT_MS_DEFAULT,
    TIMEOUT_MS_MAX,
    TIMEOUT_MS_MIN,
    PushFieldError,
    parse_subscription,
)

_TIMEOUT_MS = 10_000


def _base(meta_server: str) -> str:
    return meta_server.removesuffix(META_ADDRESS_PATH)


def _backoff_ms(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        waits = [float(part) for part in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not seconds separated by commas, e.g. 5,30,120") from None
    if any(not 0 <= s <= 7 * 86_400 for s in waits):
        raise click.BadParameter(f"{value!r}: each wait must be from 0 to 604800 seconds (7 days)")
    return [round(s * 1000) for s in waits]


def _headers() -> dict[str, str]:
    """The Authorization header of ``qmq --app-code``/``--secret`` (or the environment), if any."""
    from qmq.cli.auth_commands import cli_authorization

    authorization = cli_authorization()
    return {"Authorization": authorization} if authorization else {}


async def _meta_request(method: str, url: str, body: object = None, params: dict[str, str] | None = None) -> Any:
    """The JSON answer of one meta server request; CommandError with the meta server's words when refused."""
    authorization = cli_authorization()
    headers = {"Authorization": authorization} if authorization is not None else {}
    tls = cli_tls(url)
    try:
        async with (
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=tls) if tls is not None else None,
                timeout=aiohttp.ClientTimeout(total=_TIMEOUT_MS / 1000),
            ) as http,
            http.request(method, url, json=body, params=params, headers=headers) as answer,
        ):
            doc = await answer.json(content_type=None)
            if answer.status >= 400:
                error = doc.get("error") if isinstance(doc, dict) else doc
                raise CommandError(f"the meta server refused: {error}")
            return doc
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        raise CommandError(f"cannot reach the meta server at {url}: {exc or type(exc).__name__}") from None


async def fix_start(meta_server: str, subject: str, group: str) -> list[str]:
    """Create ``group`` at the latest message of ``subject`` on every broker group of its route
    where the group has never pulled; the broker groups where it was created. CommandError when a
    broker group of the route is unavailable (the start could not be fixed there)."""
    meta = MetaClient(meta_server, timeout_ms=_TIMEOUT_MS, authorization=cli_authorization(), ssl=cli_tls(meta_server))
    await meta.start()
    try:
        route = await meta.resolve(subject)
        available = {g.name: g for g in meta.available(route)}
    finally:
        await meta.close()
    if not route:
        raise CommandError(f"subject {subject!r} cannot be routed: no broker group is available; start a broker")
    missing = [name for name in route if name not in available]
    if missing:
        raise CommandError(
            f"broker group(s) {', '.join(missing)} of subject {subject!r} are unavailable, so where group "
            f"{group!r} starts cannot be fixed there; add the subscription when they are back, or with --from earliest"
        )
    credentials, tls = cli_credentials(), cli_tls(meta_server)
    conns = {
        name: Connection(g.address, connect_timeout_ms=_TIMEOUT_MS, credentials=credentials, ssl=tls)
        for name, g in sorted(available.items())
    }
    try:
        header = {"subject": subject, "group": group}
        new = []
        for name, answer in (await ask_each(conns, RequestCode.LAG, header)).items():
            if isinstance(answer, QmqError):
                if not is_never_pulled(answer):
                    raise answer
                new.append(name)
        reset = {**header, "to": "latest"}
        for answer in (await ask_each({n: conns[n] for n in new}, RequestCode.RESET_OFFSET, reset)).values():
            if isinstance(answer, QmqError):
                raise answer
        return new
    finally:
        await asyncio.gather(*(c.close() for c in conns.values()))


@cli.group()
def push() -> None:
    """HTTP push subscriptions: a gateway POSTs each message of a consumer group to a URL."""


@push.command("add")
@click.argument("subject")
@click.option("--group", required=True, help="consumer group the gateway consumes as")
@click.option("--url", required=True, help="http:// or https:// URL each message is POSTed to")
@click.option(
    "--concurrency",
    type=click.IntRange(1, CONCURRENCY_MAX),
    default=CONCURRENCY_DEFAULT,
    show_default=True,
    help="most deliveries in flight at once",
)
@click.option(
    "--rate", type=click.IntRange(0, RATE_PER_S_MAX), default=0, help="most deliveries started per second (0: no bound)"
)
@click.option(
    "--timeout-ms",
    type=click.IntRange(TIMEOUT_MS_MIN, TIMEOUT_MS_MAX),
    default=TIMEOUT_MS_DEFAULT,
    show_default=True,
    help="an answer later than this is a failure",
)
@click.option("--secret", default="", help="key of the X-Qmq-Signature HMAC-SHA256 (none: no signature header)")
@click.option("--tags", multiple=True, help="deliver only messages with these tags (repeat the option)")
@click.option("--tag-type", type=click.Choice(["or", "and"]), default="or", show_default=True, help="any or all tags")
@click.option(
    "--from",
    "start_from",
    type=click.Choice(["latest", "earliest"]),
    default="latest",
    show_default=True,
    help="latest: messages sent after this command returns; earliest: the backlog kept too",
)
@click.option(
    "--max-retries",
    type=click.IntRange(0, MAX_RETRIES_MAX),
    default=MAX_RETRIES_DEFAULT,
    show_default=True,
    help="failed deliveries of a message before it goes to the dead letters",
)
@click.option(
    "--retry-backoff",
    callback=_backoff_ms,
    metavar="S,S,...",
    help="seconds to wait after the 1st, 2nd, ... failure, the last repeating (default 5,10,30,60,...,7200)",
)
@meta_server_option
@json_option("document", "the subscription stored (secret shown as ***)")
def push_add(
    subject: str,
    group: str,
    url: str,
    concurrency: int,
    rate: int,
    timeout_ms: int,
    secret: str,
    tags: tuple[str, ...],
    tag_type: str,
    start_from: str,
    max_retries: int,
    retry_backoff: list[int] | None,
    meta_server: str,
    as_json: bool,
) -> None:
    """Deliver every message of SUBJECT in consumer group GROUP to URL by HTTP POST, from a gateway.
    A 2xx answer acknowledges; anything else is retried with the back-off, then dead-lettered."""
    body: dict[str, Any] = {
        "subject": subject,
        "group": group,
        "url": url,
        "concurrency": concurrency,
        "rate_per_s": rate,
        "timeout_ms": timeout_ms,
        "secret": secret,
        "tags": list(tags),
        "tag_type": tag_type,
        "start_from": start_from,
        "max_retries": max_retries,
    }
    if retry_backoff is not None:
        body["retry_backoff_ms"] = retry_backoff
    try:
        parse_subscription(body)
    except PushFieldError as exc:
        raise click.BadParameter(str(exc), param_hint=f"--{exc.field.replace('_', '-')}") from None
    answer = asyncio.run(_add(meta_server, body))
    if as_json:
        echo_json(answer["subscription"])
        return
    where = "from the oldest message kept" if start_from == "earliest" else "from now on"
    click.echo(f"push {subject} / {group} -> {url}: added; a gateway delivers {where}")


async def _add(meta_server: str, body: dict[str, Any]) -> Any:
    if body["start_from"] == "latest":
        await fix_start(meta_server, body["subject"], body["group"])
    return await _meta_request("POST", _base(meta_server) + "/meta/push", body)


@push.command("list")
@meta_server_option
@json_option(
    "document",
    "{time_ms, subscriptions: [{subject, group, url, concurrency, rate_per_s, timeout_ms, secret, tags, tag_type, "
    "start_from, max_retries, retry_backoff_ms, created_at_ms, owner, owner_url, lease_expires_ms, leased}]}",
)
def push_list(meta_server: str, as_json: bool) -> None:
    """Every push subscription and the gateway delivering it now (none: no gateway holds its lease)."""
    doc = asyncio.run(_meta_request("GET", _base(meta_server) + "/meta/push"))
    if as_json:
        echo_json(doc)
        return
    table = Table("subject", "group", "url", "concurrency", "rate/s", "timeout ms", "from", "gateway", "added (UTC)")
    for s in doc["subscriptions"]:
        table.add_row(
            s["subject"],
            s["group"],
            s["url"],
            str(s["concurrency"]),
            str(s["rate_per_s"] or "-"),
            str(s["timeout_ms"]),
            s["start_from"],
            (s["owner_url"] or s["owner"]) if s["leased"] else "none",
            datetime.fromtimestamp(s["created_at_ms"] / 1000, tz=UTC).isoformat(timespec="seconds"),
        )
    print_table(stdout_console(), table)


@push.command("remove")
@click.argument("subject")
@click.option("--group", required=True, help="consumer group of the subscription")
@meta_server_option
def push_remove(subject: str, group: str, meta_server: str) -> None:
    """Stop pushing SUBJECT for GROUP (its gateway stops within a lease renewal; the group and its
    progress stay on the brokers). Exit status 1 when there is no such subscription."""
    asyncio.run(_meta_request("DELETE", _base(meta_server) + "/meta/push", params={"subject": subject, "group": group}))
    click.echo(f"push {subject} / {group}: removed")
