"""Quotas set at run time, fetched from the meta server (``GET /meta/limits``, qmq.meta.limits)
every ``POLL_S`` (0.4 s) by a broker or delay server with an auth file, and handed to its auth gate,
which applies them on top of the auth file's. A meta server that cannot be asked leaves the
last rows in force; a row that cannot be read is logged and skipped."""

from __future__ import annotations

import logging
from collections.abc import Callable
from ssl import SSLContext

from qmq.auth.permissions import parse_consume_patterns
from qmq.auth.quotas import Quota, QuotaRule
from qmq.common.errors import ConfigError
from qmq.serving.meta_poll import MetaPoller

log = logging.getLogger(__name__)

POLL_S = 0.4  # a change holds within a second, as the group controls
_ROWS_MAX = 10_000


def rules_of(rows: object) -> dict[str, tuple[QuotaRule, ...]]:
    """The quota rules of ``GET /meta/limits`` rows, by app."""
    out: dict[str, list[QuotaRule]] = {}
    if not isinstance(rows, list):
        return {}
    for row in rows[:_ROWS_MAX]:
        try:
            if not isinstance(row, dict) or not isinstance(row.get("app"), str):
                raise ConfigError(f"not a limit row: {row!r}")
            [pattern] = parse_consume_patterns([row.get("pattern")], f"limit of app {row['app']!r}")
            quota = Quota(
                float(row.get("produce_msgs_per_s", 0)),
                float(row.get("produce_bytes_per_s", 0)),
                float(row.get("consume_msgs_per_s", 0)),
            )
        except (ConfigError, TypeError, ValueError) as exc:
            log.warning("skipping a limit of the meta server: %s", exc)
            continue
        out.setdefault(row["app"], []).append(QuotaRule(pattern, quota))
    return {app: tuple(rules) for app, rules in out.items()}


class LimitsPoller(MetaPoller):
    def __init__(
        self,
        meta_server: str,
        on_rules: Callable[[dict[str, tuple[QuotaRule, ...]]], None],
        authorization: str | None,
        ssl: SSLContext | None,
    ) -> None:
        super().__init__(
            meta_server, "/meta/limits", "the limits", lambda doc: on_rules(rules_of(doc.get("limits"))),
            authorization, ssl, POLL_S,
        )  # fmt: skip
