"""Request bodies of the gateway, read and checked: JSON in, SDK objects out (no I/O here).

Every check names the field and the value and says what to send instead (``ApiError`` 400);
sizes are those of the SDK (``qmq.common.limits``), so what the gateway takes a producer
would take too.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from qmq.client.message import Message
from qmq.common.errors import QmqError
from qmq.common.limits import DEFAULT_LIMITS
from qmq.gateway.errors import ApiError, api_error_of, bad_request

LIMITS: Final = DEFAULT_LIMITS
# A request body: the largest batch frame the SDK sends, its bodies in base64 (4 bytes for 3)
# and JSON around them. aiohttp refuses a larger one (413) before reading it.
REQUEST_BYTES_MAX: Final = LIMITS.frame_bytes_max * 4 // 3 + 64 * 1024
# Messages in one POST: a JSON batch is decoded whole, so it is bounded lower than the SDK's
# frame (batch_messages_max 10,000) to keep one request's Python work short.
BATCH_MESSAGES_MAX: Final = 1_000
# What a pull may ask for (the bounds; the broker's own pull limits are higher).
PULL_MESSAGES_MAX: Final = 1_000
PULL_TIMEOUT_MS_MAX: Final = 30_000
ACK_TIMEOUT_MS_MIN: Final = 1_000
ACK_TIMEOUT_MS_MAX: Final = 600_000
# Receipts in one POST /v1/acks.
ACK_RECEIPTS_MAX: Final = 10_000
CONSUMER_ID_CHARS_MAX: Final = 100

_MESSAGE_KEYS: Final = frozenset({"properties", "tags", "body", "body_base64", "message_id", "delay_ms", "deliver_at"})
# the longest delay_ms taken: the delay server's horizon, 730 days by default (it refuses later)
DELAY_MS_MAX: Final = 3650 * 86_400_000


def parse_json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except RecursionError:
        raise bad_request("BODY_INVALID", "the body nests JSON arrays or objects too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request("BODY_INVALID", f"the body is not JSON ({exc}); send a JSON object") from None


def json_object(raw: bytes) -> dict[str, Any]:
    doc = parse_json(raw)
    if not isinstance(doc, dict):
        raise bad_request("BODY_INVALID", f"the body must be a JSON object, got {type(doc).__name__}")
    return doc


def _int(where: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one number type: 100.0 is the whole number 100
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request("VALUE_INVALID", f"{where} = {value!r:.80} must be a whole number from {lo} to {hi}")
    if not lo <= value <= hi:
        raise bad_request("VALUE_INVALID", f"{where} = {value} is out of range; use {lo} to {hi}")
    return value


def optional_int(doc: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = doc.get(key)
    return default if value is None else _int(key, value, lo, hi)


def _message(where: str, subject: str, doc: object) -> Message:
    if not isinstance(doc, dict):
        raise bad_request("MESSAGE_INVALID", f"{where} must be a JSON object, got {type(doc).__name__}")
    if not _MESSAGE_KEYS.issuperset(doc):
        unknown = sorted(set(doc) - _MESSAGE_KEYS)
        raise bad_request(
            "MESSAGE_INVALID",
            f"{where} has unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_MESSAGE_KEYS))}",
        )
    if "body" in doc and "body_base64" in doc:
        raise bad_request("MESSAGE_INVALID", f"{where} has both body and body_base64; send one")
    if "delay_ms" in doc and "deliver_at" in doc:
        raise bad_request("MESSAGE_INVALID", f"{where} has both delay_ms and deliver_at; send one")
    message_id = doc.get("message_id")
    if message_id is not None and not isinstance(message_id, str):
        raise bad_request("MESSAGE_INVALID", f"{where}.message_id must be a string, got {message_id!r:.80}")
    properties = doc.get("properties") or _NONE
    if not isinstance(properties, dict):
        raise bad_request("MESSAGE_INVALID", f"{where}.properties must be a JSON object of strings, numbers, booleans")
    for key, value in properties.items():
        if not isinstance(value, str | int | float | bool):
            raise bad_request(
                "MESSAGE_INVALID",
                f"{where}.properties[{key!r:.80}] = {value!r:.80} must be a string, number or boolean",
            )
    tags = doc.get("tags") or _NO_TAGS
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise bad_request("MESSAGE_INVALID", f"{where}.tags must be a list of strings")
    body = _body(where, doc)
    try:
        m = Message(subject, message_id=message_id, body=body, properties=properties, tags=tags)
        if doc.get("delay_ms") is not None:
            m.set_delay(_int(f"{where}.delay_ms", doc["delay_ms"], 0, DELAY_MS_MAX) / 1000)
        elif doc.get("deliver_at") is not None:
            m.set_deliver_at(_rfc3339(f"{where}.deliver_at", doc["deliver_at"]))
        if not _surely_fits(m, properties, tags):
            m.encode()  # the size check of the whole message, before anything is sent
    except ApiError:
        raise
    except QmqError as exc:
        err = api_error_of(exc)
        raise ApiError(err.status, err.code, f"{where}: {err.message}") from None
    return m


_NONE: Final[dict[str, Any]] = {}
_NO_TAGS: Final[list[str]] = []
# More than a message's encoding adds to its body, properties, tags, subject and id (its fixed header).
_HEADER_BYTES_BOUND: Final = 256


def _surely_fits(m: Message, properties: Mapping[str, Any], tags: list[str]) -> bool:
    """Whether ``m`` encodes within ``message_bytes_max`` for sure (4 bytes a character, numbers as
    32 characters), so that its size check (an encoding) is needed only near the limit."""
    bound = len(m.body) + 4 * (len(m.subject) + len(m.message_id)) + _HEADER_BYTES_BOUND
    for key, value in properties.items():
        bound += 4 * (len(key) + (len(value) if isinstance(value, str) else 32)) + 16
    for tag in tags:
        bound += 4 * len(tag) + 4
    return bound <= LIMITS.message_bytes_max


def _body(where: str, doc: Mapping[str, Any]) -> bytes | str:
    if "body_base64" in doc:
        text = doc["body_base64"]
        if not isinstance(text, str):
            raise bad_request("MESSAGE_INVALID", f"{where}.body_base64 must be a base64 string")
        if len(text) > LIMITS.body_bytes_max * 4 // 3 + 4:
            raise ApiError(
                413,
                "MESSAGE_TOO_LARGE",
                f"{where}.body_base64 holds more than body_bytes_max {LIMITS.body_bytes_max} bytes",
            )
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise bad_request("MESSAGE_INVALID", f"{where}.body_base64 is not base64 ({exc})") from None
    body = doc.get("body", "")
    if body is None:
        return b""
    if not isinstance(body, str):
        raise bad_request(
            "MESSAGE_INVALID", f"{where}.body must be a string (text); send bytes as body_base64, JSON as a string"
        )
    return body


_LEAP_SECOND: Final = re.compile(r"^(.{10}T\d\d:\d\d:)60(?:\.\d+)?")


def _rfc3339(where: str, value: object) -> datetime:
    if not isinstance(value, str):
        raise bad_request("VALUE_INVALID", f"{where} = {value!r:.80} must be an RFC 3339 time string")
    try:
        # RFC 3339 allows a lower-case t and z, and a leap second (read as the second before)
        when = datetime.fromisoformat(_LEAP_SECOND.sub(r"\g<1>59.999999", value.upper()))
    except ValueError:
        raise bad_request(
            "VALUE_INVALID", f"{where} = {value!r:.80} is not an RFC 3339 time, e.g. 2026-11-24T18:00:00Z"
        ) from None
    if when.tzinfo is None:
        raise bad_request("VALUE_INVALID", f"{where} = {value!r:.80} has no UTC offset; add Z or +HH:MM")
    return when


@dataclass(frozen=True, slots=True)
class SendRequest:
    messages: list[Message]
    batch: bool  # sent as {"messages": [...]}: answered with one result per message


def parse_send(subject: str, raw: bytes) -> SendRequest:
    doc = json_object(raw)
    if "messages" in doc:
        if len(doc) != 1:
            raise bad_request("BODY_INVALID", 'a batch is {"messages": [...]} alone; put each message\'s fields inside')
        items = doc["messages"]
        if not isinstance(items, list) or not items:
            raise bad_request("BODY_INVALID", "messages must be a non-empty list of message objects")
        if len(items) > BATCH_MESSAGES_MAX:
            raise ApiError(
                413,
                "BATCH_TOO_LARGE",
                f"a batch of {len(items)} messages is over the gateway's {BATCH_MESSAGES_MAX}; send several batches",
            )
        return SendRequest([_message(f"messages[{i}]", subject, m) for i, m in enumerate(items)], True)
    return SendRequest([_message("the message", subject, doc)], False)
