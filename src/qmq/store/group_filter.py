"""A consumer group's server-side filter (qmq.common.filter_expr) in the shape of a tag filter
(qmq.store.tags), so the store's scan for tags serves it: a message it does not match is passed
over, the group's pull offset moves past it, it counts as consumed for that group and never
crosses the wire.

A message the expression cannot be evaluated over (a body that is not JSON or larger than
``BODY_BYTES_MAX``, an evaluation error) does not match; the filter counts them and logs the
first and every 1000th.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Final

from jmespath.exceptions import JMESPathError

from qmq.common.filter_expr import compile_filter, truthy
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.message import decode_message, decode_properties
from qmq.protocol.record import RECORD_HEADER_BYTES
from qmq.store.tags import RecordFilter

log = logging.getLogger(__name__)

BODY_BYTES_MAX: Final = 256 * 1024  # a body the filter parses as JSON: bounds its cost


class GroupFilter:
    """``expr`` compiled once; ``also`` a tag filter the message must pass as well."""

    __slots__ = ("_compiled", "_needs_body", "also", "expr", "unevaluable")

    def __init__(self, expr: str, also: RecordFilter | None = None) -> None:
        self.expr = expr
        self._compiled: Any = compile_filter(expr)
        self._needs_body = "body" in expr  # a filter over properties and tags never parses bodies
        self.also = also
        self.unevaluable = 0

    def with_tags(self, tags: RecordFilter | None) -> GroupFilter:
        if tags is None:
            return self
        out = GroupFilter.__new__(GroupFilter)
        out.expr, out._compiled, out._needs_body, out.also, out.unevaluable = (
            self.expr,
            self._compiled,
            self._needs_body,
            tags,
            0,
        )
        return out

    def maybe(self, bloom: int) -> bool:
        return self.also is None or self.also.maybe(bloom)

    def matches_record(self, record: bytes | memoryview, pos: int = 0) -> bool:
        if self.also is not None and not self.also.matches_record(record, pos):
            return False
        try:
            m = decode_message(bytes(record), pos + RECORD_HEADER_BYTES)
            body: object = None
            if self._needs_body:
                if len(m.body) > BODY_BYTES_MAX:
                    raise ValueError(f"its body has {len(m.body)} bytes; a filter parses at most {BODY_BYTES_MAX}")
                body = json.loads(m.body)
            doc = {"properties": decode_properties(m.properties_raw), "tags": m.tags, "body": body}
            return truthy(self._compiled.search(doc))
        except (RemoteProtocolError, ValueError, JMESPathError, RecursionError, TypeError) as exc:
            self.unevaluable += 1
            if self.unevaluable == 1 or self.unevaluable % 1000 == 0:
                log.warning(
                    "filter %r cannot evaluate a message (%d so far), passed over: %s", self.expr, self.unevaluable, exc
                )
            return False
