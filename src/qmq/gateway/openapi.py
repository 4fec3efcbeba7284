"""The OpenAPI 3.1 document of the gateway (``GET /openapi.json``): every route, its request
and its answers, built from the same bounds the routes check (``qmq.gateway.payload``), so
the two cannot drift apart; tests/gateway checks the running gateway against it."""

from __future__ import annotations

from typing import Any

from qmq import __version__
from qmq.gateway.admin import DEAD_LETTERS_LIMIT_DEFAULT, DEAD_LETTERS_LIMIT_MAX
from qmq.gateway.payload import (
    ACK_RECEIPTS_MAX,
    ACK_TIMEOUT_MS_MAX,
    ACK_TIMEOUT_MS_MIN,
    BATCH_MESSAGES_MAX,
    CONSUMER_ID_CHARS_MAX,
    DELAY_MS_MAX,
    LIMITS,
    PULL_MESSAGES_MAX,
    PULL_TIMEOUT_MS_MAX,
)

Json = dict[str, Any]


def _ref(name: str) -> Json:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: Json, description: str) -> Json:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS: Json = {
    "400": {"$ref": "#/components/responses/BadRequest"},
    "404": {"$ref": "#/components/responses/NotFound"},
    "413": {"$ref": "#/components/responses/TooLarge"},
    "429": {"$ref": "#/components/responses/Throttled"},
    "503": {"$ref": "#/components/responses/Unavailable"},
}

# Names as the document promises them: letters, digits and . _ - : (the gateway takes more: any
# visible character but whitespace, '/' and '%'; docs/gateway.md).
_NAME_PATTERN = "^[A-Za-z0-9._:-]+$"
_NAME: Json = {"type": "string", "minLength": 1, "maxLength": LIMITS.subject_chars_max, "pattern": _NAME_PATTERN}
_I64 = 2**63
_HORIZON_MS_DEFAULT = 730 * 86_400_000


def _param(name: str, description: str) -> Json:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": _NAME}


_SUBJECT = _param("subject", "the subject (at most 100 characters; no whitespace, '/' or '%')")
_GROUP = _param("group", "the consumer group")


def _op(
    summary: str, ok: Json, *, body: Json | None = None, params: list[Json] | None = None, conflict: bool = False
) -> Json:
    op: Json = {"summary": summary, "responses": {"200": ok, **_ERRORS}}
    if conflict:
        op["responses"]["409"] = {"$ref": "#/components/responses/Conflict"}
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


