"""``qmq meta``, ``qmq broker``, ``qmq delay`` and ``qmq standalone``: run one role, or all of them supervised."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from qmq.cli.main import cli
from qmq.cli.options import config_file_option, config_options, load
from qmq.common.config import BrokerConfig, DelayConfig, GatewayConfig, MetaConfig, StandaloneConfig


@cli.command()
@config_file_option("its [meta] table")
@config_options(MetaConfig)
def meta(config_file: Path | None, **values: Any) -> None:
    """Run a meta server: registry of broker groups, subject routes, client discovery."""
    from qmq.meta import run_meta

    sys.exit(run_meta(load(MetaConfig, config_file, "meta", values)))


@cli.command()
@config_file_option("its [broker] table")
@config_options(BrokerConfig)
def broker(config_file: Path | None, **values: Any) -> None:
    """Run a realtime broker (a master or a slave of a broker group)."""
    from qmq.broker import run_broker

    sys.exit(run_broker(load(BrokerConfig, config_file, "broker", values)))


# bucket_ms exists for tests (sub-minute buckets); it is set in the [delay] table of a config file
_DELAY_OPTIONS = [f for f in DelayConfig.__dataclass_fields__ if f != "bucket_ms"]


@cli.command()
@config_file_option("its [delay] table")
@config_options(DelayConfig, only=_DELAY_OPTIONS)
def delay(config_file: Path | None, **values: Any) -> None:
    """Run a delay server: holds delay messages until they are due, then hands them to brokers."""
    from qmq.delay import run_delay

    sys.exit(run_delay(load(DelayConfig, config_file, "delay", values)))


@cli.command()
@config_file_option(
    "[standalone] for this command (the options below), and [meta], [broker], [delay] and [gateway] for the roles "
    "it starts, each reading its own table (their data_dir, host and port come from here)"
)
@config_options(StandaloneConfig)
@click.option("--demo", is_flag=True, help="once ready, send a message and consume it, printing both")
def standalone(config_file: Path | None, demo: bool, **values: Any) -> None:
    """Run a meta server, a broker, a delay server and an HTTP gateway, each its own process, supervised as one.

    Prints `qmq ready ... meta_server=URL` once every role serves; SIGTERM or Ctrl-C stops
    them in order. Children exit when this process dies, even by kill -9.
    """
    from qmq.cli.standalone import Supervisor

    config = load(StandaloneConfig, config_file, "standalone", values)
    sys.exit(Supervisor(config, config_file, demo=demo).run())


@cli.command()
@config_file_option("its [gateway] table")
@config_options(GatewayConfig)
def gateway(config_file: Path | None, **values: Any) -> None:
    """Run an HTTP gateway: JSON over HTTP/1.1 for any language, the SDK inside (docs/gateway.md).

    Prints `qmq ready role=gateway gateway=URL ...` once it serves. It keeps no data: run as
    many as you like behind a load balancer.
    """
    from qmq.gateway import run_gateway

    sys.exit(run_gateway(load(GatewayConfig, config_file, "gateway", values)))
