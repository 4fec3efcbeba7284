"""The control-plane records a broker applies (``GET /meta/controls``, qmq.meta.controls), asked
for every ``POLL_S``: the paused groups and the groups' filters. A pull of a paused group answers nothing (a long poll
waits, parked), acks still count, so nothing is lost and progress is kept; on resume its parked
pulls are tried at once. A group's retry subject is paused with it. A meta server that cannot be
asked leaves the last records in force.

A group's filter (qmq.store.group_filter) is compiled once, when it first comes or changes, and
applied to the group's pulls of the subject (not of its retry subject, which holds only messages
that passed it; not to ordered groups, which take by slot and never scan).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from ssl import SSLContext
from typing import Any

from qmq.common.filter_expr import FilterExprError
from qmq.common.naming import retry_subject
from qmq.serving.meta_poll import MetaPoller
from qmq.store.group_filter import GroupFilter

log = logging.getLogger(__name__)

POLL_S = 0.4  # a resume holds within a second
_PAUSED_MAX = 10_000

Paused = frozenset[tuple[str, str]]
Filters = dict[tuple[str, str], GroupFilter]


def paused_of(rows: object) -> Paused:
    """The (subject, group) pairs a broker holds back, the retry subjects included; bad rows skipped."""
    out: set[tuple[str, str]] = set()
    if not isinstance(rows, list):
        return frozenset()
    for row in rows[:_PAUSED_MAX]:
        if isinstance(row, list) and len(row) == 2 and all(isinstance(x, str) and x for x in row):
            subject, group = row
            out.add((subject, group))
            out.add((retry_subject(subject, group), group))
        else:
            log.warning("skipping a paused group of the meta server: %r", row)
    return frozenset(out)


def filters_of(rows: object, before: Filters) -> Filters:
    """The groups' filters from ``[[subject, group, expr], ...]``, reusing ``before``'s compiled
    ones whose expression did not change; bad rows skipped."""
    out: Filters = {}
    if not isinstance(rows, list):
        return out
    for row in rows[:_PAUSED_MAX]:
        if not (isinstance(row, list) and len(row) == 3 and all(isinstance(x, str) and x for x in row)):
            log.warning("skipping a group filter of the meta server: %r", row)
            continue
        subject, group, expr = row
        old = before.get((subject, group))
        if old is not None and old.expr == expr:
            out[(subject, group)] = old
            continue
        try:
            out[(subject, group)] = GroupFilter(expr)
        except FilterExprError as exc:
            log.warning("skipping the filter of group %r of %r: %s", group, subject, exc)
    return out


class ControlsPoller(MetaPoller):
    def __init__(
        self,
        meta_server: str,
        on_paused: Callable[[Paused], None],
        on_filters: Callable[[object], None],
        authorization: str | None,
        ssl: SSLContext | None,
    ) -> None:
        def on_doc(doc: dict[str, Any]) -> None:
            on_paused(paused_of(doc.get("paused")))
            on_filters(doc.get("filters", []))

        super().__init__(meta_server, "/meta/controls", "the group controls", on_doc, authorization, ssl, POLL_S)