def _schemas() -> Json:
    prop_value = {
        "oneOf": [
            {"type": "string"},
            {"type": "integer", "minimum": -_I64, "maximum": _I64 - 1},
            {"type": "number", "not": {"type": "integer"}},
            {"type": "boolean"},
        ]
    }
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
                }
            },
        },
        "Message": {
            "type": "object",
            "additionalProperties": False,
            "description": "a message to send: body (text) or body_base64 (bytes); delay_ms or deliver_at",
            "not": {"anyOf": [{"required": ["body", "body_base64"]}, {"required": ["delay_ms", "deliver_at"]}]},
            "properties": {
                "message_id": {
                    "type": "string",
                    "maxLength": LIMITS.message_id_chars_max,
                    "pattern": "^[!-~]+$",
                    "description": "a repeat of a stored id is dropped by the broker: retry sends safely",
                },
                "properties": {
                    "type": "object",
                    "maxProperties": LIMITS.properties_max,
                    "propertyNames": {"maxLength": 64, "pattern": _NAME_PATTERN},
                    "additionalProperties": prop_value,
                },
                "tags": {
                    "type": "array",
                    "maxItems": LIMITS.tags_max,
                    "items": {"type": "string", "maxLength": LIMITS.tag_chars_max, "pattern": _NAME_PATTERN},
                },
                "body": {"type": "string"},
                "body_base64": {
                    "type": "string",
                    "contentEncoding": "base64",
                    "pattern": "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$",
                },
                "delay_ms": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": _HORIZON_MS_DEFAULT,
                    "description": "deliver this long after it is stored; within the delay servers' horizon "
                    f"(their horizon_days, 730 by default; never more than {DELAY_MS_MAX})",
                },
                "deliver_at": {
                    "type": "string",
                    "format": "date-time",
                    "description": "RFC 3339; within the delay servers' horizon (730 days ahead by default)",
                },
            },
        },
        "Batch": {
            "type": "object",
            "additionalProperties": False,
            "required": ["messages"],
            "properties": {
                "messages": {"type": "array", "minItems": 1, "maxItems": BATCH_MESSAGES_MAX, "items": _ref("Message")}
            },
        },
        "SendResult": {
            "type": "object",
            "required": ["message_id"],
            "properties": {
                "message_id": {"type": "string"},
                "error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "description": "present when this message was not stored",
                },
            },
        },
        "Sent": {
            "oneOf": [
                {"type": "object", "required": ["message_id"], "properties": {"message_id": {"type": "string"}}},
                {
                    "type": "object",
                    "required": ["results"],
                    "properties": {"results": {"type": "array", "items": _ref("SendResult")}},
                },
            ]
        },
        "Pull": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "max_messages": {"type": "integer", "minimum": 1, "maximum": PULL_MESSAGES_MAX, "default": 10},
                "timeout_ms": {"type": "integer", "minimum": 0, "maximum": PULL_TIMEOUT_MS_MAX, "default": 1000},
                "consumer_id": {"type": "string", "maxLength": CONSUMER_ID_CHARS_MAX},
                "ack_timeout_ms": {
                    "type": "integer",
                    "minimum": ACK_TIMEOUT_MS_MIN,
                    "maximum": ACK_TIMEOUT_MS_MAX,
                    "default": 30_000,
                },
                "start_from": {"enum": ["latest", "earliest"], "default": "latest"},
                "tags": {
                    "type": "array",
                    "maxItems": LIMITS.tags_max,
                    "items": {"type": "string", "maxLength": LIMITS.tag_chars_max, "pattern": _NAME_PATTERN},
                    "description": "only messages with any (tag_match any) or all (all) of these tags; the broker "
                    "filters. A consumer group pulls with one filter",
                },
                "tag_match": {"enum": ["any", "all"], "default": "any"},
            },
        },
        "ReceivedMessage": {
            "type": "object",
            "required": ["message_id", "subject", "properties", "tags", "times", "receipt"],
            "properties": {
                "message_id": {"type": "string"},
                "subject": {"type": "string"},
                "properties": {"type": "object", "additionalProperties": prop_value},
                "tags": {"type": "array", "items": {"type": "string"}},
                "body": {
                    "type": "string",
                    "description": "the body, when it is UTF-8 text (the JSON text of the group's transform, if any)",
                },
                "body_base64": {"type": "string", "description": "the body, when it is not UTF-8 text"},
                "times": {"type": "integer", "minimum": 1, "description": "delivery attempt: 1 the first time"},
                "receipt": _ref("Receipt"),
            },
        },
        "Pulled": {
            "type": "object",
            "required": ["messages"],
            "properties": {"messages": {"type": "array", "items": _ref("ReceivedMessage")}},
        },
        "Receipt": {
            "type": "string",
            "maxLength": 2000,
            "pattern": "^[A-Za-z0-9_-]+[.][A-Za-z0-9_-]+$",
            "description": "what POST /v1/acks takes, to any gateway of the cluster; signed by the gateways: one "
            "not issued by them is refused (400 RECEIPT_INVALID)",
        },
        "Acks": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "acks": {"type": "array", "maxItems": ACK_RECEIPTS_MAX, "items": _ref("Receipt")},
                "nacks": {"type": "array", "maxItems": ACK_RECEIPTS_MAX, "items": _ref("Receipt")},
            },
        },
        "Settled": {
            "type": "object",
            "required": ["results"],
            "properties": {
                "results": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["receipt", "status"],
                        "properties": {
                            "receipt": {"type": "string"},
                            "status": {"enum": ["acked", "nacked", "expired", "settled", "held", "unrecorded"]},
                        },
                    },
                }
            },
        },
        "Subjects": {
            "type": "object",
            "required": ["subjects", "truncated"],
            "properties": {
                "subjects": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["subject", "messages", "consumer_groups", "broker_groups"],
                        "properties": {
                            "subject": {"type": "string"},
                            "messages": {"type": "integer"},
                            "consumer_groups": {"type": "array", "items": {"type": "string"}},
                            "broker_groups": {"type": "object", "additionalProperties": {"type": "integer"}},
                        },
                    },
                },
                "truncated": {"type": "boolean"},
            },
        },
        "Lag": {
            "type": "object",
            "required": ["subject", "group", "backlog", "unacked", "broker_groups", "consumers"],
            "properties": {
                "subject": {"type": "string"},
                "group": {"type": "string"},
                "backlog": {"type": "integer"},
                "unacked": {"type": "integer"},
                "broker_groups": {"type": "object", "additionalProperties": {"type": "object"}},
                "consumers": {"type": "array", "items": {"type": "object"}},
            },
        },
        "DeadLetters": {
            "type": "object",
            "required": ["subject", "group", "total", "letters"],
            "properties": {
                "subject": {"type": "string"},
                "group": {"type": "string"},
                "total": {"type": "integer"},
                "letters": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["message_id", "attempts", "dead_at_ms", "broker_group"],
                        "properties": {
                            "message_id": {"type": "string"},
                            "attempts": {"type": "integer"},
                            "dead_at_ms": {"type": "integer"},
                            "error": {"type": ["string", "null"]},
                            "broker_group": {"type": "string"},
                        },
                    },
                },
            },
        },
        "DeadSelection": {
            "oneOf": [
                {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["message_id"],
                    "properties": {"message_id": {"type": "string", "minLength": 1}},
                },
                {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["all"],
                    "properties": {"all": {"const": True}},
                },
            ]
        },
    }


