"""The blocking SDK: ``from qmq import Producer, Consumer, Message`` for code without asyncio.

Each object runs the asyncio SDK on its own background thread with an event loop (uvloop's if installed);
blocking calls hand a coroutine to that loop and wait with a bound. ``send_async`` does not
block: messages are handed over in batches (one loop wake-up for many messages), and a
``concurrent.futures.Future`` resolves when the message is stored. Listener handlers are
plain functions run in a bounded thread pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from datetime import datetime
from ssl import SSLContext
from types import TracebackType
from typing import Any, TypeVar, Unpack

from qmq.client import telemetry
from qmq.client.consumer import Consumer as AsyncConsumer
from qmq.client.delays import PendingDelay
from qmq.client.keywords import BLOCKING_LISTENER_KEYS, BlockingListenerKeywords, check_keywords
from qmq.client.message import Message
from qmq.client.options import (
    DEFAULT_CONNECT,
    DEFAULT_CONSUMER,
    DEFAULT_PRODUCER,
    StartFrom,
    TagType,
    check_int,
)
from qmq.client.producer import Producer as AsyncProducer
from qmq.client.pull_consumer import OrderedPullConsumer, PullConsumerBase, check_pull_args
from qmq.client.received import BatchBase, ReceivedBase
from qmq.client.sender import ProducerStats
from qmq.client.subscription import make_subscription
from qmq.common.errors import ConfigError, QmqError, QmqTimeoutError, SendError
from qmq.common.ordering import OrderMode

__all__ = ["Batch", "Consumer", "Message", "Producer", "PullConsumer", "ReceivedMessage"]

log = logging.getLogger(__name__)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

# Added to every bounded wait for the background loop, on top of the operation's own bound.
_MARGIN_S = 5.0
_JOIN_TIMEOUT_S = 10.0
_NACK_TIMEOUT_S = 60.0
_INVALID_STATE = (asyncio.InvalidStateError, concurrent.futures.InvalidStateError)
LISTENER_THREADS_DEFAULT = 16

_new_event_loop: Callable[[], asyncio.AbstractEventLoop]
try:
    import uvloop

    _new_event_loop = uvloop.new_event_loop
except ModuleNotFoundError:  # `pip install qmq` alone: the SDK needs no extra, asyncio's loop serves
    _new_event_loop = asyncio.new_event_loop


class _IoThread:
    """A daemon thread running one event loop for one SDK object."""

    def __init__(self, name: str) -> None:
        self.loop = _new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the loop and wait for it, at most ``timeout_s``."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(
                "a blocking qmq call was made from a qmq callback (on the SDK's I/O thread), where it "
                "would wait forever; hand the work to another thread"
            )
        what = getattr(coro, "__qualname__", "the qmq call")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except TimeoutError:
            fut.cancel()
            raise QmqTimeoutError(
                f"{what} did not finish within {timeout_s:g} s: the SDK's I/O thread is held up (by a "
                "callback that blocks, say: keep send_async callbacks short)"
            ) from None

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.in_loop_thread():
            self._thread.join(_JOIN_TIMEOUT_S)


class Producer:
    """Sends messages (blocking). ``send`` waits until stored; ``send_async`` returns a future.

    The options are those of ``qmq.aio.Producer``, with the same defaults. Use as a context
    manager or call ``close()``.
    """

    def __init__(
        self,
        *,
        app_code: str,
        meta_server: str,
        buffer_messages_max: int = DEFAULT_PRODUCER.buffer_messages_max,
        buffer_bytes_max: int = DEFAULT_PRODUCER.buffer_bytes_max,
        batch_messages_max: int = DEFAULT_PRODUCER.batch_messages_max,
        batch_bytes_max: int = DEFAULT_PRODUCER.batch_bytes_max,
        max_in_flight: int = DEFAULT_PRODUCER.max_in_flight,
        linger_ms: int = DEFAULT_PRODUCER.linger_ms,
        send_timeout_ms: int = DEFAULT_PRODUCER.send_timeout_ms,
        retry_backoff_ms: int = DEFAULT_PRODUCER.retry_backoff_ms,
        retry_backoff_ms_max: int = DEFAULT_PRODUCER.retry_backoff_ms_max,
        resends: bool = DEFAULT_PRODUCER.resends,
        connect_timeout_ms: int = DEFAULT_CONNECT.connect_timeout_ms,
        meta_timeout_ms: int = DEFAULT_CONNECT.meta_timeout_ms,
        close_timeout_ms: int = DEFAULT_CONNECT.close_timeout_ms,
        secret: str | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        self._async = AsyncProducer(
            app_code=app_code,
            meta_server=meta_server,
            buffer_messages_max=buffer_messages_max,
            buffer_bytes_max=buffer_bytes_max,
            batch_messages_max=batch_messages_max,
            batch_bytes_max=batch_bytes_max,
            max_in_flight=max_in_flight,
            linger_ms=linger_ms,
            send_timeout_ms=send_timeout_ms,
            retry_backoff_ms=retry_backoff_ms,
            retry_backoff_ms_max=retry_backoff_ms_max,
            resends=resends,
            connect_timeout_ms=connect_timeout_ms,
            meta_timeout_ms=meta_timeout_ms,
            close_timeout_ms=close_timeout_ms,
            secret=secret,
            ssl=ssl,
        )
        opts = self._async.options
        self._send_wait_s = 2 * opts.send_timeout_ms / 1000 + _MARGIN_S
        self._close_wait_s = 2 * self._async.connect_options.close_timeout_ms / 1000 + _MARGIN_S
        self._lock = threading.Lock()
        # (subject, encoded, message id, future, order key, order, resend)
        self._handoff: deque[tuple[str, bytes, str, concurrent.futures.Future[None], str | None, OrderMode, bool]] = (
            deque()
        )
        self._handoff_bytes = 0
        self._wake_pending = False
        self._closed = False
        self._io = _IoThread("qmq-producer-io")
        try:
            self._io.call(self._async.start(), self._async.connect_options.meta_timeout_ms / 1000 + _MARGIN_S)
        except BaseException:
            self._io.stop()
            raise

    @property
    def stats(self) -> ProducerStats:
        return self._async.stats

    def generate_message(self, subject: str) -> Message:
        """A new message to ``subject`` with a fresh unique message id."""
        return Message.generate(subject)

    def send(self, message: Message) -> None:
        """Send ``message`` and return once it is stored durably; ``qmq.SendError`` says why not."""
        if self._closed:
            raise SendError("the producer is closed; make a new one")
        if telemetry.enabled:
            # the span begins here, in the caller's thread, under the caller's current span
            record = telemetry.begin_send(message)
            try:
                self._io.call(self._async._send(message), self._send_wait_s)
            except BaseException as exc:
                record.finish(exc)
                raise
            record.finish(None)
            return
        self._io.call(self._async.send(message), self._send_wait_s)

    def send_async(
        self,
        message: Message,
        on_success: Callable[[Message], object] | None = None,
        on_failed: Callable[[Message, BaseException], object] | None = None,
        *,
        resend: bool = False,
    ) -> concurrent.futures.Future[None]:
        """Buffer ``message`` and return at once; the future resolves when it is stored.

        ``on_success(message)`` or ``on_failed(message, error)`` is called on the SDK's I/O
        thread: keep it short and never call a blocking qmq method from it. Raises
        ``qmq.BufferFullError`` at once when the send buffer is full. ``resend=True``: the
        message may have been sent before, so it goes only to the broker group its id picks
        (``qmq.aio.Producer.send_nowait``).
        """
        record = telemetry.begin_send(message) if telemetry.enabled else None
        try:
            fut = self._send_async(message, on_success, on_failed, resend)
        except BaseException as exc:
            if record is not None:
                record.finish(exc)
            raise
        if record is not None:
            fut.add_done_callback(record.finish_future)
        return fut

    def _send_async(
        self,
        message: Message,
        on_success: Callable[[Message], object] | None,
        on_failed: Callable[[Message, BaseException], object] | None,
        resend: bool,
    ) -> concurrent.futures.Future[None]:
        encoded = message.encode()
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        if on_success is not None or on_failed is not None:
            fut.add_done_callback(functools.partial(_call_back, message, on_success, on_failed))
        n = len(encoded)
        with self._lock:
            if self._closed:
                raise SendError("the producer is closed; make a new one", message.message_id)
            # Messages handed over but not yet in the buffer count against its bounds too.
            if not self._async.has_room(n, len(self._handoff), self._handoff_bytes):
                raise self._async.full_error(n, message.message_id)
            self._handoff.append(
                (message.subject, encoded, message.message_id, fut, message.order_key, message.order, resend)
            )
            self._handoff_bytes += n
            wake = not self._wake_pending
            self._wake_pending = True
        if wake:
            self._io.loop.call_soon_threadsafe(self._drain_handoff)
        return fut

    def _drain_handoff(self) -> None:
        with self._lock:
            items, self._handoff = self._handoff, deque()
            self._handoff_bytes = 0
            self._wake_pending = False
        enqueue = self._async.enqueue_encoded
        for subject, encoded, message_id, fut, order_key, order, resend in items:
            if fut.done():
                continue  # cancelled by its caller
            try:
                enqueue(subject, encoded, message_id, fut, order_key=order_key, order=order, resend=resend)
            except QmqError as exc:
                with contextlib.suppress(*_INVALID_STATE):
                    fut.set_exception(exc)

    def cancel_delay(self, message_id: str) -> bool:
        """Cancel the delay message ``message_id``: True when it was pending and will now never be
        delivered, False when it was already handed over or is unknown (``qmq.aio.Producer.cancel_delay``)."""
        if self._closed:
            raise SendError("the producer is closed; make a new one")
        return self._io.call(self._async.cancel_delay(message_id), self._send_wait_s)

    def delay_list(
        self, subject: str, start: datetime | float | None = None, end: datetime | float | None = None, limit: int = 100
    ) -> list[PendingDelay]:
        """The first ``limit`` (1..10,000) delay messages of ``subject`` due in ``[start, end)``
        that no delay group has handed over yet, by due time (``qmq.aio.Producer.delay_pending``)."""
        if self._closed:
            raise SendError("the producer is closed; make a new one")
        return self._io.call(self._async.delay_list(subject, start, end, limit), self._send_wait_s)

    def flush(self, timeout_ms: int | None = None) -> None:
        """Wait until every message sent before this call is stored or failed."""
        limit_ms = self._async.options.send_timeout_ms if timeout_ms is None else timeout_ms
        self._io.call(self._async.flush(limit_ms), limit_ms / 1000 + _MARGIN_S)

    def close(self) -> None:
        """Send what is buffered (up to ``close_timeout_ms``), then stop the I/O thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._io.call(self._async.close(), self._close_wait_s)
        finally:
            self._io.stop()

    def __enter__(self) -> Producer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _call_back(
    message: Message,
    on_success: Callable[[Message], object] | None,
    on_failed: Callable[[Message, BaseException], object] | None,
    fut: concurrent.futures.Future[None],
) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    try:
        if exc is None:
            if on_success is not None:
                on_success(message)
        elif on_failed is not None:
            on_failed(message, exc)
    except Exception:
        log.exception("a send_async callback for message %s raised", message.message_id)


