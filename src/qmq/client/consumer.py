"""The asyncio consumer: listeners, pull consumers (their classes in pull_consumer.py), the ack
flusher, and failing messages to their retry or dead-letter subject.

A ``Consumer`` is one consumer id: every pull it makes carries that id, so the broker keeps
one pull log per (subject, consumer group, consumer id). No ordering is promised within a
consumer group, except per order key with ``ordered=True`` (ordered_listener.py, ordered_pull.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from ssl import SSLContext
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Unpack

from qmq.client import telemetry
from qmq.client.connection import ConnectionPool
from qmq.client.failure import Failures, is_internal
from qmq.client.keywords import ASYNC_LISTENER_KEYS, AsyncListenerKeywords, ListenerKeywords, check_keywords
from qmq.client.lag_watch import watch_lag
from qmq.client.listener import Listener
from qmq.client.listener_behaviour import ListenerBehaviour
from qmq.client.message import subject_bytes
from qmq.client.meta import MetaClient
from qmq.client.options import (
    DEFAULT_CONNECT,
    DEFAULT_CONSUMER,
    ConnectOptions,
    ConsumerOptions,
    StartFrom,
    TagType,
    authorization_of,
    check_identifier,
    check_int,
    check_start_from,
    check_url,
    credentials_of,
    secret_of,
)
from qmq.client.ordered_listener import OrderedListener
from qmq.client.producer import Producer
from qmq.client.pull_consumer import OrderedPullConsumer, PullConsumer, PullConsumerBase, check_pull_args
from qmq.client.pull_many import pull_many
from qmq.client.puller import ConsumerContext, SubjectPuller, flush_acks_together, leave_ordered
from qmq.client.received import Batch, BatchBase, M, ReceivedBase, ReceivedMessage
from qmq.client.subscription import Subscription, make_subscription
from qmq.common.errors import (
    ConfigError,
    QmqError,
)
from qmq.common.limits import DEFAULT_LIMITS
from qmq.common.naming import (
    retry_subject,
)

if TYPE_CHECKING:  # the checkers live above the SDK (qmq.idempotency); only their shape is needed here
    from qmq.idempotency.base import AsyncIdempotentChecker

log = logging.getLogger(__name__)

_State = Literal["new", "open", "closing", "closed"]
_PREFETCH_DEFAULT_MIN = 256
LISTENER_CONCURRENCY_DEFAULT = 32
F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def is_async_function(fn: object) -> bool:
    # A plain bool (not the TypeGuard of inspect's), so the decorated type passes through.
    return inspect.iscoroutinefunction(fn)


class Consumer:
    """Consumes messages of a qmq cluster (asyncio), as one consumer id.

    Use as ``async with Consumer(app_code=..., meta_server=...) as consumer:``. Every option
    is a keyword with a default; a bad value raises ``qmq.ConfigError`` naming it.
    """

    def __init__(
        self,
        *,
        app_code: str,
        meta_server: str,
        consumer_id: str | None = None,
        ack_flush_ms: int = DEFAULT_CONSUMER.ack_flush_ms,
        max_retries: int = DEFAULT_CONSUMER.max_retries,
        request_timeout_ms: int = DEFAULT_CONSUMER.request_timeout_ms,
        retry_pull_interval_ms: int = DEFAULT_CONSUMER.retry_pull_interval_ms,
        check_crc: bool = DEFAULT_CONSUMER.check_crc,
        acks_with_pulls: bool = DEFAULT_CONSUMER.acks_with_pulls,
        connect_timeout_ms: int = DEFAULT_CONNECT.connect_timeout_ms,
        meta_timeout_ms: int = DEFAULT_CONNECT.meta_timeout_ms,
        close_timeout_ms: int = DEFAULT_CONNECT.close_timeout_ms,
        secret: str | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        self.app_code = check_identifier("app_code", app_code)
        self.meta_server = check_url("meta_server", meta_server)
        if consumer_id is not None and not isinstance(consumer_id, str):
            raise ConfigError(f"consumer_id={consumer_id!r} must be a string")
        self.options = ConsumerOptions(
            consumer_id=consumer_id or "",
            ack_flush_ms=ack_flush_ms,
            max_retries=max_retries,
            request_timeout_ms=request_timeout_ms,
            retry_pull_interval_ms=retry_pull_interval_ms,
            check_crc=check_crc,
            acks_with_pulls=acks_with_pulls,
        )
        self.connect_options = ConnectOptions(
            connect_timeout_ms, meta_timeout_ms, close_timeout_ms, secret_of(secret), ssl
        )
        self.consumer_id = self.options.consumer_id
        self._ctx = ConsumerContext(
            self.app_code, self.consumer_id, self.options, self.connect_options, self._fail_message
        )
        self._state: _State = "new"
        self._producer: Producer | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._lag_watch: asyncio.Task[None] | None = None  # the lag metric's refresher (qmq.client.lag_watch)
        self._pull_consumers: dict[tuple[str, str], PullConsumerBase] = {}
        self._listeners: list[Listener[Any]] = []
        self._failures = Failures(self.options.max_retries)
        # one flush of acks at a time, so a flush that returned has seen the outcome of those before it
        self._ack_flushing = asyncio.Lock()

    async def start(self) -> None:
        """Ask the meta server for the brokers and start the listeners registered so far."""
        if self._state == "open":
            return
        if self._state != "new":
            raise QmqError("this consumer is closed; make a new one")
        meta = MetaClient(
            self.meta_server,
            timeout_ms=self.connect_options.meta_timeout_ms,
            authorization=authorization_of(self.app_code, self.connect_options),
            ssl=self.connect_options.tls(self.meta_server),
        )
        await meta.start()
        pool = ConnectionPool(
            connect_timeout_ms=self.connect_options.connect_timeout_ms,
            credentials=credentials_of(self.app_code, self.connect_options),
            ssl=self.connect_options.tls(self.meta_server),
        )
        pool.authenticate_early(g.address for g in meta.groups.values())
        self._ctx.meta, self._ctx.pool = meta, pool
        self._producer = Producer._sharing(self.app_code, self.meta_server, meta, pool, self.connect_options)
        await self._producer.start()
        self._flusher = asyncio.ensure_future(self._flush_loop())
        if telemetry.INSTALLED:
            self._lag_watch = asyncio.ensure_future(watch_lag(meta, pool, self._lag_pairs))
        self._state = "open"
        for listener in self._listeners:
            listener.start()

    async def __aenter__(self) -> Consumer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def pull_consumer(
        self,
        subject: str,
        group: str,
        start_from: StartFrom = "latest",
        *,
        tags: Sequence[str] | None = None,
        tag_type: TagType = "or",
        broadcast: bool = False,
        max_retries: int | None = None,
        retry_backoff: Sequence[float] | None = None,
        ordered: bool = False,
    ) -> PullConsumer:
        """A pull consumer of ``subject`` in consumer ``group`` (the same one for the same pair).

        ``start_from`` says where a group that has never pulled starts: the next message
        sent ("latest") or the oldest one kept ("earliest"). With ``tags`` only messages
        carrying any (``tag_type="or"``) or all (``"and"``) of them are pulled; the broker
        filters. With ``broadcast`` every consumer gets every message, from the latest.
        With ``ordered`` a pull returns at most one unsettled message per order key: the key's
        next one comes once it is acked, and a nacked one comes back in place after the back-off
        (docs/ordered.md).
        """
        sub = make_subscription(
            tags,
            tag_type,
            broadcast,
            self.options.max_retries if max_retries is None else max_retries,
            retry_backoff,
            ordered,
        )
        cls = OrderedPullConsumer if ordered else PullConsumer
        pc = self._pull_consumer(subject, group, start_from, ReceivedMessage, Batch, cls, sub)
        assert isinstance(pc, PullConsumer)
        return pc

    async def pull_many(
        self,
        pull_consumers: Sequence[PullConsumer],
        max_messages: int = 1_000,
        per_subject_max: int = 100,
        timeout_ms: int = 0,
    ) -> list[Batch]:
        """A batch for each of ``pull_consumers`` (this consumer's, in order; empty for those with
        nothing): one request per broker group for all their subjects (PULL_MANY), up to
        ``per_subject_max`` messages of each and ``max_messages`` in all a broker group. Each one's
        retry subject is looked at too, as ``pull()`` does. With ``timeout_ms`` it waits up to that
        long for the first message when the subjects all live on one broker group (a long poll on
        all of them at once); otherwise it does not wait."""
        check_pull_args(per_subject_max, timeout_ms)
        check_pull_args(max_messages, 0)
        batches = await pull_many(pull_consumers, max_messages, per_subject_max, timeout_ms)
        return [b for b in batches if isinstance(b, Batch)]

    def _pull_consumer(
        self,
        subject: str,
        group: str,
        start_from: StartFrom,
        make: type[M],
        batch_cls: type[BatchBase[M]],
        cls: type[PullConsumerBase],
        sub: Subscription | None = None,
    ) -> PullConsumerBase:
        subject_bytes(subject)  # raises InvalidSubjectError naming a bad subject
        check_identifier("consumer group", group)
        start_from = check_start_from(start_from)
        if sub is None:
            sub = make_subscription(max_retries=self.options.max_retries)
        pc = self._pull_consumers.get((subject, group))
        if pc is None:
            main, retry = self._pullers(subject, group, start_from, make, batch_cls, sub)
            pc = cls(main, retry, self.options.retry_pull_interval_ms)
            self._pull_consumers[(subject, group)] = pc
        elif pc.start_from != start_from or pc.subscription != sub:
            raise ConfigError(
                f"pull consumer of {subject!r} in group {group!r} exists with start_from={pc.start_from!r} and "
                f"{pc.subscription}; it cannot change to start_from={start_from!r} and {sub}"
            )
        return pc

    def _pullers(
        self,
        subject: str,
        group: str,
        start_from: StartFrom,
        make: type[M],
        batch_cls: type[BatchBase[M]],
        sub: Subscription,
    ) -> tuple[SubjectPuller[M], SubjectPuller[M] | None]:
        main = SubjectPuller(self._ctx, subject, group, start_from, subject, make, batch_cls, sub)
        if is_internal(subject) or sub.broadcast or sub.ordered:
            # A retry or dead-letter subject read directly: its failures go back to it.
            # Broadcast messages are never retried (each consumer is its own group); ordered
            # ones are retried in place (ordered_listener.py, ordered_pull.py).
            return main, None
        # Every message ever failed must come back, however late the group started. Retried
        # messages passed the tag filter once already: the retry subject is pulled unfiltered.
        retry_sub = Subscription((), "or", False, sub.max_retries, sub.retry_backoff_ms)
        retry = SubjectPuller(
            self._ctx, retry_subject(subject, group), group, "earliest", subject, make, batch_cls, retry_sub
        )
        return main, retry

    def listener(
        self,
        subject: str,
        group: str,
        *,
        start_from: StartFrom = "latest",
        concurrency: int = LISTENER_CONCURRENCY_DEFAULT,
        prefetch: int | None = None,
        tags: Sequence[str] | None = None,
        tag_type: TagType = "or",
        broadcast: bool = False,
        consume_most_once: bool = False,
        max_retries: int | None = None,
        retry_backoff: Sequence[float] | None = None,
        auto_ack: bool = True,
        idempotent_checker: AsyncIdempotentChecker | None = None,
        filters: Sequence[Any] = (),
        ordered: bool = False,
    ) -> Callable[[F], F]:
        """Decorate an ``async def handler(message)`` called for every message of ``subject``.

        Returning acknowledges the message (with ``auto_ack=False`` the handler calls
        ``m.ack()``/``m.nack(exc)`` itself); raising fails it: it comes back after the
        back-off for its attempt (``retry_backoff``, seconds, the last value repeating; or
        ``raise qmq.NeedRetry(after=...)``), with ``m.times`` counting attempts, and after
        ``max_retries`` failures it goes to ``%DEAD_RETRY%<subject>%<group>``. ``tags`` and
        ``tag_type`` filter on the broker; ``broadcast`` gives every consumer every message
        (from the latest, never retried); ``consume_most_once`` acknowledges on receipt and
        never retries. ``idempotent_checker`` skips messages already handled (see
        ``qmq.idempotency``); ``filters`` are objects with ``pre(m) -> bool`` (False: skip
        and acknowledge) and ``post(m, exc)``. At most ``concurrency`` handlers run at once
        and at most ``prefetch`` messages (default: the larger of 256 and twice
        ``concurrency``) are pulled ahead. With ``ordered`` the messages of one order key run one
        at a time in the order they were sent, and a failing one is retried in place, holding its
        key, rather than through the retry subject (docs/ordered.md).
        """

        def register(handler: F) -> F:
            if not is_async_function(handler):
                raise ConfigError(
                    f"listener handler {getattr(handler, '__name__', handler)!r} must be an `async def` "
                    "function; for plain functions use the blocking qmq.Consumer"
                )
            self.add_listener(
                subject,
                group,
                handler,
                start_from=start_from,
                concurrency=concurrency,
                prefetch=prefetch,
                tags=tags,
                tag_type=tag_type,
                broadcast=broadcast,
                consume_most_once=consume_most_once,
                max_retries=max_retries,
                retry_backoff=retry_backoff,
                auto_ack=auto_ack,
                idempotent_checker=idempotent_checker,
                filters=filters,
                ordered=ordered,
            )
            return handler

        return register

    def add_listener(
        self,
        subject: str,
        group: str,
        handler: Callable[..., Awaitable[object]],
        **options: Unpack[AsyncListenerKeywords],
    ) -> Listener[ReceivedMessage]:
        """The same as ``@listener(...)`` without the decorator, with the same keywords; starts at once
        on an open consumer."""
        check_keywords("add_listener", options, ASYNC_LISTENER_KEYS)
        return self._add_listener(
            subject,
            group,
            handler,
            ReceivedMessage,
            Batch,
            options.get("concurrency", LISTENER_CONCURRENCY_DEFAULT),
            options.get("idempotent_checker"),
            options,
        )

    def _add_listener(
        self,
        subject: str,
        group: str,
        handler: Callable[[M], Awaitable[object]],
        make: type[M],
        batch_cls: type[BatchBase[M]],
        concurrency: int,
        idempotent_checker: object,
        options: ListenerKeywords,
    ) -> Listener[M]:
        """A listener of either SDK: ``options`` are the keywords both take alike (the defaults
        of ``listener``); the blocking SDK's checker is inside its ``handler`` already."""
        subject_bytes(subject)
        check_identifier("consumer group", group)
        start_from = check_start_from(options.get("start_from", "latest"))
        check_int("concurrency", concurrency, 1, 10_000)
        prefetch = options.get("prefetch")
        if prefetch is None:
            prefetch = min(max(_PREFETCH_DEFAULT_MIN, 2 * concurrency), DEFAULT_LIMITS.pull_messages_max)
        check_int("prefetch", prefetch, 1, DEFAULT_LIMITS.pull_messages_max)
        max_retries = options.get("max_retries")
        broadcast = options.get("broadcast", False)
        sub = make_subscription(
            options.get("tags"),
            options.get("tag_type", "or"),
            broadcast,
            self.options.max_retries if max_retries is None else max_retries,
            options.get("retry_backoff"),
            options.get("ordered", False),
        )
        if sub.ordered and not options.get("auto_ack", True):
            raise ConfigError(
                "ordered=True needs auto_ack=True: a key's next message runs once its handler returned "
                "(raise to fail a message)"
            )
        behaviour = ListenerBehaviour.make(
            options.get("consume_most_once", False),
            options.get("auto_ack", True),
            idempotent_checker,
            options.get("filters", ()),
            broadcast,
        )
        if self._state in ("closing", "closed"):
            raise QmqError("this consumer is closed; make a new one")
        main, retry = self._pullers(subject, group, start_from, make, batch_cls, sub)
        listener_cls = OrderedListener if sub.ordered else Listener
        listener: Listener[M] = listener_cls(
            subject,
            group,
            handler,
            main,
            retry,
            self._fail_message,
            start_from=start_from,
            concurrency=concurrency,
            prefetch=prefetch,
            behaviour=behaviour,
        )
        self._listeners.append(listener)
        if self._state == "open":
            listener.start()
        return listener

    async def _fail_message(self, m: ReceivedBase, exc: BaseException | None) -> None:
        """Re-send ``m`` to its retry subject or its dead letters, then ack it (qmq.client.failure)."""
        producer = self._producer
        if producer is None:
            raise QmqError("the consumer is not started")
        await self._failures.fail(producer, m, exc)

    def _lag_pairs(self) -> list[tuple[str, str]]:
        return [(listener.subject, listener.group) for listener in self._listeners if listener.running]

    async def _flush_loop(self) -> None:
        interval_s = self.options.ack_flush_ms / 1000
        while True:
            await asyncio.sleep(interval_s)  # the ack flush period, not a readiness wait
            await self._flush_acks()

    async def flush_acks(self) -> None:
        """Send every pending acknowledgement now and wait until the brokers answered: an answered
        ack survives a broker failover (the broker answers once its slave has it) and a power
        loss (once it is fsynced). Acks whose request got no answer (a broker away, a timeout)
        are kept for the next flush without an error: ``acks_undelivered`` says so afterwards."""
        async with self._ack_flushing:  # after a flush in flight: what it could not deliver goes now
            await flush_acks_together(self._ctx)

    @property
    def acks_pending(self) -> bool:
        """Whether an acknowledgement (``m.ack()``) has not reached its broker yet."""
        return any(t.pending for p in self._ctx.pullers for t in p.trackers.values())

    @property
    def acks_undelivered(self) -> bool:
        """Whether a flush took acknowledgements it could not deliver (a broker away, or one that
        had not replicated them yet): they wait for the next flush. Acks made since the last
        flush do not count, so after ``flush_acks`` returned False means every ack made before
        it started reached its broker."""
        return any(t.requeued for p in self._ctx.pullers for t in p.trackers.values())

    @property
    def acks_unheld(self) -> int:
        """How many acknowledged messages their broker said it never handed out to this consumer:
        they were pulled from a master since replaced by its slave (or a power loss on the broker
        undid the pull), so those acks did nothing and the messages are delivered again. A count
        since the consumer started; each time is also logged as a warning."""
        return sum(t.unheld for p in self._ctx.pullers for t in p.trackers.values())

    async def _flush_acks(self) -> None:
        try:
            async with self._ack_flushing:
                await flush_acks_together(self._ctx)
        except QmqError as exc:  # the acks stay pending, or were logged as refused
            log.debug("flushing acks: %s", exc)
        except Exception:  # a bug must not stop the flushes
            log.exception("flushing acks failed")

    async def close(self) -> None:
        """Stop listeners (handlers running finish, up to ``close_timeout_ms``), send the last acks."""
        if self._state in ("closing", "closed"):
            return
        if self._state == "new":
            self._state = "closed"
            return
        self._state = "closing"
        timeout_s = self.connect_options.close_timeout_ms / 1000
        await asyncio.gather(*(listener.stop(timeout_s) for listener in self._listeners))
        for task in (self._flusher, self._lag_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._flush_acks()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await leave_ordered(self._ctx, self._ctx.pullers)  # its slots go to the others now
        if self._producer is not None:
            await self._producer.close()
        self._ctx.closed = True
        for puller in self._ctx.pullers:
            for tracker in puller.trackers.values():
                tracker.closed = True
        if self._ctx.meta is not None:
            await self._ctx.meta.close()
        if self._ctx.pool is not None:
            await self._ctx.pool.close()
        self._state = "closed"

    @property
    def listeners(self) -> list[Listener[Any]]:
        return list(self._listeners)

    @property
    def errors(self) -> list[str]:
        """Why listeners stopped on their own (each also logged as critical); empty while all run."""
        return [listener.error for listener in self._listeners if listener.error is not None]
