"""Consumer groups' server-side expressions: filters and transforms, both JMESPath (the
``jmespath`` package, pure functions over JSON: no loops, no calls out, no ``eval``), checked when
an operator sets them (by the meta server), compiled once per group where they run (a filter on
the brokers, qmq.store.group_filter; a transform on the gateways, qmq.gateway.transforms), and
evaluated with the same bounds over the same document:

    {"properties": {...}, "tags": [...], "body": <the body parsed as JSON>}

A message matches a filter when the expression gives a true value in JMESPath's sense: anything
but ``false``, ``null`` and an empty string, list or object. A transform's result is the new body.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

EXPR_CHARS_MAX: Final = 4096
BODY_BYTES_MAX: Final = 256 * 1024  # a body an expression parses as JSON: bounds its cost
RESULT_BYTES_MAX: Final = 1024 * 1024  # a transform's result, as JSON text
# One evaluation's bounds: JMESPath has no loops, but short expressions can still double a list
# or a string at each step ("[@,@][]" repeated, join): steps, the size of any value made, and time
EVAL_STEPS_MAX: Final = 100_000  # nodes of the expression visited, over every value
EVAL_VALUE_ITEMS_MAX: Final = BODY_BYTES_MAX  # items of a list or object, characters of a string
EVAL_MS_MAX: Final = 100  # wall-clock time: a thousand times what a filter of a few terms takes


class FilterExprError(ValueError):
    """An expression that cannot be a filter or transform; the text says where it is wrong."""


class UnevaluableError(ValueError):
    """A message an expression cannot be evaluated over; the text says why."""


def compile_filter(expr: object, what: str = "filter") -> Any:
    """The compiled expression; FilterExprError naming the position of what is wrong (``what``:
    "filter" or "transform", for the text)."""
    # imported here: jmespath comes with the servers (qmq[server]), and qmq.common is also the client's
    import jmespath
    from jmespath.exceptions import JMESPathError, ParseError

    if not isinstance(expr, str) or not expr.strip():
        raise FilterExprError(f"a {what} must be a non-empty JMESPath expression, got {expr!r}")
    if len(expr) > EXPR_CHARS_MAX:
        raise FilterExprError(f"the {what} has {len(expr)} characters; the limit is {EXPR_CHARS_MAX}")
    try:
        return jmespath.compile(expr)
    except ParseError as exc:
        at = exc.lex_position
        near = f" near {exc.token_value!r}" if exc.token_value not in (None, "") else ""
        kind = "incomplete expression" if "Incomplete" in type(exc).__name__ else "syntax error"
        raise FilterExprError(f"invalid {what} {expr!r}: {kind} at position {at}{near}") from None
    except (JMESPathError, RecursionError) as exc:
        raise FilterExprError(f"invalid {what} {expr!r}: {exc}") from None


def needs_body(expr: str) -> bool:
    """Whether ``expr`` may read the body: one over properties and tags never parses bodies."""
    return "body" in expr


def evaluate(compiled: Any, properties: Mapping[str, Any], tags: Sequence[str], body: bytes | None) -> Any:
    """``compiled`` over a message (``body`` None: not parsed); UnevaluableError saying why not."""
    from jmespath.exceptions import JMESPathError

    try:
        doc: object = None
        if body is not None:
            if len(body) > BODY_BYTES_MAX:
                raise UnevaluableError(f"its body has {len(body)} bytes; an expression parses at most {BODY_BYTES_MAX}")
            doc = json.loads(body)
        return _bounded_interpreter()(time.monotonic_ns() + EVAL_MS_MAX * 1_000_000).visit(
            compiled.parsed, {"properties": dict(properties), "tags": list(tags), "body": doc}
        )
    except UnevaluableError:
        raise
    except (ValueError, JMESPathError, RecursionError, TypeError) as exc:
        raise UnevaluableError(str(exc) or type(exc).__name__) from None


_SIZED: Final = frozenset({str, list, dict})


@functools.cache  # made at the first evaluation: jmespath is imported late
def _bounded_interpreter() -> Any:
    """JMESPath's interpreter held to EVAL_STEPS_MAX, EVAL_VALUE_ITEMS_MAX and a deadline."""
    from jmespath.visitor import TreeInterpreter

    class Bounded(TreeInterpreter):  # type: ignore[misc]  # jmespath has no types
        def __init__(self, deadline_ns: int) -> None:
            super().__init__()
            self._steps = 0
            self._deadline_ns = deadline_ns

        def visit(self, node: Any, *args: Any, **kwargs: Any) -> Any:
            self._steps += 1
            if not self._steps & 63:  # the clock every 64 steps: a step is cheap, a read of it is not
                if self._steps > EVAL_STEPS_MAX:
                    raise UnevaluableError(f"it takes more than {EVAL_STEPS_MAX:,} steps of the expression")
                if time.monotonic_ns() > self._deadline_ns:
                    raise UnevaluableError(f"it takes longer than {EVAL_MS_MAX} ms")
            # Visitor.visit's dispatch, inlined: calling super().visit here cost ~50% more per evaluation
            kind = node["type"]
            method = self._method_cache.get(kind)
            if method is None:
                method = self._method_cache[kind] = getattr(self, f"visit_{kind}")
            out = method(node, *args, **kwargs)
            if type(out) in _SIZED and len(out) > EVAL_VALUE_ITEMS_MAX:
                raise UnevaluableError(f"it makes a value of {len(out):,} items; the limit is {EVAL_VALUE_ITEMS_MAX:,}")
            return out

    return Bounded


def result_json(result: object) -> bytes:
    """A transform's result as JSON text; UnevaluableError past ``RESULT_BYTES_MAX``."""
    try:
        text = json.dumps(result, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise UnevaluableError(f"its result is not JSON: {exc}") from None
    if len(text) > RESULT_BYTES_MAX:
        raise UnevaluableError(f"its result has {len(text)} bytes of JSON; the limit is {RESULT_BYTES_MAX}")
    return text


def truthy(value: object) -> bool:
    """JMESPath's truth: false, null and empty strings, lists and objects are false (0 is true)."""
    if value is None or value is False:
        return False
    if isinstance(value, str | list | dict):
        return bool(value)
    return True
