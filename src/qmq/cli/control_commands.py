"""``qmq group pause|resume|paused``: control-plane records of consumer groups, kept by the meta
server (``/meta/controls``, qmq.meta.controls) and applied by every broker within a second.

Registered on the ``qmq`` group when imported (``qmq.cli.main.main`` imports it).
"""

from __future__ import annotations

import click

from qmq.cli.client_commands import meta_server_option
from qmq.cli.limits_commands import _request as meta_request
from qmq.cli.main import cli
from qmq.cli.output import echo_json, json_option
from qmq.common.config import meta_base_url


@cli.group("group")
def group_cli() -> None:
    """Control a consumer group on every broker: pause and resume its consumption."""


def _set(subject: str, group: str, meta_server: str, action: str) -> dict[str, object]:
    body = {"subject": subject, "group": group}
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
