"""Consumer groups' transforms (``qmq group transform``, qmq.meta.controls): a JMESPath
expression per (subject, group) whose result is the body the group's HTTP consumers get — the
gateway's pulls and the group's push subscription.

The gateway asks the meta server for them (``GET /meta/controls``) every ``POLL_S``, so a change
holds within a second; a meta server that cannot be asked leaves the last ones in force. Each is
compiled once, when it first comes or changes, and evaluated with the filter's code and bounds
(qmq.common.filter_expr). A message it cannot be evaluated over is not delivered: the caller
nacks it with ``DeadLetterNow``, so the SDK puts it in the group's dead letters at once with the
reason as its last error.
"""

from __future__ import annotations

import logging
from ssl import SSLContext
from typing import Any, Final

from qmq.aio import ReceivedMessage
from qmq.common.errors import DeadLetterNow
from qmq.common.filter_expr import (
    FilterExprError,
    UnevaluableError,
    compile_filter,
    evaluate,
    needs_body,
    result_json,
)
from qmq.serving.meta_poll import MetaPoller

log = logging.getLogger(__name__)

POLL_S: Final = 0.4  # a change holds within a second, as for the brokers' filters
_ROWS_MAX: Final = 10_000


class Transform:
    """One group's expression, compiled once."""

    __slots__ = ("_compiled", "_needs_body", "expr")

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self._compiled: Any = compile_filter(expr, "transform")
        self._needs_body = needs_body(expr)

    def body_of(self, m: ReceivedMessage) -> bytes:
        """The transformed body of ``m`` (JSON text); DeadLetterNow with the reason when it cannot be."""
        try:
            result = evaluate(self._compiled, m.properties, m.tags, m.body if self._needs_body else None)
            return result_json(result)
        except (UnevaluableError, ValueError) as exc:
            raise DeadLetterNow(f"the group's transform {self.expr!r} cannot evaluate it: {exc}") from None


class Transforms:
    """The transforms in force, by (subject, group); ``poller`` keeps them current."""

    def __init__(self) -> None:
        self._by_group: dict[tuple[str, str], Transform] = {}
        self.poller: MetaPoller | None = None

    def of(self, subject: str, group: str) -> Transform | None:
        """The transform of ``group`` of ``subject`` (the user subject: its retry subject's messages are its)."""
        return self._by_group.get((subject, group))

    def apply(self, rows: object) -> None:
        """Take ``[[subject, group, expr], ...]``, reusing compiled ones that did not change; bad rows skipped."""
        out: dict[tuple[str, str], Transform] = {}
        if isinstance(rows, list):
            for row in rows[:_ROWS_MAX]:
                if not (isinstance(row, list) and len(row) == 3 and all(isinstance(x, str) and x for x in row)):
                    log.warning("skipping a group transform of the meta server: %r", row)
                    continue
                subject, group, expr = row
                old = self._by_group.get((subject, group))
                if old is not None and old.expr == expr:
                    out[(subject, group)] = old
                    continue
                try:
                    out[(subject, group)] = Transform(expr)
                except FilterExprError as exc:
                    log.warning("skipping the transform of group %r of %r: %s", group, subject, exc)
        self._by_group = out

    def poll(self, meta_server: str, authorization: str | None, ssl: SSLContext | None) -> MetaPoller:
        self.poller = MetaPoller(
            meta_server,
            "/meta/controls",
            "the group transforms",
            lambda doc: self.apply(doc.get("transforms", [])),
            authorization,
            ssl,
            POLL_S,
        )
        return self.poller

    async def start(self) -> None:
        if self.poller is not None:
            self.poller.start()

    async def stop(self) -> None:
        if self.poller is not None:
            await self.poller.stop()
