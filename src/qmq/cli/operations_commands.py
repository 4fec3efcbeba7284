"""``qmq admin drain|undrain|routes|remove-group|history``: cluster operations by hand, each one
HTTP call of the meta server (``qmq.meta.operations_http``; docs/cluster.md, "Operations"); and
``qmq cluster rolling-restart`` (``qmq.cli.cluster_rolling``).

Every change names who asked (``user@host`` of this machine) so ``qmq admin history`` can say.
"""

from __future__ import annotations

import getpass
import socket
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import click
from rich.table import Table

from qmq.cli.client_commands import meta_server_option
from qmq.cli.cluster_commands import _error_text, _http, admin, cluster
from qmq.cli.cluster_launch import Cluster, ClusterError, child_env
from qmq.cli.cluster_rolling import RollingRestart
from qmq.cli.output import echo_json, json_option, print_table, stdout_console
from qmq.common.config import meta_base_url


def operator() -> str:
    """Who runs this command: ``user@host``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _post(meta_server: str, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
    code, answer = _http(f"{meta_base_url(meta_server)}{path}", {**body, "by": operator()})
    if code != 200 or not isinstance(answer, dict):
        raise ClusterError(f"{what} refused (HTTP {code}): {_error_text(answer)}")
    return answer


def _get(meta_server: str, path: str, what: str) -> dict[str, Any]:
    code, answer = _http(f"{meta_base_url(meta_server)}{path}")
    if code != 200 or not isinstance(answer, dict):
        raise ClusterError(f"{what} refused (HTTP {code}): {_error_text(answer)}")
    return answer


@admin.command()
@click.argument("group")
@meta_server_option
def drain(group: str, meta_server: str) -> None:
    """Take broker group GROUP out of writing: producers send each subject to its other groups at
    once, consumers keep pulling until GROUP is empty (`qmq cluster status` shows what is left).
    Refused when a subject would have no other writable group."""
    answer = _post(meta_server, "/meta/drain", {"group": group}, f"draining {group}")
    click.echo(f"broker group {group} is draining: {answer['detail']}")


@admin.command()
@click.argument("group")
@meta_server_option
def undrain(group: str, meta_server: str) -> None:
    """Make a draining broker group GROUP writable again."""
    _post(meta_server, "/meta/undrain", {"group": group}, f"undraining {group}")
    click.echo(f"broker group {group} is writable again")


@admin.command()
@click.argument("subject")
@click.option("--add", "add", metavar="GROUP", default=None, help="route SUBJECT to broker group GROUP too")
@click.option(
    "--remove",
    "remove",
    metavar="GROUP",
    default=None,
    help="retire SUBJECT's route to GROUP: no new sends; consumers take what it holds",
)
@meta_server_option
@json_option("document", "the meta server's answer (GET /meta/routes) as it came")
def routes(subject: str, add: str | None, remove: str | None, meta_server: str, as_json: bool) -> None:
    """Show SUBJECT's broker groups, each with its state (active, retiring, draining) and what it
    holds unconsumed; or change them with --add or --remove."""
    if add is not None and remove is not None:
        raise click.UsageError("give --add GROUP or --remove GROUP, not both")
    if add is not None or remove is not None:
        change = {"add": add} if add is not None else {"remove": remove}
        answer = _post(meta_server, "/meta/routes", {"subject": subject, **change}, f"changing {subject}'s routes")
        click.echo(f"{answer['action']} {answer['target']}: {answer['detail']}")
    view = _get(meta_server, f"/meta/routes?subject={quote(subject, safe='')}", f"reading {subject}'s routes")
    if as_json:
        echo_json(view)
        return
    table = Table("broker group", "state", "left", title=f"routes of {subject}")
    for r in view["routes"]:
        table.add_row(r["group"], r["state"], "–" if r["left"] is None else f"{r['left']:,}")
    print_table(stdout_console(), table)


@admin.command(name="remove-group")
@click.argument("group")
@meta_server_option
def remove_group(group: str, meta_server: str) -> None:
    """Unregister drained broker group GROUP for good. Refused while anything in it is
    unconsumed by any consumer group (the answer names the subject and group)."""
    answer = _post(meta_server, "/meta/remove-group", {"group": group}, f"removing {group}")
    click.echo(f"broker group {group} removed: {answer['detail']}")


@admin.command()
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
@meta_server_option
@json_option("document", "the meta server's answer (GET /meta/history) as it came")
def history(limit: int, meta_server: str, as_json: bool) -> None:
    """The latest cluster operations, oldest first: when, who, what."""
    view = _get(meta_server, f"/meta/history?limit={limit}", "reading the history")
    if as_json:
        echo_json(view)
        return
    table = Table("when (UTC)", "who", "action", "target", "detail", title="operations")
    for e in view["history"]:
        when = datetime.fromtimestamp(e["at_ms"] / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(when, e["who"], e["action"], e["target"], e["detail"])
    print_table(stdout_console(), table)


@cluster.command(name="rolling-restart")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option(
    "--step-timeout-ms",
    type=click.IntRange(1_000, 3_600_000),
    default=120_000,
    show_default=True,
    help="how long one process has to be back, registered and caught up before the restart stops",
)
@click.option(
    "--stop-timeout-ms",
    type=click.IntRange(0, 600_000),
    default=30_000,
    show_default=True,
    help="how long a process has to stop after SIGTERM before it gets SIGKILL",
)
@json_option("document", "{restarted: [{name, role, group, before, after, old_pid, new_pid, how, took_s}], took_s}")
@click.pass_context
def rolling_restart(
    ctx: click.Context, data_dir: Path, step_timeout_ms: int, stop_timeout_ms: int, as_json: bool
) -> None:
    """Restart every process of the cluster started from DATA_DIR, one at a time, while it serves:
    slaves first (of broker and delay groups), then delay servers without a slave and gateways,
    then each master after promoting its slave, then the meta server; each waited for until ready
    and caught up. A table at the end says what each was and is, its old and new pid, and how long
    it took."""
    state = Cluster.load(data_dir)
    began = time.monotonic()
    echo = (lambda _text: None) if as_json else click.echo
    restarted = RollingRestart(
        state,
        child_env(ctx.find_root().params.get("log_level")),
        _http,
        step_timeout_s=step_timeout_ms / 1000,
        stop_timeout_s=stop_timeout_ms / 1000,
        by=f"{operator()} (rolling-restart)",
        echo=echo,
    ).run()
    took_s = time.monotonic() - began
    if as_json:
        echo_json({"restarted": [asdict(r) for r in restarted], "took_s": round(took_s, 3)})
        return
    table = Table("process", "role", "group", "before", "after", "old pid", "new pid", "took", "how", title="restarted")
    for r in restarted:
        table.add_row(
            r.name,
            r.role,
            r.group or "–",
            r.before,
            r.after,
            str(r.old_pid),
            str(r.new_pid),
            f"{r.took_s:.1f} s",
            r.how,
        )
    print_table(stdout_console(), table)
    click.echo(f"qmq cluster: restarted {len(restarted)} process(es) of {state.data_dir} in {took_s:.1f} s")