class ReceivedMessage(ReceivedBase):
    """A received message (blocking SDK): read its fields, then ``ack()`` or ``nack()`` it."""

    __slots__ = ()

    def ack(self) -> None:
        """Record it as done; sent to the broker with the next pull or within ``ack_flush_ms``."""
        self._ack_now()

    def nack(self, exc: BaseException | None = None) -> None:
        """Fail it (it comes back with ``times + 1``); returns once the retry copy is stored."""
        tracker = self._tracker
        if self._settled or tracker.on_nack is None or tracker.loop is None:
            return
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is tracker.loop:
                raise RuntimeError("nack() of the blocking SDK was called on the SDK's I/O thread")
        self._settled = True
        fut = asyncio.run_coroutine_threadsafe(tracker.on_nack(self, exc), tracker.loop)
        try:
            fut.result(_NACK_TIMEOUT_S)
        except TimeoutError:
            fut.cancel()
            raise QmqTimeoutError(
                f"nack of message {self.message_id} was not stored on its retry subject within {_NACK_TIMEOUT_S:g} s"
            ) from None


class Batch(BatchBase[ReceivedMessage]):
    """What ``PullConsumer.pull`` returns: a list of ``ReceivedMessage`` with ``ack_all()``."""

    def ack_all(self) -> None:
        """Acknowledge every message of the batch not acknowledged or failed yet."""
        self._ack_all_now()


