"""``qmq cluster up|down|status`` and ``qmq admin promote``: a local cluster of one meta server,
broker groups (a master and slaves each) and delay groups, every role its own process; what
the meta server knows of it; and a promotion by hand.

The processes are started and stopped by ``qmq.cli.cluster_launch``; everything shown comes
from the meta server's ``GET /meta/cluster`` (docs/cluster.md).
"""

from __future__ import annotations

import getpass
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Final

import click

from qmq.cli.auth_commands import cli_authorization
from qmq.cli.client_commands import meta_server_option, meta_server_url
from qmq.cli.cluster_launch import (
    CLUSTER_FILE,
    Cluster,
    ClusterError,
    Member,
    StartupFailedError,
    child_env,
    ensure_receipt_key,
    is_running,
    plan,
    start,
    stop,
    wait_ready,
)
from qmq.cli.cluster_view import render, render_processes
from qmq.cli.main import cli
from qmq.cli.output import echo_json, json_option, stdout_console
from qmq.common.config import meta_base_url

# Bounds of a local cluster: each process is a Python interpreter of its own.
BROKER_GROUPS_MAX: Final = 32
SLAVES_MAX: Final = 8
DELAY_GROUPS_MAX: Final = 32
GATEWAYS_MAX: Final = 16
EXIT_STARTUP_FAILED: Final = 3
EXIT_INTERRUPTED: Final = 130  # as a shell reports a command ended by SIGINT
_HTTP_TIMEOUT_S: Final = 10.0
_ERROR_CHARS_MAX: Final = 500


@cli.group()
def cluster() -> None:
    """A local cluster: one meta server, broker groups of a master and slaves, delay groups."""


@cluster.command()
@click.option("--broker-groups", type=click.IntRange(1, BROKER_GROUPS_MAX), default=2, show_default=True)
@click.option(
    "--slaves",
    type=click.IntRange(0, SLAVES_MAX),
    default=1,
    show_default=True,
    help="slaves per broker group and per delay group",
)
@click.option("--delay-groups", type=click.IntRange(0, DELAY_GROUPS_MAX), default=1, show_default=True)
@click.option(
    "--gateways",
    type=click.IntRange(0, GATEWAYS_MAX),
    default=0,
    show_default=True,
    help="HTTP gateways (qmq gateway), each on a free port; the ready line lists their URLs",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help=f"each process keeps its files in DIR/<name>, logs in DIR/logs; {CLUSTER_FILE} lists them",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="address every process listens on")
