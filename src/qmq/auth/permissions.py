"""What an app may do: the actions, subject patterns and the check itself.

A pattern is a shell-style glob matched against the whole name (``order.*``, ``*``); a consume
pattern may name the consumer groups too, after the last ``:`` (``order.*:billing``), and
without one it allows every group. Retry and dead-letter subjects
(``%RETRY%<subject>%<group>``) belong to their group: producing to them (a consumer handing a
failed message back) and pulling them both need consume permission for ``<subject>:<group>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import translate

from qmq.common.errors import ConfigError, InvalidSubjectError
from qmq.common.naming import DEAD_PREFIX, RETRY_PREFIX, parse_internal_subject


class Action(StrEnum):
    PRODUCE = "produce"
    CONSUME = "consume"
    # reset-offset, dead letters, promote, cluster and route changes
    ADMIN = "admin"
    # what only the servers of the cluster do: register, heartbeat, replicate, hand over delay messages
    CLUSTER = "cluster"


PATTERNS_MAX = 1000
PATTERN_CHARS_MAX = 400


@dataclass(frozen=True, slots=True)
class Pattern:
    text: str
    regex: re.Pattern[str]

    @classmethod
    def compile(cls, text: str) -> Pattern:
        return cls(text, re.compile(translate(text)))

    def matches(self, name: str) -> bool:
        return self.regex.match(name) is not None


@dataclass(frozen=True, slots=True)
class ConsumePattern:
    subject: Pattern
    group: Pattern | None  # None: every group

    def matches(self, subject: str, group: str | None) -> bool:
        if not self.subject.matches(subject):
            return False
        if self.group is None:
            return True
        # a request that names no group (a subject's lag, say) needs a pattern open to every group
        return group is not None and self.group.matches(group)


def parse_patterns(values: object, where: str) -> tuple[Pattern, ...]:
    return tuple(Pattern.compile(text) for text in _pattern_texts(values, where))


def parse_consume_patterns(values: object, where: str) -> tuple[ConsumePattern, ...]:
    out = []
    for text in _pattern_texts(values, where):
        subject, sep, group = text.rpartition(":")
        if not sep:
            out.append(ConsumePattern(Pattern.compile(text), None))
        elif not subject or not group:
            raise ConfigError(
                f"{where}: pattern {text!r} has an empty subject or group around ':'; write subject:group"
            )
        else:
            out.append(ConsumePattern(Pattern.compile(subject), Pattern.compile(group)))
    return tuple(out)


def _pattern_texts(values: object, where: str) -> list[str]:
    if not isinstance(values, list):
        raise ConfigError(f'{where} must be a list of subject patterns, such as ["order.*"]; got {values!r}')
    if len(values) > PATTERNS_MAX:
        raise ConfigError(f"{where} has {len(values)} patterns; the limit is {PATTERNS_MAX}")
    for text in values:
        if not isinstance(text, str) or not text or len(text) > PATTERN_CHARS_MAX:
            raise ConfigError(
                f"{where}: pattern {text!r} must be a non-empty string of at most {PATTERN_CHARS_MAX} characters"
            )
    return list(values)


@dataclass(frozen=True, slots=True)
class Grants:
    """What one app is allowed."""

    produce: tuple[Pattern, ...] = ()
    consume: tuple[ConsumePattern, ...] = ()
    admin: bool = False
    cluster: bool = False

    def allows(self, action: Action, subject: str | None = None, group: str | None = None) -> bool:
        """Whether ``action`` on ``subject`` (and ``group``) is allowed; the cluster's own identity may do anything."""
        if self.cluster:
            return True
        if action is Action.ADMIN:
            return self.admin
        if action is Action.CLUSTER:
            return False
        if subject is None:
            return False
        if subject.startswith((RETRY_PREFIX, DEAD_PREFIX)):
            try:
                _kind, subject, group = parse_internal_subject(subject)
            except InvalidSubjectError:
                return False
            return any(p.matches(subject, group) for p in self.consume)
        if action is Action.PRODUCE:
            return any(p.matches(subject) for p in self.produce)
        return any(p.matches(subject, group) for p in self.consume)
