"""The keyword options of the producer and the consumer: defaults, bounds, and the checks
that name a wrong value (``ConfigError``) before anything starts.
"""

from __future__ import annotations

import os
import secrets
import socket
import ssl as ssl_module
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit, urlunsplit

from qmq.auth.secrets import SECRET_ENV
from qmq.common.errors import ConfigError, InvalidSubjectError
from qmq.common.limits import DEFAULT_LIMITS, MiB
from qmq.common.naming import check_name

if TYPE_CHECKING:
    from qmq.auth.handshake import ClientCredentials

StartFrom = Literal["latest", "earliest"]
START_FROM: tuple[str, ...] = ("latest", "earliest")
# how a subscription's tags match a message's: any of them ("or") or all ("and")
TagType = Literal["or", "and"]
# the path of the meta server's discovery answer (GET), below its base URL
META_ADDRESS_PATH = "/meta/address"

_HOSTNAME_CHARS_MAX = 60
_TIMEOUT_MS_MAX = 3_600_000


def check_int(name: str, value: object, lo: int, hi: int) -> int:
    """``value`` if it is a whole number in ``lo..hi``; ConfigError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r} must be a whole number between {lo} and {hi}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value!r} is out of range; use a whole number between {lo} and {hi}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False")
    return value


def check_start_from(value: object) -> StartFrom:
    if value == "latest":
        return "latest"
    if value == "earliest":
        return "earliest"
    raise ConfigError(f"start_from={value!r} is not allowed; use 'latest' or 'earliest'")


def check_identifier(kind: str, value: object) -> str:
    """An app code, consumer group or consumer id: a short name without whitespace, '/' or '%'."""
    try:
        return check_name(kind, value)
    except InvalidSubjectError as exc:
        raise ConfigError(str(exc)) from None


def check_url(name: str, value: object) -> str:
    """The meta server's discovery URL, as ``qmq ready`` prints it (``http://host:port/meta/address``).

    The server's base URL (``http://host:port``, with or without a ``/``) means the same and
    becomes that URL; anything else is a ConfigError naming the URL to use. The SDK, the
    ``qmq`` command and the Spark source all take their ``meta_server`` through here.
    """
    parts = urlsplit(value.strip()) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"{name}={value!r} must be the meta server's http:// URL as printed by `qmq ready` "
            f"(meta_server=http://host:port{META_ADDRESS_PATH}), or its base URL http://host:port"
        )
    if parts.path in ("", "/"):
        return urlunsplit((parts.scheme, parts.netloc, META_ADDRESS_PATH, parts.query, ""))
    if not parts.path.endswith(META_ADDRESS_PATH):
        raise ConfigError(
            f"{name}={value!r} is not the meta server's discovery URL: use "
            f"{urlunsplit((parts.scheme, parts.netloc, META_ADDRESS_PATH, '', ''))} as printed by `qmq ready` "
            f"(or the base URL {parts.scheme}://{parts.netloc})"
        )
    return urlunsplit(parts)


def default_consumer_id() -> str:
    """Unique per process: ``<hostname>-<pid>-<6 random hex>``, with the hostname made name-safe."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())
    return f"{host[:_HOSTNAME_CHARS_MAX] or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class ConnectOptions:
    """Timeouts of reaching the meta server and the brokers, and of closing."""

    connect_timeout_ms: int = 3_000
    meta_timeout_ms: int = 5_000
    close_timeout_ms: int = 10_000
    # the app's secret, for servers with an auth file (empty: connect without authenticating);
    # never shown (repr), never sent (qmq.auth.handshake)
    secret: str = field(default="", repr=False)
    # TLS to the meta server and every broker (qmq.client.tls): None for plain TCP, unless the
    # meta server's URL is https://, which means TLS with the system's trust
    ssl: ssl_module.SSLContext | None = field(default=None, repr=False, compare=False)

    def tls(self, meta_server: str) -> ssl_module.SSLContext | None:
        """The context of the client's connections: ``ssl``, or the default one for an https:// meta server."""
        if self.ssl is not None or not meta_server.startswith("https://"):
            return self.ssl
        return ssl_module.create_default_context()

    def __post_init__(self) -> None:
        if self.ssl is not None and not isinstance(self.ssl, ssl_module.SSLContext):
            raise ConfigError(f"ssl={self.ssl!r} must be an ssl.SSLContext (ssl.create_default_context(cafile=...))")
        check_int("connect_timeout_ms", self.connect_timeout_ms, 1, _TIMEOUT_MS_MAX)
        check_int("meta_timeout_ms", self.meta_timeout_ms, 1, _TIMEOUT_MS_MAX)
        check_int("close_timeout_ms", self.close_timeout_ms, 0, _TIMEOUT_MS_MAX)


