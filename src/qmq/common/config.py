"""Configuration of every role: one dataclass per role, loaded from a TOML file and from
command-line options that mirror the fields one for one.

Each field's metadata says what values it takes; a wrong value raises ``ConfigError``
naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit, urlunsplit

from qmq.common.config_fields import (
    FlushPolicy,
    _auth_file,
    _connections_per_host_max,
    _first_request_timeout_ms,
    _insecure,
    _opt,
    _port,
    _range,
    _replication_fields,
    _reply_backlog_bytes_max,
    _server_app_code,
    _tls_fields,
    _tracing_fields,
)
from qmq.common.errors import ConfigError
from qmq.common.limits import HOLD_UNTIL_DUE_MS, KiB, MiB

T = TypeVar("T")


@dataclass(slots=True)
class BrokerConfig:
    """A realtime broker: where it listens, where it keeps data, how it flushes."""

    data_dir: Path = _opt(  # noqa: RUF009
        "directory of the message log, consume logs, action log and checkpoints",
        Path("qmq-data/broker"),
    )
    host: str = _opt("address to listen on", "127.0.0.1")
    port: int = _opt("TCP port of the binary protocol (0 picks a free one)", 0, _port)
    http_port: int = _opt("HTTP port of /metrics and /health (0 picks a free one)", 0, _port)
    meta_server: str = _opt("URL of the meta server, as printed by `qmq ready` (empty: run without one)", "")
    group: str = _opt("name of this broker group", "broker-1")
    flush: FlushPolicy = _opt(  # noqa: RUF009
        "sync: acknowledge a send after its batch is fsynced; "
        "periodic: acknowledge once written, fsync every flush_interval_ms",
        "sync",
    )
    flush_interval_ms: int = _opt("fsync period of the periodic flush policy", 1000, _range(1, 60_000))
    fsync_on_loop_ms: int = _opt(
        "under flush = sync, the group commit's fsyncs run on the event loop's thread (no hand-off to"
        " the fsync threads: a shorter latency tail) while the median of the last 15 flushes stays"
        " under this many ms and none takes 20 times it; otherwise they run on the fsync threads for"
        " 10 s. 0: always on the fsync threads",
        5,
        _range(0, 1_000),
    )
    segment_bytes: int = _opt(
        "size at which a message-log segment is closed and a new one begun",
        256 * MiB,
        _range(64 * 1024, 1 << 40),
    )
    consume_log_segment_entries: int = _opt(
        "entries per consume-log segment file",
        1_000_000,
        _range(1024, 1 << 32),
    )
    checkpoint_interval_ms: int = _opt(
        "how often offsets and consumer progress are checkpointed",
        10_000,
        _range(10, 3_600_000),
    )
    retention_hours: float = _opt(
        "age after which message-log segments are deleted",
        72.0,
        _range(0.001, 24 * 3650),
    )
    retention_check_interval_ms: int = _opt("how often retention runs", 60_000, _range(10, 86_400_000))
    dedup_window_ms: int = _opt(
        "how long stored message ids are remembered to drop repeats",
        600_000,
        _range(0, 86_400_000),
    )
    dedup_entries_max: int = _opt(
        "most message ids remembered at once (bounds memory)",
        4_000_000,
        _range(0, 1 << 31),
    )
    disk_free_bytes_min: int = _opt(
        "refuse sends while the data directory's disk has less free space",
        64 * MiB,
        _range(0, 1 << 50),
    )
    pending_flush_bytes_max: int = _opt(
        "bytes of written-but-unflushed sends before new sends wait",
        64 * MiB,
        _range(MiB, 1 << 34),
    )
    held_messages_max: int = _opt(
        "messages stored ahead of their due time and not yet visible (qmq.store.held); sends "
        "of more are refused as busy until some are due. About 200 bytes of memory each",
        100_000,
        _range(1, 10_000_000),
    )
    connections_max: int = _opt("most client connections at once", 4096, _range(1, 1_000_000))
    connections_per_host_max: int = _connections_per_host_max()
    first_request_timeout_ms: int = _first_request_timeout_ms()
    reply_backlog_bytes_max: int = _reply_backlog_bytes_max()
    auth_file: str = _auth_file()
    insecure: bool = _insecure()
    tls_cert: str = _tls_fields()[0]
    tls_key: str = _tls_fields()[1]
    tls_ca: str = _tls_fields()[2]
    app_code: str = _server_app_code()
    heartbeat_interval_ms: int = _opt(
        "how often the broker reports itself to the meta server",
        10_000,
        _range(10, 600_000),
    )
    consumer_offline_ms: int = _opt(
        "a consumer silent this long is offline; its unacked messages go to retry",
        180_000,
        _range(10, 86_400_000),
    )
    ordered_lease_ms: int = _opt(
        "a consumer of an ordered group silent this long (no pull, no long poll waiting) loses its "
        "order-key slots, with its unacknowledged messages, to the group's live consumers; keep it "
        "above any pause a live consumer can have (docs/ordered.md)",
        20_000,
        _range(100, 3_600_000),
    )
    consumer_forget_ms: int = _opt(
        "a consumer silent this long with nothing unacknowledged is forgotten (it leaves LAG; if it "
        "comes back it starts afresh). At least twice the longest long poll (60 s), so a consumer "
        "waiting in one is never forgotten",
        86_400_000,
        _range(120_000, 30 * 86_400_000),
    )
    shutdown_grace_ms: int = _opt("how long shutdown waits for in-flight requests", 5_000, _range(0, 600_000))
    trace_spans: bool = _tracing_fields()[0]
    trace_sample_ratio: float = _tracing_fields()[1]
    trace_endpoint: str = _tracing_fields()[2]
    role: Literal["master", "slave"] = _replication_fields()[0]
    wait_slave_wrote: bool = _replication_fields()[1]
    slave_timeout_ms: int = _replication_fields()[2]
    degrade_unreplicated: bool = _replication_fields()[3]
    open_files_max: int = _opt(
        "most consume-log files kept open at once, whatever the number of subjects (the least recently used "
        "are closed; at most half the process's open-file limit is used)",
        1000,
        _range(16, 1_000_000),
    )
    accept_progress_loss: bool = _opt(
        "start even when no checkpoint checks out and the action log no longer covers consumer progress "
        "(the groups then go back to an older checkpoint, or to their start); without it the broker refuses "
        "to start and names the damaged checkpoint",
        False,
    )
    message_bytes_max: int = _opt(
        "largest message the broker stores (bytes of the encoded message: a 4 MiB body plus 64 KiB for its "
        "header, names, tags and properties); larger ones are refused by index",
        4 * MiB + 64 * KiB,
        _range(1024, 16 * MiB - 64 * 1024),
    )


def _bucket_ms(v: Any) -> str | None:
    if v == 0 or 100 <= v <= 3_600_000:
        return None
    return "must be 0 (use bucket_minutes) or between 100 and 3600000; it exists for tests, use bucket_minutes"


@dataclass(slots=True)
class DelayConfig:
    """A delay server: keeps delay messages on disk until they are due, then hands them to brokers."""

    data_dir: Path = _opt(  # noqa: RUF009
        "directory of the write-ahead log, the schedule logs of each time bucket and the checkpoint",
        Path("qmq-data/delay"),
    )
    host: str = _opt("address to listen on", "127.0.0.1")
    port: int = _opt("TCP port of the binary protocol (0 picks a free one)", 0, _port)
    http_port: int = _opt("HTTP port of /metrics and /health (0 picks a free one)", 0, _port)
    meta_server: str = _opt(
        "URL of the meta server, as printed by `qmq ready`; due messages go to the brokers it lists",
        "",
    )
    group: str = _opt("name of this delay group", "delay-1")
    flush: FlushPolicy = _opt(  # noqa: RUF009
        "sync: acknowledge a send after its write-ahead log batch is fsynced; "
        "periodic: acknowledge once written, fsync every flush_interval_ms",
        "sync",
    )
    flush_interval_ms: int = _opt("fsync period of the periodic flush policy", 1000, _range(1, 60_000))
    bucket_minutes: int = _opt(
        "length of a time bucket: messages due in the same bucket share one schedule log",
        60,
        _range(5, 60),
    )
    bucket_ms: int = _opt(
        "for tests: the bucket length in milliseconds, overriding bucket_minutes (0: use bucket_minutes)",
        0,
        _bucket_ms,
    )
    horizon_days: int = _opt(
        "how far ahead a message may be due; a later one is refused, never clamped",
        730,
        _range(1, 36_500),
    )
    preload_ms: int = _opt(
        "a time bucket is loaded into the in-memory timer this long before it starts",
        10_000,
        _range(0, 600_000),
    )
    wal_segment_bytes: int = _opt(
        "size at which a write-ahead log segment is closed; replayed segments are deleted whole",
        64 * MiB,
        _range(64 * 1024, 1 << 40),
    )
    checkpoint_interval_ms: int = _opt(
        "how often schedule logs are fsynced and the replayed write-ahead log offset is checkpointed",
        10_000,
        _range(10, 3_600_000),
    )
    sync_bytes: int = _opt(
        "a bucket's schedule log is fsynced in the background once this many bytes were written "
        "to it since, so no checkpoint meets a burst's worth to fsync at once",
        4 * MiB,
        _range(64 * 1024, 1 << 40),
    )
    schedule_buffer_bytes_max: int = _opt(
        "bytes of messages replayed from the write-ahead log and not yet written to their schedule logs",
        16 * MiB,
        _range(64 * 1024, 1 << 34),
    )
    handover_lead_ms: int = _opt(
        "due messages are handed to a broker this long before they are due; the broker stores "
        "them at once and makes them visible when due, so a slow hand-over or fsync is not late",
        50,
        _range(0, HOLD_UNTIL_DUE_MS),
    )
    handover_messages_max: int = _opt(
        "due messages handed to brokers and not yet acknowledged by them",
        20_000,
        _range(1, 1_000_000),
    )
    handover_bytes_max: int = _opt(
        "bytes of due messages handed to brokers and not yet acknowledged by them",
        64 * MiB,
        _range(4 * MiB + 1024, 1 << 34),
    )
    disk_free_bytes_min: int = _opt(
        "refuse sends while the data directory's disk has less free space",
        64 * MiB,
        _range(0, 1 << 50),
    )
    pending_flush_bytes_max: int = _opt(
        "bytes of written-but-unflushed sends before new sends are refused as busy",
        64 * MiB,
        _range(MiB, 1 << 34),
    )
    connections_max: int = _opt("most client connections at once", 4096, _range(1, 1_000_000))
    connections_per_host_max: int = _connections_per_host_max()
    first_request_timeout_ms: int = _first_request_timeout_ms()
    reply_backlog_bytes_max: int = _reply_backlog_bytes_max()
    auth_file: str = _auth_file()
    insecure: bool = _insecure()
    tls_cert: str = _tls_fields()[0]
    tls_key: str = _tls_fields()[1]
    tls_ca: str = _tls_fields()[2]
    app_code: str = _server_app_code()
    heartbeat_interval_ms: int = _opt(
        "how often the delay server reports itself to the meta server",
        10_000,
        _range(10, 600_000),
    )
    trace_spans: bool = _tracing_fields()[0]
    trace_sample_ratio: float = _tracing_fields()[1]
    trace_endpoint: str = _tracing_fields()[2]
    role: Literal["master", "slave"] = _replication_fields()[0]
    wait_slave_wrote: bool = _replication_fields()[1]
    slave_timeout_ms: int = _replication_fields()[2]
    degrade_unreplicated: bool = _replication_fields()[3]
    shutdown_grace_ms: int = _opt(
        "how long shutdown waits for in-flight sends and hand-overs",
        5_000,
        _range(0, 600_000),
    )
    wal_kept_for_slaves_bytes_max: int = _opt(
        "a master keeps write-ahead log segments its slaves have not copied up to this many bytes; "
        "a slave further behind copies the master's schedule anew when it comes back",
        4 << 30,
        _range(0, 1 << 50),
    )

    @property
    def bucket_length_ms(self) -> int:
        """The time bucket length in effect: ``bucket_ms`` when set (tests), else ``bucket_minutes``."""
        return self.bucket_ms or self.bucket_minutes * 60_000


@dataclass(slots=True)
class MetaConfig:
    """The meta server: registry of broker groups and the routes of subjects."""

    data_dir: Path = _opt("directory of the meta server's SQLite store", Path("qmq-data/meta"))  # noqa: RUF009
    host: str = _opt("address to listen on", "127.0.0.1")
    port: int = _opt("HTTP port (0 picks a free one)", 0, _port)
    db_url: str = _opt("SQLAlchemy URL of the meta store (empty: SQLite in data_dir)", "")
    heartbeat_timeout_ms: int = _opt(
        "a group silent this long is marked unavailable",
        30_000,
        _range(10, 3_600_000),
    )
    route_groups: int = _opt(
        "broker groups each subject is routed to, when that many exist",
        2,
        _range(1, 64),
    )
    auto_promote: bool = _opt(
        "when a group's master is silent for heartbeat_timeout_ms, make its freshest slave master (docs/cluster.md)",
        True,
    )
    leader_lease_ms: int = _opt(
        "meta servers sharing db_url: how long the leader's lease lasts (renewed every third of it); "
        "another meta server takes over this long after the leader stops",
        15_000,
        _range(100, 600_000),
    )
    client_refresh_ms: int = _opt(
        "how often clients ask again for groups and routes (refresh_ms of GET /meta/address)",
        2_000,
        _range(100, 600_000),
    )

    auth_file: str = _auth_file()
    insecure: bool = _insecure()
    tls_cert: str = _tls_fields()[0]
    tls_key: str = _tls_fields()[1]
    tls_ca: str = _tls_fields()[2]


@dataclass(slots=True)
class GatewayConfig:
    """The HTTP gateway (`qmq gateway`): HTTP in, the asyncio SDK out; it keeps no data of its own."""

    meta_server: str = _opt("URL of the meta server, as printed by `qmq ready` (required)", "")
    host: str = _opt("address to listen on", "127.0.0.1")
    port: int = _opt("HTTP port (0 picks a free one)", 0, _port)
    app_code: str = _opt("app code the gateway's producer and consumer report to the brokers", "gateway")
    ack_timeout_ms: int = _opt(
        "default visibility timeout of a pulled message: one neither acked nor nacked this long after its "
        "pull goes back to its consumer group (a pull's ack_timeout_ms overrides it)",
        30_000,
        _range(1_000, 600_000),
    )
    receipts_max: int = _opt(
        "pulled messages kept for a nack with the group's back-off (past it the oldest are dropped: a nack of one "
        "comes back at once), and the most whose ack timeout the gateway keeps itself when the broker did not take "
        "them (past it a pull is answered 429)",
        100_000,
        _range(1, 10_000_000),
    )
    pull_consumers: int = _opt(
        "SDK consumers (consumer ids) the gateway pulls through: pulls of one consumer group run this many at once",
        4,
        _range(1, 64),
    )
    pull_groups_max: int = _opt(
        "most (subject, consumer group) pairs one gateway pulls for; a pull of another is answered 429",
        10_000,
        _range(1, 1_000_000),
    )
    receipt_key_file: str = _opt(
        "file holding the key (at least 16 bytes) that signs receipts, the same for every gateway of a cluster so "
        "any of them settles any receipt; $QMQ_RECEIPT_KEY overrides it; empty: a key derived from $QMQ_SECRET, "
        "else one of this process only",
        "",
    )
    push_lease_ms: int = _opt(
        "how long this gateway's lease of a push subscription lasts (renewed every third of it): another "
        "gateway takes a subscription over about this long after this one dies",
        6_000,
        _range(1_000, 600_000),
    )
    push_subscriptions_max: int = _opt(
        "most push subscriptions this gateway runs at once (0: none; the others run them)", 1_000, _range(0, 10_000)
    )
    auth_file: str = _opt(
        "TOML file of the apps that may call the gateway (HTTP Basic Authorization, app_code:secret) and what "
        "each may do (docs/security.md); empty: no authentication. Reloaded on SIGHUP. With it, the gateway's "
        "own app_code (secret in $QMQ_SECRET) needs cluster = true in the brokers' auth file",
        "",
    )
    insecure: bool = _insecure()
    tls_cert: str = _tls_fields()[0]
    tls_key: str = _tls_fields()[1]
    tls_ca: str = _tls_fields()[2]
    shutdown_grace_ms: int = _opt("how long shutdown waits for requests in flight", 5_000, _range(0, 600_000))


@dataclass(slots=True)
class StandaloneConfig:
    """`qmq standalone`: one meta server, one broker and one delay server, each its own process."""

    data_dir: Path = _opt("data directory; each role keeps its files below it", Path("qmq-data"))  # noqa: RUF009
    host: str = _opt("address every role listens on", "127.0.0.1")
    meta_port: int = _opt("HTTP port of the meta server (0 picks a free one)", 0, _port)
    broker_port: int = _opt("TCP port of the broker (0 picks a free one)", 0, _port)
    delay_port: int = _opt("TCP port of the delay server (0 picks a free one)", 0, _port)
    gateway_port: int = _opt("HTTP port of the gateway (0 picks a free one)", 0, _port)
    auth_file: str = _opt("the auth file of every role (docs/security.md); empty: no authentication, loopback only", "")
    app_code: str = _server_app_code()
    insecure: bool = _insecure()
    tls_cert: str = _tls_fields()[0]
    tls_key: str = _tls_fields()[1]
    tls_ca: str = _tls_fields()[2]
    ready_timeout_ms: int = _opt(
        "how long to wait for every role to report ready",
        60_000,
        _range(100, 600_000),
    )
    restarts_max: int = _opt(
        "how many times a role that exits on its own is restarted within restart_window_ms; one more"
        " exit in that window makes the supervisor stop the other roles and exit 1",
        3,
        _range(0, 100),
    )
    restart_window_ms: int = _opt("the window restarts_max counts restarts in", 60_000, _range(1_000, 86_400_000))


def field_docs(cls: type) -> dict[str, str]:
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}


def _coerce(cls_name: str, f: dataclasses.Field[Any], hint: Any, value: Any, source: str) -> Any:
    where = f"{source}: {f.name} = {value!r}"
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{where} is not allowed; use one of {', '.join(map(repr, allowed))}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where} must be true or false")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(f"{where} must be a whole number")
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"{where} must be a whole number") from None
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ConfigError(f"{where} must be a number")
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where} must be a number") from None
    if hint is Path:
        if not isinstance(value, str | Path) or not str(value):
            raise ConfigError(f"{where} must be a non-empty path")
        return Path(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string")
        return value
    raise ConfigError(f"{cls_name}.{f.name} has a type the loader does not know: {hint!r}")


def build_config(cls: type[T], values: Mapping[str, Any], source: str = "configuration") -> T:
    """Make ``cls`` from ``values``, checking every key and value; unknown keys are errors."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(unknown)} for {cls.__name__}; known keys: {', '.join(fields)}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        f = fields[name]
        v = _coerce(cls.__name__, f, hints[name], value, source)
        check = f.metadata.get("check")
        problem = check(v) if check else None
        if problem:
            raise ConfigError(f"{source}: {name} = {value!r} {problem}")
        kwargs[name] = v
    return cls(**kwargs)


def load_toml_section(path: Path | None, section: str) -> dict[str, Any]:
    """The ``[section]`` table of a TOML config file, or {} without a file."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML (TOML is UTF-8): {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    table = doc.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"config file {str(path)!r}: [{section}] must be a table")
    return table


def merged(path: Path | None, section: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """File values for ``section`` with command-line overrides (None means "not given") on top."""
    values = load_toml_section(path, section)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return values


def meta_base_url(meta_server: str) -> str:
    """``http://host:port`` of a meta_server URL as printed by ``qmq ready``; ConfigError if it is none."""
    parts = urlsplit(meta_server)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"meta_server {meta_server!r} is not an http URL; pass it as printed by `qmq ready`, "
            "e.g. http://127.0.0.1:8080/meta/address"
        )
    return urlunsplit((parts.scheme, parts.netloc, "", "", ""))
