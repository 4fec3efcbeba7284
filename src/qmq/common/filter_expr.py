"""Server-side filters of consumer groups: JMESPath expressions (the ``jmespath`` package, pure
functions over JSON: no loops, no calls out, no ``eval``) checked when an operator sets them (by
the meta server) and compiled once per group by the brokers (qmq.store.group_filter).

A message matches when the expression, evaluated over ``{"properties": {...}, "tags": [...],
"body": <the JSON body>}``, gives a true value in JMESPath's sense: anything but ``false``,
``null`` and an empty string, list or object.
"""

from __future__ import annotations

from typing import Any, Final

EXPR_CHARS_MAX: Final = 4096


class FilterExprError(ValueError):
    """An expression that cannot be a filter; the text says where it is wrong."""


def compile_filter(expr: object) -> Any:
    """The compiled expression; FilterExprError naming the position of what is wrong."""
    # imported here: jmespath comes with the servers (qmq[server]), and qmq.common is also the client's
    import jmespath
    from jmespath.exceptions import JMESPathError, ParseError

    if not isinstance(expr, str) or not expr.strip():
        raise FilterExprError(f"a filter must be a non-empty JMESPath expression, got {expr!r}")
    if len(expr) > EXPR_CHARS_MAX:
        raise FilterExprError(f"the filter has {len(expr)} characters; the limit is {EXPR_CHARS_MAX}")
    try:
        return jmespath.compile(expr)
    except ParseError as exc:
        at = exc.lex_position
        near = f" near {exc.token_value!r}" if exc.token_value not in (None, "") else ""
        what = "incomplete expression" if "Incomplete" in type(exc).__name__ else "syntax error"
        raise FilterExprError(f"invalid filter {expr!r}: {what} at position {at}{near}") from None
    except (JMESPathError, RecursionError) as exc:
        raise FilterExprError(f"invalid filter {expr!r}: {exc}") from None


def truthy(value: object) -> bool:
    """JMESPath's truth: false, null and empty strings, lists and objects are false (0 is true)."""
    if value is None or value is False:
        return False
    if isinstance(value, str | list | dict):
        return bool(value)
    return True
