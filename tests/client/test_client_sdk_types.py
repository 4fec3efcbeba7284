"""The two SDKs' public surface: the blocking one takes the asyncio one's typed keywords (the
signatures compared here, and mypy run over sdk_typing_cases.py, where a wrong keyword must
be an error), both export the same names and every error class, and a blocking call that
runs out of time raises a qmq error that is also a TimeoutError."""

from __future__ import annotations

import inspect
import subprocess
import sys
import threading
import typing
from pathlib import Path

import pytest

import qmq
import qmq.aio
from qmq.client.keywords import AsyncListenerKeywords, BlockingListenerKeywords, ListenerKeywords
from qmq.common import errors
from qmq.idempotency.base import AsyncIdempotentChecker, IdempotentChecker

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
_CHECKERS = {"AsyncIdempotentChecker": AsyncIdempotentChecker, "IdempotentChecker": IdempotentChecker}


def _params(fn: object) -> dict[str, tuple[object, object, object]]:
    """name: (kind, default, annotation as written) of every parameter but self."""
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return {n: (p.kind, p.default, p.annotation) for n, p in sig.parameters.items() if n != "self"}


def test_the_blocking_producer_takes_the_asyncio_producers_keywords() -> None:
    blocking = _params(qmq.Producer.__init__)
    assert blocking == _params(qmq.aio.Producer.__init__)
    assert "send_timeout_ms" in blocking
    assert all(kind is inspect.Parameter.KEYWORD_ONLY for kind, _d, _a in blocking.values())


def test_the_blocking_consumer_takes_the_asyncio_consumers_keywords_and_its_thread_pool() -> None:
    blocking = _params(qmq.Consumer.__init__)
    assert blocking.pop("listener_threads") == (inspect.Parameter.KEYWORD_ONLY, 16, "int")
    assert blocking == _params(qmq.aio.Consumer.__init__)


def test_listeners_of_both_sdks_take_the_same_typed_keywords() -> None:
    asyncio_listener = _params(qmq.aio.Consumer.listener)
    for name in ("subject", "group"):
        del asyncio_listener[name]
    hints = {
        cls: typing.get_type_hints(cls, localns=_CHECKERS)
        for cls in (ListenerKeywords, AsyncListenerKeywords, BlockingListenerKeywords)
    }
    # the decorator of the asyncio SDK spells out what add_listener takes as a TypedDict
    assert set(asyncio_listener) == set(hints[AsyncListenerKeywords])
    listener_hints = typing.get_type_hints(qmq.aio.Consumer.listener, localns=_CHECKERS)
    for name in asyncio_listener:
        assert listener_hints[name] == hints[AsyncListenerKeywords][name], name
    # the two SDKs differ only where the docs say: concurrency's default and the checker's call
    shared = hints[ListenerKeywords]
    assert {k: v for k, v in hints[BlockingListenerKeywords].items() if k in shared} == shared
    assert set(hints[BlockingListenerKeywords]) - set(shared) == {"concurrency", "idempotent_checker"}
    assert hints[BlockingListenerKeywords]["tag_type"] == typing.Literal["or", "and"]
    assert hints[BlockingListenerKeywords]["idempotent_checker"] == IdempotentChecker | None
    assert hints[AsyncListenerKeywords]["idempotent_checker"] == AsyncIdempotentChecker | None
    for fn in (qmq.Consumer.add_listener, qmq.Consumer.listener, qmq.aio.Consumer.add_listener):
        [options] = [p for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        assert "Unpack[" in str(options.annotation), fn


def test_a_wrong_keyword_is_an_error_for_mypy() -> None:
    """sdk_typing_cases.py marks each wrong call with the error mypy must give; --strict makes
    an ignore that is not needed an error too."""
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", str(HERE / "sdk_typing_cases.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_both_sdks_export_the_messages_consumers_and_every_error() -> None:
    error_classes = {
        name: cls
        for name, cls in vars(errors).items()
        if isinstance(cls, type) and issubclass(cls, errors.QmqError) and cls.__module__ == errors.__name__
    }
    assert {"QmqTimeoutError", "AlreadyProcessedError", "SendError"} <= set(error_classes)
    assert sorted(errors.__all__) == sorted(error_classes)
    for module in (qmq, qmq.aio):
        for name, cls in error_classes.items():
            assert getattr(module, name) is cls, (module.__name__, name)
            assert name in module.__all__, (module.__name__, name)
        for name in ("Producer", "Consumer", "Message", "ReceivedMessage", "PullConsumer", "Batch"):
            assert name in module.__all__, (module.__name__, name)
    from qmq.client import received, sync

    assert qmq.ReceivedMessage is sync.ReceivedMessage
    assert qmq.PullConsumer is sync.PullConsumer
    assert qmq.Batch is sync.Batch
    assert qmq.aio.ReceivedMessage is received.ReceivedMessage
    assert qmq.aio.Batch is received.Batch
    assert {"Producer", "ReceivedMessage"} <= set(dir(qmq))


def test_the_timeout_error_is_a_qmq_error_and_a_timeout_error() -> None:
    assert issubclass(qmq.QmqTimeoutError, qmq.QmqError)
    assert issubclass(qmq.QmqTimeoutError, TimeoutError)
    assert qmq.QmqTimeoutError("x").retriable


@pytest.mark.integration
def test_a_blocking_call_held_up_by_a_callback_raises_the_qmq_timeout_error(meta_server: str, subject: str) -> None:
    """A send_async callback that blocks holds the SDK's I/O thread; a blocking flush then
    times out with QmqTimeoutError, caught as the builtin TimeoutError too."""
    holding = threading.Event()
    release = threading.Event()

    def hold(_m: qmq.Message) -> None:
        holding.set()
        release.wait(30)

    with qmq.Producer(app_code="shop", meta_server=meta_server) as producer:
        try:
            producer.send_async(producer.generate_message(subject), on_success=hold)
            assert holding.wait(10)
            with pytest.raises(TimeoutError) as caught:
                producer.flush(timeout_ms=1)
            assert isinstance(caught.value, qmq.QmqTimeoutError)
            assert "Producer.flush did not finish within" in str(caught.value)
            assert "I/O thread is held up" in str(caught.value)
        finally:
            release.set()
        producer.send(producer.generate_message(subject))  # the loop serves again once released


@pytest.mark.integration
def test_a_listener_keyword_that_does_not_exist_is_named_at_run_time_too(meta_server: str, subject: str) -> None:
    async def handle(m: qmq.aio.ReceivedMessage) -> None:
        await m.ack()

    with pytest.raises(qmq.ConfigError, match=r"unknown keyword\(s\) tag_typ; known: .*tag_type"):
        qmq.aio.Consumer(app_code="billing", meta_server=meta_server).add_listener(
            subject,
            "g",
            handle,
            tag_typ="and",  # type: ignore[call-arg]
        )
    with qmq.Consumer(app_code="billing", meta_server=meta_server) as consumer:
        with pytest.raises(qmq.ConfigError, match=r"unknown keyword\(s\) tag_typ; known: .*tag_type"):
            consumer.add_listener(subject, "g", print, tag_typ="and")  # type: ignore[call-arg]
        with pytest.raises(qmq.ConfigError, match="tag_type='xor' is not allowed"):
            consumer.add_listener(subject, "g", print, tag_type="xor")  # type: ignore[arg-type]
