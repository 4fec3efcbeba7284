"""``POST /v1/subjects/{subject}/groups/{group}/pull``: a long poll through the SDK's pull
consumer, each message handed out under a receipt and an ack timeout (``qmq.gateway.receipts``).

One gateway is a few consumer ids (``pull_consumers``) of every group it pulls for, so that
many pulls of one group run at once (the SDK makes one pull at a time per consumer); the HTTP
clients of a group share them, and a message goes to one of them. The ``consumer_id`` a client
names is kept for the log; the broker sees the gateway.

Before the messages are answered, the broker is asked to hold their positions for the ack
timeout (SETTLE ``hold``): from then on their give-back does not depend on this gateway living.

``tags`` with ``tag_match`` (``any`` or ``all``) pulls only the messages carrying any or all of
the tags; the broker filters (the SDK's pull consumer subscribed with them). A consumer group
pulls through one filter: the broker moves the group past what does not match it.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

from qmq.aio import Consumer, PullConsumer, ReceivedMessage
from qmq.client.options import TagType, check_start_from
from qmq.common.errors import ConfigError, DeadLetterNow, QmqError
from qmq.gateway.errors import ApiError, bad_request
from qmq.gateway.payload import (
    ACK_TIMEOUT_MS_MAX,
    ACK_TIMEOUT_MS_MIN,
    CONSUMER_ID_CHARS_MAX,
    PULL_MESSAGES_MAX,
    PULL_TIMEOUT_MS_MAX,
    json_object,
    optional_int,
)
from qmq.gateway.receipts import Issued, Receipt, ReceiptCodec
from qmq.gateway.settle import Settler
from qmq.gateway.transforms import Transforms

log = logging.getLogger(__name__)

PULL_MESSAGES_DEFAULT = 10
PULL_TIMEOUT_MS_DEFAULT = 1_000
_PULL_KEYS = frozenset(
    {"max_messages", "timeout_ms", "consumer_id", "ack_timeout_ms", "start_from", "tags", "tag_match"}
)
# the pull's tag_match and the SDK's tag_type
_TAG_MATCH: dict[str, TagType] = {"any": "or", "all": "and"}


def message_json(m: ReceivedMessage, receipt: str, body: bytes | None = None) -> dict[str, Any]:
    """A pulled message as JSON: ``body`` when its bytes (``body``, a transform's result, else
    the stored body) are UTF-8 text, else ``body_base64``; a bytes property as base64 text."""
    out: dict[str, Any] = {
        "message_id": m.message_id,
        "subject": m.subject,
        "properties": {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in m.properties.items()},
        "tags": list(m.tags),
        "times": m.times,
        "receipt": receipt,
    }
    if body is None:
        body = m.body
    try:
        out["body"] = body.decode("utf-8")
    except UnicodeDecodeError:
        out["body_base64"] = base64.b64encode(body).decode()
    return out


def _tag_filter(doc: dict[str, Any]) -> tuple[tuple[str, ...], TagType]:
    """(tags, the SDK's tag_type) of a pull; ((), "or") for all messages."""
    tags = doc.get("tags", [])
    match = doc.get("tag_match", "any")
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise bad_request("VALUE_INVALID", f'tags = {tags!r:.80} must be a list of tag strings, e.g. ["vip"]')
    if match not in _TAG_MATCH:
        raise bad_request(
            "VALUE_INVALID", f'tag_match = {match!r:.40} is not allowed; use "any" (any of the tags) or "all"'
        )
    return tuple(tags), _TAG_MATCH[match]


def _tags_text(tags: tuple[tuple[str, ...], TagType]) -> str:
    if not tags[0]:
        return "no tag filter"
    return f"tags {list(tags[0])} ({'any' if tags[1] == 'or' else 'all'})"


class _Lanes:
    """The pull consumers of one (subject, consumer group), one per SDK consumer (with its
    consumer id), how many pulls each is making, and the tag filter they pull with."""

    def __init__(self, consumers: list[PullConsumer], ids: list[str], tags: tuple[tuple[str, ...], TagType]) -> None:
        self.consumers = consumers
        self.ids = ids
        self.tags = tags
        self.busy = [0] * len(consumers)

    def least_busy(self) -> int:
        return min(range(len(self.busy)), key=self.busy.__getitem__)


class Pulls:
    """The pull consumers of one gateway, per (subject, consumer group), made on first use."""

    def __init__(
        self,
        consumers: list[Consumer],
        ids: list[str],
        issued: Issued,
        codec: ReceiptCodec,
        settler: Settler,
        ack_timeout_ms: int,
        groups_max: int,
        transforms: Transforms | None = None,
    ) -> None:
        self.consumers = consumers
        self.transforms = transforms or Transforms()
        self.ids = ids
        self.receipts = issued
        self.codec = codec
        self.settler = settler
        self.ack_timeout_ms = ack_timeout_ms
        self.groups_max = groups_max
        self._lanes: dict[tuple[str, str], _Lanes] = {}

    def _lanes_of(self, subject: str, group: str, start_from: object, tags: tuple[tuple[str, ...], TagType]) -> _Lanes:
        lanes = self._lanes.get((subject, group))
        if lanes is not None:
            if lanes.tags != tags:
                raise ApiError(
                    409,
                    "TAG_FILTER_CONFLICT",
                    f"consumer group {group!r} pulls {subject!r} through this gateway with {_tags_text(lanes.tags)}, "
                    f"not {_tags_text(tags)}; a consumer group pulls with one tag filter (use another group)",
                )
            return lanes  # where a group starts matters only to its first pull
        if len(self._lanes) >= self.groups_max:
            raise ApiError(
                429,
                "TOO_MANY_GROUPS",
                f"this gateway pulls for {self.groups_max} (subject, consumer group) pairs already, its "
                "pull_groups_max; pull through another gateway or raise it",
            )
        try:
            start = check_start_from(start_from)
            pcs = [c.pull_consumer(subject, group, start, tags=tags[0], tag_type=tags[1]) for c in self.consumers]
            lanes = _Lanes(pcs, self.ids, tags)
        except ConfigError as exc:
            raise bad_request("VALUE_INVALID", str(exc)) from None
        self._lanes[(subject, group)] = lanes
        return lanes

    async def pull(self, subject: str, group: str, raw: bytes) -> dict[str, Any]:
        doc = json_object(raw) if raw.strip() else {}
        unknown = sorted(set(doc) - _PULL_KEYS)
        if unknown:
            raise bad_request(
                "BODY_INVALID", f"unknown key(s) {', '.join(unknown)}; a pull takes {', '.join(sorted(_PULL_KEYS))}"
            )
        max_messages = optional_int(doc, "max_messages", PULL_MESSAGES_DEFAULT, 1, PULL_MESSAGES_MAX)
        timeout_ms = optional_int(doc, "timeout_ms", PULL_TIMEOUT_MS_DEFAULT, 0, PULL_TIMEOUT_MS_MAX)
        ack_timeout_ms = optional_int(
            doc, "ack_timeout_ms", self.ack_timeout_ms, ACK_TIMEOUT_MS_MIN, ACK_TIMEOUT_MS_MAX
        )
        consumer_id = doc.get("consumer_id", "")
        if not isinstance(consumer_id, str) or len(consumer_id) > CONSUMER_ID_CHARS_MAX:
            raise bad_request(
                "VALUE_INVALID",
                f"consumer_id = {consumer_id!r:.80} must be a string of at most {CONSUMER_ID_CHARS_MAX}",
            )
        room = self.receipts.room()
        if room == 0:
            raise ApiError(
                429,
                "TOO_MANY_UNACKED",
                f"this gateway keeps the ack timeouts of {self.receipts.receipts_max} pulled messages itself (its "
                "receipts_max; the broker did not take them); ack or nack some, or wait for their ack timeout",
            )
        tags = _tag_filter(doc)
        lanes = self._lanes_of(subject, group, doc.get("start_from", "latest"), tags)
        lane = lanes.least_busy()
        lanes.busy[lane] += 1
        try:
            batch = await lanes.consumers[lane].pull(min(max_messages, room), timeout_ms)
        finally:
            lanes.busy[lane] -= 1
        out: list[dict[str, Any]] = []
        readable: list[tuple[ReceivedMessage, Receipt, bytes | None]] = []
        deadline_ms = int(time.time() * 1000) + ack_timeout_ms
        transform = self.transforms.of(subject, group)
        for m in batch:
            tracker = m._tracker
            if self.receipts.is_out((tracker.broker_group, tracker.subject, group, lanes.ids[lane]), m.pull_offset):
                # handed again by a new master (or over a new connection) while a client holds it:
                # its receipt stands, and its hold gives it back at its deadline
                log.info("message %s of %r is out under a receipt: not handed out twice", m.printable_id, subject)
                continue
            problem = m.unreadable()
            if problem is not None:
                log.warning("message %s of %r cannot be read (%s); dead-lettered", m.printable_id, subject, problem)
                await m.nack(QmqError(problem))  # the SDK dead-letters an unreadable message at once
                continue
            body = None
            if transform is not None:
                try:
                    body = transform.body_of(m)
                except DeadLetterNow as exc:
                    log.warning("message %s of %r/%s: %s; dead-lettered", m.printable_id, subject, group, exc)
                    await m.nack(exc)  # the SDK puts it in the group's dead letters with the reason
                    continue
            receipt = Receipt(
                tracker.broker_group, tracker.subject, group, lanes.ids[lane], m.pull_offset, deadline_ms, m.sequence
            )
            readable.append((m, receipt, body))
        if readable:
            # a broker that did not take the hold leaves it to this gateway's sweeper alone
            broker_holds = await self.settler.hold([r for _m, r, _b in readable], ack_timeout_ms)
            for m, receipt, body in readable:
                self.receipts.hold(m, receipt, ack_timeout_ms, broker_holds)
                out.append(message_json(m, self.codec.encode(receipt), body))
        if batch and consumer_id:
            log.debug("%d message(s) of %r/%s to consumer %r", len(out), subject, group, consumer_id)
        return {"messages": out}
