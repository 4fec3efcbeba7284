"""Reading request headers: each field checked for presence and type, with errors that name it."""

from __future__ import annotations

from typing import Any

from qmq.common.errors import InvalidMessageError, InvalidSubjectError
from qmq.common.limits import Limits
from qmq.common.naming import check_name, check_subject
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.message import ScannedMessage, check_tag, scan_batch

_RANGES_MAX = 10_000


class BadRequest(Exception):
    """A request the broker refuses with BAD_REQUEST; the text names the field."""


def get_str(header: dict[str, Any], key: str, default: str | None = None, max_chars: int = 256) -> str:
    value = header.get(key, default)
    if value is None:
        raise BadRequest(f"request header lacks {key!r}")
    if not isinstance(value, str):
        raise BadRequest(f"{key!r} must be a string, got {type(value).__name__}")
    if not value or len(value) > max_chars:
        raise BadRequest(f"{key!r} must have 1..{max_chars} characters, got {len(value)}")
    return value


def get_int(header: dict[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int:
    value = header.get(key, default)
    if value is None:
        raise BadRequest(f"request header lacks {key!r}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{key!r} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise BadRequest(f"{key!r} = {value} is outside {lo}..{hi}")
    return value


def get_subject(header: dict[str, Any]) -> str:
    try:
        return check_subject(header.get("subject"))
    except InvalidSubjectError as exc:
        raise BadRequest(str(exc)) from None


def get_group(header: dict[str, Any]) -> str:
    try:
        return check_name("consumer group", header.get("group"))
    except InvalidSubjectError as exc:
        raise BadRequest(str(exc)) from None


def get_bool(header: dict[str, Any], key: str) -> bool:
    value = header.get(key, False)
    if not isinstance(value, bool):
        raise BadRequest(f"{key!r} must be true or false, got {value!r}")
    return value


def get_tags(header: dict[str, Any], tags_max: int) -> tuple[tuple[str, ...], str]:
    """The subscription's tags (sorted, without repeats) and tag type ("or" or "and")."""
    tags = header.get("tags") or []
    if not isinstance(tags, list) or len(tags) > tags_max:
        raise BadRequest(f"'tags' must be a list of at most {tags_max} tags")
    for tag in tags:
        try:
            check_tag(tag)
        except InvalidMessageError as exc:
            raise BadRequest(f"'tags': {exc}") from None
    mode = header.get("tag_type", "or")
    if mode not in ("or", "and"):
        raise BadRequest(f"'tag_type' = {mode!r} is not allowed; use 'or' or 'and'")
    return tuple(sorted(set(tags))), mode


def get_ranges(header: dict[str, Any], key: str, required: bool = True) -> list[list[int]]:
    value = header.get(key)
    if value is None:
        if required:
            raise BadRequest(f"request header lacks {key!r}")
        return []
    if not isinstance(value, list) or len(value) > _RANGES_MAX:
        raise BadRequest(f"{key!r} must be a list of at most {_RANGES_MAX} [start, end] pairs")
    for r in value:
        if (
            not isinstance(r, list)
            or len(r) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
            or not 0 <= r[0] < r[1]
        ):
            raise BadRequest(f"{key!r} holds {r!r}; each range must be [start, end] with 0 <= start < end")
    return value


def scan_send(body: bytes, limits: Limits) -> tuple[list[ScannedMessage], dict[int, str]]:
    """The messages of a SEND_MESSAGES body and, by index, why any of them must be refused (what
    consumers would fail to decode: see ``scan_batch``); BadRequest when the body cannot be
    split or is empty."""
    problems: dict[int, str] = {}
    try:
        scanned = scan_batch(body, limits, problems)
    except RemoteProtocolError as exc:
        raise BadRequest(f"the send batch is malformed: {exc}") from None
    if not scanned:
        raise BadRequest("the send batch holds no message")
    return scanned, problems
