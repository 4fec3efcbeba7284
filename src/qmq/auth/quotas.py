"""Rate limits of an app (DDMQ's producer and consumer quotas), from its table in the auth file:

```toml
[apps.shop.quotas]
"order.*" = { produce_msgs_per_s = 1000, produce_bytes_per_s = 1048576 }
"order.*:billing" = { consume_msgs_per_s = 500 }
```

Each subject (and, for consuming, each subject:group) matching a pattern gets its own bucket
per app; the first pattern that matches applies. A bucket refills at its rate up to a tenth of
a second's worth and may go into debt by one batch, so a batch larger than the bucket still
passes and the rate holds on average; while it is in debt, the next batch waits
(``wait_s``): a send is answered THROTTLED with that wait as its retry-after, a pull is held
back for it. The buckets are bounded (``BUCKETS_MAX``, the least recently used forgotten).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from qmq.auth.permissions import ConsumePattern, parse_consume_patterns
from qmq.common.errors import ConfigError

BUCKETS_MAX = 100_000
BURST_S = 0.1
RATE_MAX = 1e9
_KEYS = ("produce_msgs_per_s", "produce_bytes_per_s", "consume_msgs_per_s")


@dataclass(frozen=True, slots=True)
class Quota:
    """Rates per second; 0 means no limit."""

    produce_msgs_per_s: float = 0.0
    produce_bytes_per_s: float = 0.0
    consume_msgs_per_s: float = 0.0


@dataclass(frozen=True, slots=True)
class QuotaRule:
    pattern: ConsumePattern
    quota: Quota


def parse_quotas(table: object, where: str) -> tuple[QuotaRule, ...]:
    if not isinstance(table, dict):
        raise ConfigError(f'{where} must be a table of "pattern" = {{ produce_msgs_per_s = N, ... }}')
    rules = []
    for text, limits in table.items():
        [pattern] = parse_consume_patterns([text], where)
        if not isinstance(limits, dict):
            raise ConfigError(f"{where}: {text!r} must be a table such as {{ produce_msgs_per_s = 1000 }}")
        unknown = sorted(set(limits) - set(_KEYS))
        if unknown:
            raise ConfigError(f"{where}: {text!r} has unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}")
        values = {}
        for key, value in limits.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= RATE_MAX:
                raise ConfigError(
                    f"{where}: {text!r} {key} = {value!r} must be a number from 0 (no limit) to {RATE_MAX:g}"
                )
            values[key] = float(value)
        rules.append(QuotaRule(pattern, Quota(**values)))
    return tuple(rules)


def quota_for(rules: tuple[QuotaRule, ...], subject: str, group: str | None = None) -> Quota | None:
    """The quota of the first rule matching ``subject`` (a produce) or ``subject``:``group`` (a consume)."""
    for rule in rules:
        if group is None:
            if rule.pattern.subject.matches(subject):
                return rule.quota
        elif rule.pattern.matches(subject, group):
            return rule.quota
    return None


class _Bucket:
    __slots__ = ("at_s", "rate", "tokens")

    def __init__(self, rate: float, now_s: float) -> None:
        self.rate = rate
        self.tokens = rate * BURST_S
        self.at_s = now_s

    def refill(self, now_s: float) -> None:
        self.tokens = min(self.rate * BURST_S, self.tokens + (now_s - self.at_s) * self.rate)
        self.at_s = now_s


class Buckets:
    """Token buckets by key (app, what, subject[, group]), at most ``BUCKETS_MAX``."""

    def __init__(self, buckets_max: int = BUCKETS_MAX) -> None:
        self._buckets: OrderedDict[tuple[str, ...], _Bucket] = OrderedDict()
        self._max = buckets_max

    def _bucket(self, key: tuple[str, ...], rate: float, now_s: float) -> _Bucket:
        b = self._buckets.get(key)
        if b is None or b.rate != rate:  # new, or the rate changed (a reload)
            b = self._buckets[key] = _Bucket(rate, now_s)
            if len(self._buckets) > self._max:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            b.refill(now_s)
        return b

    def wait_s(self, key: tuple[str, ...], rate: float, now_s: float) -> float:
        """How long until the bucket is out of debt (0 when a batch may pass now)."""
        b = self._bucket(key, rate, now_s)
        return 0.0 if b.tokens > 0 else -b.tokens / rate + 1e-3

    def take(self, key: tuple[str, ...], rate: float, amount: float, now_s: float) -> None:
        """Charge ``amount`` (it may leave the bucket in debt)."""
        self._bucket(key, rate, now_s).tokens -= amount

    def __len__(self) -> int:
        return len(self._buckets)
