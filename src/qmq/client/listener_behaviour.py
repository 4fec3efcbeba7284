"""What a listener does around its handler: acknowledge on receipt (consume-most-once) or on
return (auto ack), skip what an idempotent checker has seen, and run the user's filters.

Filters are objects with ``pre(message) -> bool`` and ``post(message, exc)``: a ``pre`` that
returns False skips the handler and acknowledges the message; every ``post`` runs after the
handler (``exc`` is what it raised, or None), in reverse order, and never changes the outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from qmq.client.options import check_bool
from qmq.common.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ListenerBehaviour:
    consume_most_once: bool = False
    auto_ack: bool = True
    idempotent_checker: Any = None
    filters: tuple[Any, ...] = ()
    broadcast: bool = False

    @classmethod
    def make(
        cls, consume_most_once: bool, auto_ack: bool, idempotent_checker: Any, filters: Sequence[Any], broadcast: bool
    ) -> ListenerBehaviour:
        check_bool("consume_most_once", consume_most_once)
        check_bool("auto_ack", auto_ack)
        if idempotent_checker is not None and not (
            callable(getattr(idempotent_checker, "run_async", None))
            or callable(getattr(idempotent_checker, "run", None))
        ):
            raise ConfigError(
                f"idempotent_checker={idempotent_checker!r} has no run(message, handler) or run_async(...); "
                "use one of qmq.idempotency's checkers"
            )
        filters = tuple(filters)
        for f in filters:
            if not callable(getattr(f, "pre", None)) or not callable(getattr(f, "post", None)):
                raise ConfigError(f"filter {f!r} needs a pre(message) -> bool and a post(message, exc) method")
        return cls(consume_most_once, auto_ack, idempotent_checker, filters, broadcast)

    def wrap(self, handler: Callable[[Any], Awaitable[object]]) -> Callable[[Any], Awaitable[object]]:
        """The handler as the listener calls it: behind the idempotent checker, if any."""
        checker = self.idempotent_checker
        if checker is None:
            return handler
        run_async = getattr(checker, "run_async", None)
        if run_async is None:
            raise ConfigError(
                f"idempotent_checker {checker!r} has no run_async(); an asyncio listener needs an async-capable checker"
            )

        async def checked(m: Any) -> object:
            return await run_async(m, handler)

        return checked

    def pre(self, m: Any) -> bool:
        for f in self.filters:
            if not f.pre(m):
                return False
        return True

    def post(self, m: Any, exc: BaseException | None) -> None:
        for f in reversed(self.filters):
            try:
                f.post(m, exc)
            except Exception:  # a filter's bug must not change the message's outcome
                log.exception("filter %r failed in post() for message %s", f, getattr(m, "message_id", "?"))