@click.option("--meta-port", type=click.IntRange(0, 65535), default=0, show_default=True, help="0 picks a free port")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="TOML file handed to every process ([meta], [broker], [delay] tables)",
)
@click.option(
    "--ready-timeout-ms",
    type=click.IntRange(100, 600_000),
    default=60_000,
    show_default=True,
    help="how long every process together has to report ready",
)
@click.option("--auth-file", default=None, help="the auth file of every role (docs/security.md)")
@click.option(
    "--app-code", "server_app_code", default=None, help="the servers' own app (cluster = true); secret in $QMQ_SECRET"
)
@click.option("--insecure", is_flag=True, help="let roles listen beyond loopback without --auth-file")
@click.option("--tls-cert", default=None, help="PEM certificate every port serves TLS with")
@click.option("--tls-key", default=None, help="PEM private key of --tls-cert")
@click.option("--tls-ca", default=None, help="PEM CA: require client certificates signed by it")
@click.pass_context
def up(
    ctx: click.Context,
    broker_groups: int,
    slaves: int,
    delay_groups: int,
    gateways: int,
    data_dir: Path,
    host: str,
    meta_port: int,
    config_file: Path | None,
    ready_timeout_ms: int,
    auth_file: str | None,
    server_app_code: str | None,
    insecure: bool,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
) -> None:
    """Start a cluster, each role its own process that outlives this command, and print
    `qmq ready meta_server=URL ...` once all serve. Stop it with `qmq cluster down`."""
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        running = [m for m in Cluster.load(data_dir).members if is_running(m)]
    except ClusterError:
        running = []
    if running:
        pids = ", ".join(f"{m.name} pid {m.pid}" for m in running)
        click.echo(
            f"qmq cluster: cannot start: a cluster from {data_dir} is running ({pids}); "
            f"stop it first with `qmq cluster down --data-dir {data_dir}`",
            err=True,
        )
        sys.exit(EXIT_STARTUP_FAILED)
    members = plan(
        data_dir.resolve(),
        broker_groups=broker_groups,
        slaves=slaves,
        delay_groups=delay_groups,
        host=host,
        meta_port=meta_port,
        config_file=config_file,
        gateways=gateways,
        secure=_secure_args(auth_file, insecure, tls_cert, tls_key, tls_ca),
        app_code=server_app_code or "",
    )
    if gateways:
        ensure_receipt_key(data_dir.resolve())
    state = Cluster(str(data_dir.resolve()), "", [], int(time.time() * 1000))
    try:
        _start_all(state, members, child_env(ctx.find_root().params.get("log_level")), ready_timeout_ms)
    except StartupFailedError as exc:
        click.echo(f"qmq cluster: cannot start: {exc}", err=True)
        _abandon(state)
        sys.exit(EXIT_STARTUP_FAILED)
    except KeyboardInterrupt:
        _abandon(state)
        click.echo("qmq cluster: interrupted; stopped what was started", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except BaseException:
        _abandon(state)
        raise
    for m in state.members:
        where = m.ready.get("address") or m.ready.get("gateway") or m.ready.get("http", "")
        what = " ".join(x for x in (m.role, m.group, m.role_in_group) if x)
        click.echo(f"  {m.name:<8} {what:<20} pid {m.pid:<8} {where:<22} log {m.log}")
    meta = state.members[0]
    gateway_urls = ",".join(m.ready["gateway"] for m in state.members if m.role == "gateway")
    click.echo(
        f"qmq ready meta_server={state.meta_server} meta_pid={meta.pid} "
        f"broker_groups={','.join(f'b{i}' for i in range(1, broker_groups + 1))} slaves_per_group={slaves} "
        f"delay_groups={','.join(f'd{i}' for i in range(1, delay_groups + 1)) or '-'} "
        f"processes={len(state.members)} data_dir={state.data_dir}"
        + (f" gateways={gateway_urls}" if gateways else "")
        + f" console={meta.ready.get('console', '?')}"
    )


def _secure_args(
    auth_file: str | None, insecure: bool, tls_cert: str | None, tls_key: str | None, tls_ca: str | None
) -> list[str]:
    """The options of auth and TLS every role of the cluster gets (files as absolute paths)."""
    args: list[str] = ["--insecure"] if insecure else []
    for flag, value in (
        ("--auth-file", auth_file),
        ("--tls-cert", tls_cert),
        ("--tls-key", tls_key),
        ("--tls-ca", tls_ca),
    ):
        if value:
            args += [flag, str(Path(value).resolve())]
    return args


def _start_all(state: Cluster, members: list[Member], env: dict[str, Any], ready_timeout_ms: int) -> None:
    """The meta server, then masters and delay servers together, then slaves together, then gateways."""
    deadline = time.monotonic() + ready_timeout_ms / 1000
    meta, rest = members[0], [m for m in members[1:] if m.role != "gateway"]
    waves = [
        [meta],
        [m for m in rest if m.role_in_group != "slave"],
        [m for m in rest if m.role_in_group == "slave"],
        [m for m in members if m.role == "gateway"],
    ]
    procs = {}
    for wave in waves:
        if not wave:
            continue
        for m in wave:
            if m.role != "meta":
                m.argv += ["--meta-server", state.meta_server]
            procs[m.name] = start(m, env)
            state.members.append(m)
            state.save()  # before waiting: `down` must find whatever was started
        wait_ready(procs, wave, deadline)
        if wave[0] is meta:
            state.meta_server = meta.ready["meta_server"]
        state.save()


def _abandon(state: Cluster) -> None:
    """Stop what was started, quickly: it never served anyone."""
    try:
        stop(state.members, timeout_s=10.0)
    finally:
        if state.members:
            state.path().unlink(missing_ok=True)


@cluster.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option(
    "--timeout-ms",
    type=click.IntRange(0, 600_000),
    default=30_000,
    show_default=True,
    help="how long a process has to stop after SIGTERM before it gets SIGKILL",
)
def down(data_dir: Path, timeout_ms: int) -> None:
    """Stop the cluster started from DATA_DIR: brokers and delay servers first, the meta server last."""
    state = Cluster.load(data_dir)
    servers = [m for m in state.members if m.role != "meta"]
    metas = [m for m in state.members if m.role == "meta"]
    results = stop(servers, timeout_ms / 1000) + stop(metas, timeout_ms / 1000)
    for r in results:
        click.echo(f"  {r.how:<12} {r.member.name:<8} pid {r.member.pid}")
    state.path().unlink(missing_ok=True)
    stopped = sum(1 for r in results if r.how != "not running")
    click.echo(f"qmq cluster: stopped {stopped} process(es) of {state.data_dir}")


@cluster.command()
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option(
    "--meta-server",
    envvar="QMQ_META_SERVER",
    default=None,
    metavar="URL",
    callback=meta_server_url,
    help="the meta_server URL printed by `qmq ready`, or its base URL http://HOST:PORT (or QMQ_META_SERVER); "
    "else --data-dir's",
)
@click.option("--routes", "routes_max", type=click.IntRange(0, 10_000), default=50, show_default=True)
@json_option("document", "the meta server's answer (GET /meta/cluster) as it came")
def status(data_dir: Path | None, meta_server: str | None, routes_max: int, as_json: bool) -> None:
    """Every group and server (role, epoch, pid, state, lag, write state), the routes, and the
    leading meta server, as the meta server of the cluster knows them."""
    local = Cluster.load(data_dir) if data_dir is not None else None
    url = meta_server or (local.meta_server if local else None)
    if not url:
        raise click.UsageError("say which cluster: --data-dir DIR (of `qmq cluster up`) or --meta-server URL")
    try:
        code, view = _http(f"{meta_base_url(url)}/meta/cluster?routes_max={routes_max}")
    except ClusterError:
        if local is not None and not as_json:
            render_processes(stdout_console(), local)  # what runs here, at least
        raise
    if code != 200:
        raise ClusterError(f"the meta server at {url} answered HTTP {code}: {_error_text(view)}")
    if as_json:
        echo_json(view)
        return
    render(stdout_console(), view, local)


@cli.group()
def admin() -> None:
    """Actions by hand on a running cluster."""


@admin.command()
@click.argument("group")
@click.option("--role", type=click.Choice(["broker", "delay"]), default="broker", show_default=True)
@meta_server_option
def promote(group: str, role: str, meta_server: str) -> None:
    """Make GROUP's freshest slave its master now, in a new epoch; its old master is told to
    cut what it never replicated and follow. Refused when no slave is fresh."""
    body = {"group": group, "role": role, "by": f"{getpass.getuser()}@{socket.gethostname()}"}
    url = f"{meta_base_url(meta_server)}/meta/promote"
    code, answer = _http(url, body)
    if code == 421 and isinstance(answer, dict) and answer.get("leader"):
        # Only the leading meta server decides; ask it.
        url = f"{meta_base_url(str(answer['leader']))}/meta/promote"
        code, answer = _http(url, body)
    if code != 200 or not isinstance(answer, dict):
        raise ClusterError(f"promotion refused (HTTP {code}): {_error_text(answer)}")
    click.echo(
        f"promoted {answer['master']} to master of {role} group {answer['group']} in epoch {answer['epoch']} "
        f"(was {answer['previous_master']}); the epoch begins at message offset {answer['message_offset']}, "
        f"action offset {answer['action_offset']}"
    )


def _http(url: str, body: object | None = None) -> tuple[int, Any]:
    """(status, decoded JSON answer) of a GET, or of a POST of ``body``; ClusterError when unreachable."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    authorization = cli_authorization()
    if authorization is not None:
        headers["Authorization"] = authorization
    request = urllib.request.Request(url, data=data, headers=headers)
    # Proxies from the environment never apply: the meta server is addressed directly.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=_HTTP_TIMEOUT_S) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ClusterError(f"cannot reach the meta server at {url}: {reason}; is it running?") from None


def _error_text(answer: object) -> str:
    text = answer.get("error", answer) if isinstance(answer, dict) else answer
    return str(text)[:_ERROR_CHARS_MAX]