def document() -> Json:
    error = _json(_ref("Error"), "")
    group_params = [_SUBJECT, _GROUP]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "qmq HTTP gateway",
            "version": __version__,
            "description": "Send and consume qmq messages over HTTP/1.1 and JSON (docs/gateway.md).",
        },
        "paths": {
            "/v1/subjects/{subject}/messages": {
                "post": _op(
                    "send one message or a batch; answered once stored",
                    _json(_ref("Sent"), "stored: its message_id, or one result per message of a batch"),
                    body={"oneOf": [_ref("Message"), _ref("Batch")]},
                    params=[_SUBJECT],
                )
            },
            "/v1/subjects/{subject}/groups/{group}/pull": {
                "post": _op(
                    "long poll: up to max_messages, each with a receipt to ack before its ack timeout",
                    _json(_ref("Pulled"), "the messages (none when timeout_ms passed first)"),
                    body=_ref("Pull"),
                    params=group_params,
                    conflict=True,
                )
            },
            "/v1/acks": {
                "post": _op(
                    "ack and nack receipts; answered once the broker recorded them",
                    _json(_ref("Settled"), "what became of each receipt"),
                    body=_ref("Acks"),
                )
            },
            "/v1/subjects": {
                "get": _op(
                    "every subject with its message count and consumer groups",
                    _json(_ref("Subjects"), "the subjects, by name"),
                    params=[
                        {
                            "name": "internal",
                            "in": "query",
                            "required": False,
                            "description": "list the retry and dead-letter subjects too",
                            "schema": {"type": "boolean", "default": False},
                        }
                    ],
                )
            },
            "/v1/subjects/{subject}/groups/{group}/lag": {
                "get": _op("how far the group is behind", _json(_ref("Lag"), "per broker group"), params=group_params)
            },
            "/v1/subjects/{subject}/groups/{group}/dead-letters": {
                "get": _op(
                    "the group's dead letters, oldest first",
                    _json(_ref("DeadLetters"), "up to limit per broker group, and how many there are"),
                    params=[
                        *group_params,
                        {
                            "name": "limit",
                            "in": "query",
                            "required": False,
                            "schema": {
                                "type": "integer",
                                "minimum": 1,
                                "maximum": DEAD_LETTERS_LIMIT_MAX,
                                "default": DEAD_LETTERS_LIMIT_DEFAULT,
                            },
                        },
                    ],
                )
            },
            "/v1/subjects/{subject}/groups/{group}/dead-letters/resend": {
                "post": _op(
                    "put dead letters back on the subject for this group, attempts reset",
                    _json(
                        {"type": "object", "required": ["resent"], "properties": {"resent": {"type": "integer"}}},
                        "how many were resent",
                    ),
                    body=_ref("DeadSelection"),
                    params=group_params,
                )
            },
            "/v1/subjects/{subject}/groups/{group}/dead-letters/purge": {
                "post": _op(
                    "drop dead letters for good",
                    _json(
                        {"type": "object", "required": ["purged"], "properties": {"purged": {"type": "integer"}}},
                        "how many were purged",
                    ),
                    body=_ref("DeadSelection"),
                    params=group_params,
                )
            },
            "/openapi.json": {
                "get": {"summary": "this document", "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")}}
            },
            "/health": {
                "get": {
                    "summary": "whether the gateway serves",
                    "responses": {
                        "200": _json(
                            {"type": "object", "required": ["ok"], "properties": {"ok": {"const": True}}}, "it serves"
                        )
                    },
                }
            },
        },
        "components": {
            "schemas": _schemas(),
            "responses": {
                "BadRequest": {**error, "description": "bad input: the message names the value and what to send"},
                "NotFound": {**error, "description": "no such route, or an unknown subject or group"},
                "TooLarge": {**error, "description": "a body, message or batch over its limit (named)"},
                "Throttled": {**error, "description": "too much at once; send again in a moment"},
                "Conflict": {**error, "description": "the consumer group pulls with another tag filter"},
                "Unavailable": {**error, "description": "no broker available just now; send again"},
            },
        },
    }
