"""The keyword arguments of ``add_listener`` (and the blocking ``listener``), typed once for both
SDKs so that mypy and IDEs check them: ``**options: Unpack[AsyncListenerKeywords]``.

What each keyword does and its default: ``qmq.aio.Consumer.listener``. The two SDKs differ
in two keywords: the blocking SDK's ``concurrency`` defaults to its ``listener_threads``, and
its ``idempotent_checker`` is called (``run``) where the asyncio SDK's is awaited
(``run_async``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from qmq.client.options import StartFrom, TagType
from qmq.common.errors import ConfigError

if TYPE_CHECKING:  # the checkers live above the SDK (qmq.idempotency); only their shape is needed here
    from qmq.idempotency.base import AsyncIdempotentChecker, IdempotentChecker


class ListenerKeywords(TypedDict, total=False):
    """The keywords both SDKs' listeners take alike."""

    start_from: StartFrom
    prefetch: int | None
    tags: Sequence[str] | None
    tag_type: TagType
    broadcast: bool
    consume_most_once: bool
    max_retries: int | None
    retry_backoff: Sequence[float] | None
    auto_ack: bool
    filters: Sequence[Any]
    ordered: bool


class AsyncListenerKeywords(ListenerKeywords, total=False):
    """The keywords of ``qmq.aio.Consumer.add_listener``."""

    concurrency: int
    idempotent_checker: AsyncIdempotentChecker | None


class BlockingListenerKeywords(ListenerKeywords, total=False):
    """The keywords of ``qmq.Consumer.listener`` and ``qmq.Consumer.add_listener``."""

    concurrency: int | None
    idempotent_checker: IdempotentChecker | None


# every keyword each takes (all optional: total=False)
ASYNC_LISTENER_KEYS: frozenset[str] = AsyncListenerKeywords.__optional_keys__
BLOCKING_LISTENER_KEYS: frozenset[str] = BlockingListenerKeywords.__optional_keys__


def check_keywords(where: str, options: Mapping[str, object], known: frozenset[str]) -> None:
    """ConfigError naming any of ``options`` not ``known`` (mypy catches them in typed code;
    this catches them in the rest)."""
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown keyword(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
