"""``qmq limits set|list|remove``: quotas set at run time, kept by the meta server
(``/meta/limits``, qmq.meta.limits) and applied by every broker and delay server within a second.

Registered on the ``qmq`` group when imported (``qmq.cli.main.main`` imports it).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import click

from qmq.cli.auth_commands import cli_authorization
from qmq.cli.client_commands import meta_server_option
from qmq.cli.main import CommandError, cli
from qmq.cli.output import echo_json, json_option
from qmq.common.config import meta_base_url

_TIMEOUT_S = 10.0


def _request(method: str, url: str, body: object | None = None) -> Any:
    headers = {"Content-Type": "application/json"}
    authorization = cli_authorization()
    if authorization is not None:
        headers["Authorization"] = authorization
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ssl.create_default_context())
    )
    try:
        with opener.open(request, timeout=_TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            said = json.loads(raw).get("error", raw.decode("utf-8", "replace"))
        except (ValueError, AttributeError):
            said = raw.decode("utf-8", "replace")
        raise CommandError(f"the meta server refused: HTTP {exc.code}: {said}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CommandError(f"cannot reach the meta server at {url}: {exc}") from None


@cli.group("limits")
def limits() -> None:
    """Quotas set at run time: produce msgs/s and bytes/s per app and subject, consume msgs/s per group."""


@limits.command("set")
@click.argument("app")
@click.argument("pattern")
@click.option("--produce-msgs-per-s", type=click.FloatRange(0), default=0.0, help="0: no limit")
@click.option("--produce-bytes-per-s", type=click.FloatRange(0), default=0.0, help="0: no limit")
@click.option("--consume-msgs-per-s", type=click.FloatRange(0), default=0.0, help="per subject:group; 0: no limit")
@meta_server_option
def limits_set(
    app: str,
    pattern: str,
    produce_msgs_per_s: float,
    produce_bytes_per_s: float,
    consume_msgs_per_s: float,
    meta_server: str,
) -> None:
    """Set APP's quota for the subjects matching PATTERN (subject:group for consuming), replacing
    one set before; it comes before the auth file's for the same subjects."""
    body = {
        "app": app,
        "pattern": pattern,
        "produce_msgs_per_s": produce_msgs_per_s,
        "produce_bytes_per_s": produce_bytes_per_s,
        "consume_msgs_per_s": consume_msgs_per_s,
    }
    _request("PUT", f"{meta_base_url(meta_server)}/meta/limits", body)
    click.echo(f"set: app {app!r}, {pattern!r}; brokers apply it within a second")


@limits.command("list")
@meta_server_option
@json_option("lines", "each limit")
def limits_list(meta_server: str, as_json: bool) -> None:
    """Every quota set at run time."""
    rows = _request("GET", f"{meta_base_url(meta_server)}/meta/limits").get("limits", [])
    if as_json:
        for row in rows:
            echo_json(row)
        return
    for row in rows:
        rates = ", ".join(
            f"{k} {row[k]:g}" for k in ("produce_msgs_per_s", "produce_bytes_per_s", "consume_msgs_per_s") if row[k]
        )
        click.echo(f"{row['app']}\t{row['pattern']}\t{rates or 'no limit'}")


@limits.command("remove")
@click.argument("app")
@click.argument("pattern")
@meta_server_option
def limits_remove(app: str, pattern: str, meta_server: str) -> None:
    """Remove APP's quota for PATTERN set with `qmq limits set`."""
    query = urllib.parse.urlencode({"app": app, "pattern": pattern})
    _request("DELETE", f"{meta_base_url(meta_server)}/meta/limits?{query}")
    click.echo(f"removed: app {app!r}, {pattern!r}")