class PullConsumer:
    """Blocking pulls of one subject as one member of a consumer group."""

    def __init__(self, inner: PullConsumerBase, io: _IoThread, request_timeout_ms: int) -> None:
        self._inner = inner
        self._io = io
        self._request_wait_s = request_timeout_ms / 1000
        self.subject = inner.subject
        self.group = inner.group

    def pull(self, max_messages: int = 100, timeout_ms: int = 1_000) -> Batch:
        """Up to ``max_messages`` messages, waiting up to ``timeout_ms`` for the first (long poll)."""
        max_messages, timeout_ms = check_pull_args(max_messages, timeout_ms)
        wait_s = timeout_ms / 1000 + 2 * self._request_wait_s + _MARGIN_S
        batch = self._io.call(self._inner._pull(max_messages, timeout_ms), wait_s)
        assert isinstance(batch, Batch)
        return batch


class Consumer:
    """Consumes messages (blocking) as one consumer id.

    The options are those of ``qmq.aio.Consumer``, with the same defaults, plus
    ``listener_threads``: the size of the thread pool listener handlers run in.
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
        listener_threads: int = LISTENER_THREADS_DEFAULT,
        secret: str | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        self.listener_threads = check_int("listener_threads", listener_threads, 1, 1024)
        self._async = AsyncConsumer(
            app_code=app_code,
            meta_server=meta_server,
            consumer_id=consumer_id,
            ack_flush_ms=ack_flush_ms,
            max_retries=max_retries,
            request_timeout_ms=request_timeout_ms,
            retry_pull_interval_ms=retry_pull_interval_ms,
            check_crc=check_crc,
            acks_with_pulls=acks_with_pulls,
            connect_timeout_ms=connect_timeout_ms,
            meta_timeout_ms=meta_timeout_ms,
            close_timeout_ms=close_timeout_ms,
            secret=secret,
            ssl=ssl,
        )
        self.consumer_id = self._async.consumer_id
        self._pool = concurrent.futures.ThreadPoolExecutor(listener_threads, thread_name_prefix="qmq-listener")
        self._close_wait_s = 2 * self._async.connect_options.close_timeout_ms / 1000 + _MARGIN_S
        self._closed = False
        self._io = _IoThread("qmq-consumer-io")
        try:
            self._io.call(self._async.start(), self._async.connect_options.meta_timeout_ms / 1000 + _MARGIN_S)
        except BaseException:
            self._io.stop()
            self._pool.shutdown(wait=False)
            raise

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
        """A pull consumer of ``subject`` in consumer ``group`` (see ``qmq.aio.Consumer.pull_consumer``;
        with ``ordered``, at most one unsettled message per order key)."""
        sub = make_subscription(
            tags,
            tag_type,
            broadcast,
            self._async.options.max_retries if max_retries is None else max_retries,
            retry_backoff,
            ordered,
        )
        cls = OrderedPullConsumer if ordered else PullConsumerBase
        inner = self._async._pull_consumer(subject, group, start_from, ReceivedMessage, Batch, cls, sub)
        return PullConsumer(inner, self._io, self._async.options.request_timeout_ms)

    def listener(self, subject: str, group: str, **options: Unpack[BlockingListenerKeywords]) -> Callable[[F], F]:
        """Decorate a plain ``handler(message)`` called for every message of ``subject``.

        Handlers run in the consumer's thread pool (``listener_threads``), at most
        ``concurrency`` at once (default: all the pool's threads). Returning acknowledges the
        message; raising fails it (it comes back after the back-off, with ``times + 1``).
        The keywords of ``qmq.aio.Consumer.listener`` apply: ``start_from``, ``prefetch``,
        ``tags``, ``tag_type``, ``broadcast``, ``consume_most_once``, ``max_retries``,
        ``retry_backoff``, ``auto_ack``, ``idempotent_checker`` (its blocking ``run``, in the
        handler's thread), ``filters`` and ``ordered`` (one message of an order key at a time, in
        send order, retried in place: docs/ordered.md).
        """

        def register(handler: F) -> F:
            if not callable(handler):
                raise ConfigError(f"listener handler {handler!r} is not callable")
            self.add_listener(subject, group, handler, **options)
            return handler

        return register

    def add_listener(
        self,
        subject: str,
        group: str,
        handler: Callable[[ReceivedMessage], object],
        **options: Unpack[BlockingListenerKeywords],
    ) -> None:
        """The same as ``@listener(...)`` without the decorator, with the same keywords."""
        check_keywords("add_listener", options, BLOCKING_LISTENER_KEYS)
        loop = self._io.loop
        pool = self._pool
        checker = options.get("idempotent_checker")
        if checker is not None and not callable(getattr(checker, "run", None)):
            raise ConfigError(f"idempotent_checker={checker!r} has no run(message, handler); use qmq.idempotency's")
        call: Callable[[ReceivedMessage], object] = (
            handler if checker is None else functools.partial(checker.run, handler=handler)
        )
        concurrency = options.get("concurrency")

        async def run(m: ReceivedMessage) -> None:
            # in the caller's context: the handler sees the listener's process span as current
            await loop.run_in_executor(pool, contextvars.copy_context().run, call, m)

        async def add() -> None:
            self._async._add_listener(
                subject,
                group,
                run,
                ReceivedMessage,
                Batch,
                self.listener_threads if concurrency is None else concurrency,
                None,  # the checker runs inside the handler, in the handler's thread
                options,
            )

        self._io.call(add(), _MARGIN_S)

    @property
    def errors(self) -> list[str]:
        """Why listeners stopped on their own (each also logged as critical); empty while all run."""
        return self._async.errors

    @property
    def acks_unheld(self) -> int:
        """How many acknowledged messages their broker said it never handed out to this consumer
        (pulled from a master since replaced): those acks did nothing and the messages come again."""
        return self._async.acks_unheld

    def flush_acks(self) -> None:
        """Send every pending acknowledgement now and wait until the brokers answered."""
        self._io.call(self._async.flush_acks(), 2 * self._async.options.request_timeout_ms / 1000 + _MARGIN_S)

    def close(self) -> None:
        """Stop listeners (running handlers finish, up to ``close_timeout_ms``), send the last acks."""
        if self._closed:
            return
        self._closed = True
        try:
            self._io.call(self._async.close(), self._close_wait_s)
        finally:
            self._io.stop()
            # Handlers still running past close_timeout_ms are not waited for (bounded close).
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
