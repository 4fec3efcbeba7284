"""Commands for people: ``qmq send`` (``--delay``/``--at`` for delay messages) and ``qmq consume``,
and the ``--meta-server`` option every command that talks to a cluster takes."""

from __future__ import annotations

import asyncio
import base64
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from qmq.cli.main import cli
from qmq.cli.output import echo_json, json_option
from qmq.client.options import check_start_from, check_url
from qmq.common.errors import ConfigError, InvalidMessageError, QmqError
from qmq.protocol.codes import RequestCode

if TYPE_CHECKING:
    from qmq.client.sync import ReceivedMessage


def meta_server_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A ``--meta-server`` value as the SDK takes it (a base URL gets its ``/meta/address``); a
    usage error naming the URL to use otherwise."""
    if value is None:
        return None
    try:
        return check_url("--meta-server", value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


META_SERVER_HELP = (
    "the meta_server URL printed by `qmq ready`, or its base URL http://HOST:PORT (or set QMQ_META_SERVER)"
)
meta_server_option = click.option(
    "--meta-server",
    envvar="QMQ_META_SERVER",
    required=True,
    metavar="URL",
    callback=meta_server_url,
    help=META_SERVER_HELP,
)


def _prop(value: str) -> tuple[str, str]:
    key, sep, text = value.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"{value!r} is not k=v", param_hint="--prop")
    return key, text


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration_s(text: str) -> float:
    """``90s``, ``5m``, ``2h``, ``1d``, ``500ms`` or plain seconds (``90``, ``1.5``) as seconds."""
    m = _DURATION.match(text)
    if not m:
        raise click.BadParameter(
            f"{text!r} is not a duration; use a number with an optional unit: 90, 1.5, 500ms, 90s, 5m, 2h, 1d",
            param_hint="--delay",
        )
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def parse_at(text: str) -> datetime:
    """An ISO 8601 time with its UTC offset (``2026-12-24T18:00:00+08:00`` or ``...Z``)."""
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not an ISO 8601 time; use e.g. 2026-12-24T18:00:00+08:00", param_hint="--at"
        ) from None
    if when.tzinfo is None:
        raise click.BadParameter(
            f"{text!r} has no UTC offset; add one, e.g. {when.isoformat()}+08:00 or {when.isoformat()}Z",
            param_hint="--at",
        )
    return when


@cli.command()
@click.argument("subject")
@click.argument("stdin_marker", required=False, metavar="[-]")
@meta_server_option
@click.option("--prop", "props", multiple=True, metavar="K=V", help="a property (repeatable); values are strings")
@click.option("--tag", "tags", multiple=True, metavar="TAG", help="a tag (repeatable, at most 10)")
@click.option("--body", "body_text", metavar="TEXT", help="the body, as UTF-8 text")
@click.option("--body-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="the body, from a file")
@click.option("--app-code", default=None, help="the producer's application code [default: qmq --app-code, or qmq-cli]")
@click.option("--delay", "delay_text", metavar="DURATION", help="deliver after this long: 90s, 5m, 2h, 1d, or seconds")
@click.option(
    "--at", "at_text", metavar="TIME", help="deliver at this ISO 8601 time with offset: 2026-12-24T18:00:00+08:00"
)
@click.option(
    "--repeat-every", "repeat_text", metavar="DURATION", help="deliver copies this far apart (at least 1s): 90s, 5m, 1d"
)
@click.option("--repeat-times", type=click.IntRange(1, 10_000), help="with --repeat-every: this many copies")
@click.option(
    "--repeat-until", "until_text", metavar="TIME", help="with --repeat-every: copies until this ISO 8601 time"
)
def send(
    subject: str,
    stdin_marker: str | None,
    meta_server: str,
    props: tuple[str, ...],
    tags: tuple[str, ...],
    body_text: str | None,
    body_file: Path | None,
    app_code: str | None,
    delay_text: str | None,
    at_text: str | None,
    repeat_text: str | None,
    repeat_times: int | None,
    until_text: str | None,
) -> None:
    """Send one message to SUBJECT; `-` reads the body from standard input. Prints its id.

    With --delay or --at the message goes to a delay server and consumers receive it when due.
    With --repeat-every and --repeat-times (or --repeat-until) it is delivered that many times,
    the first copy one interval after the send (or at --delay/--at); cancel it with
    `qmq cancel-delay ID`.
    """
    from qmq.client.sync import Producer

    if delay_text is not None and at_text is not None:
        raise click.UsageError("give the due time once: --delay or --at")
    delay_s = parse_duration_s(delay_text) if delay_text is not None else None
    at = parse_at(at_text) if at_text is not None else None
    if (repeat_times is not None or until_text is not None) and repeat_text is None:
        raise click.UsageError("--repeat-times and --repeat-until need --repeat-every")
    if repeat_text is not None and (repeat_times is None) == (until_text is None):
        raise click.UsageError("give --repeat-every one end: --repeat-times N or --repeat-until TIME")
    repeat_s = parse_duration_s(repeat_text) if repeat_text is not None else None
    try:
        until = parse_at(until_text) if until_text is not None else None
    except click.BadParameter as exc:
        exc.param_hint = "--repeat-until"
        raise
    if stdin_marker not in (None, "-"):
        raise click.BadParameter(f"{stdin_marker!r}: only '-' (read the body from stdin) may follow the subject")
    sources = [s for s in (body_text is not None, body_file is not None, stdin_marker == "-") if s]
    if len(sources) > 1:
        raise click.UsageError("give the body once: --body, --body-file or -")
    if body_text is not None:
        body = body_text.encode("utf-8")
    elif body_file is not None:
        body = body_file.read_bytes()
    elif stdin_marker == "-":
        body = sys.stdin.buffer.read()
    else:
        body = b""
    pairs = [_prop(p) for p in props]
    from qmq.cli.auth_commands import cli_app_code

    with Producer(app_code=app_code or cli_app_code("qmq-cli"), meta_server=meta_server) as producer:
        msg = producer.generate_message(subject)
        for key, value in pairs:
            msg.set_property(key, value)
        for tag in tags:
            msg.add_tag(tag)
        msg.body = body
        if delay_s is not None:
            msg.set_delay(delay_s)
        elif at is not None:
            msg.set_deliver_at(at)
        if repeat_s is not None:
            msg.set_repeat(every=repeat_s, times=repeat_times, until=until)
        producer.send(msg)
    click.echo(msg.message_id)


def _body_fields(body: bytes) -> dict[str, str]:
    try:
        return {"body": body.decode("utf-8")}
    except UnicodeDecodeError:
        return {"body_base64": base64.b64encode(body).decode("ascii")}


def _jsonable(value: object) -> object:
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    return value


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


@cli.command()
@click.argument("subject")
@click.option("--group", required=True, help="consumer group")
@meta_server_option
@click.option(
    "--from",
    "start_from",
    type=click.Choice(["earliest", "latest"]),
    default="latest",
    show_default=True,
    help="where a group that has never pulled SUBJECT starts: latest (only messages sent from now on) "
    "or earliest (everything SUBJECT holds)",
)
@click.option(
    "--count",
    type=click.IntRange(min=1),
    help="stop after this many messages [default: run until Ctrl-C]; with fewer there, add --idle-exit-ms",
)
@click.option(
    "--idle-exit-ms",
    type=click.IntRange(min=1),
    metavar="MS",
    help="stop once no message came for this long, e.g. 3000 to read what is there and exit "
    "[default: wait for messages]",
)
@json_option("lines", "each message: {subject, message_id, times, tags, properties, created_at, stored_at, body}")
@click.option("--consumer-id", help="stable consumer id (a restarted consumer gets its unacked messages back)")
def consume(
    subject: str,
    group: str,
    meta_server: str,
    start_from: str,
    count: int | None,
    idle_exit_ms: int | None,
    as_json: bool,
    consumer_id: str | None,
) -> None:
    """Consume SUBJECT as a member of GROUP, printing and acknowledging each message.

    A group that has never pulled SUBJECT starts at the latest message (--from latest):
    it receives only what is sent after it starts, and stderr says so. Without --count
    or --idle-exit-ms it waits for messages until Ctrl-C.
    """
    from qmq.client.sync import Consumer

    if start_from == "latest" and asyncio.run(_group_is_new(meta_server, subject, group)):
        click.echo(
            f"qmq consume: consumer group {group!r} has never pulled {subject!r}, so it starts at the latest "
            f"message: only messages sent from now on arrive (--from earliest reads what {subject!r} holds). "
            "Waiting for messages" + ("" if count or idle_exit_ms else "; Ctrl-C stops (or --idle-exit-ms MS)"),
            err=True,
        )
    seen = 0
    idle_since = time.monotonic()
    from qmq.cli.auth_commands import cli_app_code

    with Consumer(
        app_code=cli_app_code("qmq-cli"), meta_server=meta_server, consumer_id=consumer_id or None
    ) as consumer:
        pull = consumer.pull_consumer(subject, group=group, start_from=check_start_from(start_from))
        try:
            while count is None or seen < count:
                want = min(100, count - seen) if count else 100
                batch = pull.pull(max_messages=want, timeout_ms=1000)
                if not batch:
                    if idle_exit_ms and (time.monotonic() - idle_since) * 1000 >= idle_exit_ms:
                        break
                    continue
                idle_since = time.monotonic()
                for m in batch:
                    problem = m.unreadable()
                    if problem is not None:
                        # one unreadable message must not hold up the rest: dead-letter it, go on
                        click.echo(
                            f"message {m.printable_id} of {m.subject} cannot be read ({problem}); "
                            "it goes to the dead letters",
                            err=True,
                        )
                        m.nack(InvalidMessageError(f"unreadable message: {problem}"))
                        continue
                    _echo_message(m, as_json)
                    m.ack()
                    seen += 1
        except KeyboardInterrupt:
            pass


async def _group_is_new(meta_server: str, subject: str, group: str) -> bool:
    """Whether ``group`` has never pulled ``subject`` on any broker group (False when a broker
    cannot tell: the consumer then says what it meets)."""
    from qmq.cli.admin import ask_every_broker, is_never_pulled

    try:
        answers = await ask_every_broker(meta_server, RequestCode.LAG, {"subject": subject, "group": group, "limit": 0})
    except QmqError:
        return False
    return bool(answers) and all(isinstance(a, QmqError) and is_never_pulled(a) for a in answers.values())


def _echo_message(m: ReceivedMessage, as_json: bool) -> None:
    if as_json:
        echo_json(
            {
                "subject": m.subject,
                "message_id": m.message_id,
                "times": m.times,
                "tags": list(m.tags),
                "properties": {k: _jsonable(v) for k, v in m.properties.items()},
                "created_at": _iso(m.created_at),
                "stored_at": _iso(m.stored_at),
                **_body_fields(bytes(m.body)),
            }
        )
        return
    fields = _body_fields(bytes(m.body))
    shown = fields.get("body", fields.get("body_base64", ""))
    props = " ".join(f"{k}={v!r}" for k, v in m.properties.items())
    click.echo(f"{m.subject} {m.message_id} times={m.times} {props} body={shown!r}")