@dataclass(frozen=True, slots=True)
class ProducerOptions:
    """Bounds of the send buffer, shape of the batches, and the retry policy of a producer."""

    # Messages (and bytes) waiting or in flight; a full buffer refuses new sends at once.
    buffer_messages_max: int = 10_000
    buffer_bytes_max: int = 64 * MiB
    # One SEND_MESSAGES frame holds at most this many messages and bytes (a single larger
    # message goes alone).
    batch_messages_max: int = 1_000
    batch_bytes_max: int = 1 * MiB
    # Frames outstanding per broker group; sends arriving meanwhile coalesce into the next.
    # A caller that holds the event loop (send_nowait in a long loop) still gets a message
    # queued for 1 ms (or linger_ms) written by its next send, up to twice this many frames.
    # 1 keeps a producer's sends to a subject of one broker group in the order they were made,
    # also across retries (a frame being retried holds the only slot).
    max_in_flight: int = 4
    # How long a sender waits for a batch to fill before sending it; 0 sends at once.
    linger_ms: int = 0
    # From the moment a message enters the buffer until it is stored, including retries.
    send_timeout_ms: int = 10_000
    retry_backoff_ms: int = 50
    retry_backoff_ms_max: int = 1_000
    # Every send may repeat one made before, by this process or another (a delay server's
    # hand-overs, an outbox watchdog): a message due now goes only to the broker group of its
    # route that its id picks (client/routing.py) and waits for that group while it takes no
    # sends, never to another group, which would store it twice.
    resends: bool = False

    def __post_init__(self) -> None:
        limits = DEFAULT_LIMITS
        check_int("buffer_messages_max", self.buffer_messages_max, 1, 10_000_000)
        check_int("buffer_bytes_max", self.buffer_bytes_max, limits.message_bytes_max, 1 << 40)
        check_int("batch_messages_max", self.batch_messages_max, 1, limits.batch_messages_max)
        # Room for the frame header below frame_bytes_max.
        check_int("batch_bytes_max", self.batch_bytes_max, 1024, limits.frame_bytes_max - limits.frame_header_bytes_max)
        check_int("max_in_flight", self.max_in_flight, 1, 64)
        check_int("linger_ms", self.linger_ms, 0, 10_000)
        check_int("send_timeout_ms", self.send_timeout_ms, 1, _TIMEOUT_MS_MAX)
        check_int("retry_backoff_ms", self.retry_backoff_ms, 1, 60_000)
        check_int("retry_backoff_ms_max", self.retry_backoff_ms_max, self.retry_backoff_ms, 600_000)


@dataclass(frozen=True, slots=True)
class ConsumerOptions:
    """Identity of a consumer and the timing of its acks, retries and requests."""

    consumer_id: str = ""
    # Acknowledgements ride on the next pull; without one they are sent within this long.
    ack_flush_ms: int = 100
    # A message whose handler failed is retried this many times, then goes to %DEAD_RETRY%.
    max_retries: int = 16
    # Answer time allowed for a request, on top of a pull's long-poll time.
    request_timeout_ms: int = 5_000
    # How often a pull consumer looks at its %RETRY% subject.
    retry_pull_interval_ms: int = 1_000
    # Check the CRC32C of every record received (costs well under a microsecond a KiB).
    check_crc: bool = True
    # False: acks never ride on pulls, only flushes send them, so a flush_acks that returned
    # delivered every ack made before it (the HTTP gateway answers acks that way).
    acks_with_pulls: bool = True

    def __post_init__(self) -> None:
        if self.consumer_id:
            check_identifier("consumer_id", self.consumer_id)
        else:
            object.__setattr__(self, "consumer_id", default_consumer_id())
        check_int("ack_flush_ms", self.ack_flush_ms, 1, 60_000)
        check_int("max_retries", self.max_retries, 0, 10_000)
        check_int("request_timeout_ms", self.request_timeout_ms, 1, _TIMEOUT_MS_MAX)
        check_int("retry_pull_interval_ms", self.retry_pull_interval_ms, 1, _TIMEOUT_MS_MAX)
        check_bool("check_crc", self.check_crc)
        check_bool("acks_with_pulls", self.acks_with_pulls)


DEFAULT_CONNECT = ConnectOptions()
DEFAULT_PRODUCER = ProducerOptions()
DEFAULT_CONSUMER = ConsumerOptions(consumer_id="default")


def secret_of(secret: str | None) -> str:
    """The app's secret: ``secret`` when given, else ``$QMQ_SECRET``, else none ("")."""
    if secret is None:
        return os.environ.get(SECRET_ENV, "")
    if not isinstance(secret, str):
        raise ConfigError(f"secret must be a string, got {type(secret).__name__} (its value is not shown)")
    return secret


def credentials_of(app_code: str, options: ConnectOptions) -> ClientCredentials | None:
    """What a connection authenticates with: the app code and secret, or None without a secret."""
    if not options.secret:
        return None
    from qmq.auth.handshake import ClientCredentials

    return ClientCredentials(app_code, options.secret)


def authorization_of(app_code: str, options: ConnectOptions) -> str | None:
    """The Authorization header for the meta server's HTTP, or None without a secret."""
    if not options.secret:
        return None
    from qmq.auth.http import basic_authorization

    return basic_authorization(app_code, options.secret)
