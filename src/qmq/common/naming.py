"""Subjects and consumer groups: what a valid name is, the reserved retry and dead-letter
names, and how a name becomes a file name (always escaped, never used as is).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

from qmq.common.errors import InvalidSubjectError
from qmq.common.limits import DEFAULT_LIMITS, Limits

RETRY_PREFIX = "%RETRY%"
DEAD_PREFIX = "%DEAD_RETRY%"

# C0 and C1 control characters too: a name is shown in logs and terminals.
_FORBIDDEN = re.compile(r"[\s/%\x00-\x1f\x7f-\x9f]")
# Unicode categories a name must not hold: controls, format characters (zero-width space,
# bidi overrides), surrogates, private use, unassigned, and separators. Two names that look
# the same must be the same name.
_INVISIBLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zs", "Zl", "Zp"})


def check_name(kind: str, name: object, limits: Limits = DEFAULT_LIMITS) -> str:
    """Validate a user subject or group name; return it. ``kind`` is "subject" or "consumer group"."""
    if not isinstance(name, str):
        raise InvalidSubjectError(f"{kind} must be a string, got {type(name).__name__} {name!r}")
    if not name:
        raise InvalidSubjectError(f"{kind} must not be empty")
    if len(name) > limits.subject_chars_max:
        raise InvalidSubjectError(
            f"{kind} {name[:40]!r}… has {len(name)} characters; the limit is {limits.subject_chars_max}"
        )
    bad = _FORBIDDEN.search(name)
    if bad:
        what = "%" if bad.group() == "%" else repr(bad.group())
        hint = " (% is reserved for retry and dead-letter subjects)" if bad.group() == "%" else ""
        raise InvalidSubjectError(
            f"{kind} {name!r} contains {what} at position {bad.start()}; "
            f"use letters, digits and punctuation without whitespace, '/' or '%'{hint}"
        )
    if not name.isascii():
        for i, ch in enumerate(name):
            if unicodedata.category(ch) in _INVISIBLE:
                raise InvalidSubjectError(
                    f"{kind} {name!r} contains U+{ord(ch):04X} ({unicodedata.name(ch, 'unnamed')}) at position {i}, "
                    "a character that cannot be seen or typed reliably; use visible characters only"
                )
    return name


def check_subject(subject: object, limits: Limits = DEFAULT_LIMITS) -> str:
    """A subject a producer may send to: a user subject, or a retry/dead-letter subject."""
    if isinstance(subject, str) and (subject.startswith(RETRY_PREFIX) or subject.startswith(DEAD_PREFIX)):
        parse_internal_subject(subject, limits)
        return subject
    return check_name("subject", subject, limits)


def retry_subject(subject: str, group: str) -> str:
    return f"{RETRY_PREFIX}{subject}%{group}"


def dead_subject(subject: str, group: str) -> str:
    return f"{DEAD_PREFIX}{subject}%{group}"


def parse_internal_subject(name: str, limits: Limits = DEFAULT_LIMITS) -> tuple[str, str, str]:
    """Split a retry or dead-letter subject into (kind, subject, group); kind is "retry" or "dead"."""
    if len(name) > limits.internal_subject_chars_max:
        raise InvalidSubjectError(
            f"subject {name[:40]!r}… has {len(name)} characters; the limit is {limits.internal_subject_chars_max}"
        )
    for kind, prefix in (("dead", DEAD_PREFIX), ("retry", RETRY_PREFIX)):
        if name.startswith(prefix):
            subject, sep, group = name[len(prefix) :].partition("%")
            if not sep:
                break
            check_name("subject", subject, limits)
            check_name("consumer group", group, limits)
            return kind, subject, group
    raise InvalidSubjectError(
        f"subject {name!r} is not a valid %RETRY%<subject>%<group> or %DEAD_RETRY%<subject>%<group> name"
    )


_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
_FILE_NAME_CHARS_MAX = 150


def subject_file_name(subject: str) -> str:
    """A file-system-safe, unique, reversible-or-hashed name for a subject.

    Letters, digits, ``-``, ``_`` and ``.`` stay; every other byte becomes ``~XX``. A leading
    dot is escaped too, so no name is hidden, ``.`` or ``..``. Names that would pass 150
    characters are cut and suffixed with a hash of the whole subject, so they stay unique.
    """
    out: list[str] = []
    for i, ch in enumerate(subject):
        if ch in _SAFE and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"~{b:02X}" for b in ch.encode("utf-8"))
    name = "".join(out)
    if len(name) > _FILE_NAME_CHARS_MAX:
        digest = hashlib.sha256(subject.encode("utf-8")).hexdigest()[:16]
        name = f"{name[:100]}~~{digest}"
    return name


def subject_of_file_name(name: str) -> str | None:
    """The subject whose ``subject_file_name`` is ``name``, or None when ``name`` is not one, or
    is a cut name with a hash (those name their subject in a file beside them)."""
    if not name or name[0] == "." or len(name) > _FILE_NAME_CHARS_MAX:
        return None
    if _SAFE.issuperset(name):  # nothing escaped (most names): recovery reads 40,000 of them
        return name
    if "~~" in name:
        return None
    raw = bytearray()
    i = 0
    try:
        while i < len(name):
            ch = name[i]
            if ch == "~":
                raw.append(int(name[i + 1 : i + 3], 16))
                i += 3
            else:
                raw.extend(ch.encode("ascii"))
                i += 1
        subject = raw.decode("utf-8")
    except (ValueError, UnicodeError):
        return None
    return subject if subject and subject_file_name(subject) == name else None
