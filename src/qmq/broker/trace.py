"""TRACE: what this broker's files tell of one message, for ``qmq trace MESSAGE_ID --meta-server``.

Read with ``StoreReader`` (never the live store: it takes no lock and changes nothing), on a
thread, so a trace never holds up the event loop:

- **stored**: every subject that holds the message id, from the consume-log entry stored at or
  after a day before the id's time (a producer's clock may run behind), each record's id checked
  as it is read: the message's own subject, and after failed deliveries the copies in
  ``%RETRY%<subject>%<group>`` with their attempt and the handler's error (``qmq.error``);
- **pulled / acked**: which consumer of which group received each stored copy and whether it
  acknowledged it, from the action log's PULL and ACK actions and the consumer progress (the
  checkpoint and the action log after it) for what the kept action log no longer shows;
- **dead_lettered**: the group's dead letters of the id, ``removed`` once resent or purged.

At most ``SCAN_RECORDS_MAX`` records are read a trace (past them the answer says ``truncated``),
and at most ``LISTED_MAX`` copies and events are listed.
A pull or an ack has the time its action was logged with; one logged by a version of qmq that
wrote no time, or known only from the progress, has none (``at`` is null).
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from qmq.common.naming import parse_internal_subject
from qmq.protocol.message import decode_message, decode_properties, delivery_attempt
from qmq.protocol.record import RECORD_HEADER, RECORD_HEADER_BYTES
from qmq.store import action_log as act
from qmq.store.dead_letters import ERROR_PROPERTY
from qmq.store.reader import StoreReader

SCAN_RECORDS_MAX: Final = 2_000_000
# copies and events an answer lists at most (a message retried many times in many groups)
LISTED_MAX: Final = 1_000
_CLOCK_SLACK_MS: Final = 86_400_000
_ERROR_CHARS_MAX: Final = 500


def rfc3339(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def id_time_ms(message_id: str) -> int | None:
    """The creation time in an SDK-made id (``yyMMddHHmmssSSS.…``), or None for another id."""
    head = message_id[:15]
    if len(head) != 15 or not head.isdigit():
        return None
    try:
        at = datetime.strptime(head[:12], "%y%m%d%H%M%S").replace(tzinfo=UTC)
    except ValueError:
        return None
    return int(at.timestamp() * 1000) + int(head[12:])


def _text(value: object) -> str | None:
    if value is None:
        return None
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return text[:_ERROR_CHARS_MAX]


def trace_message(data_dir: Path, message_id: str, scan_max: int = SCAN_RECORDS_MAX) -> dict[str, Any]:
    """The answer of TRACE: ``{"stored": [...], "events": [...], "scanned", "truncated"}``."""
    reader = StoreReader(data_dir)
    wanted = message_id.encode("utf-8")
    born_ms = id_time_ms(message_id)
    since_ms = 0 if born_ms is None else born_ms - _CLOCK_SLACK_MS
    stored: list[dict[str, Any]] = []
    scanned = 0
    truncated = False
    for subject in sorted(reader.subjects()):
        if truncated:
            break
        for run in reader.iter_records(subject, reader.seq_at_time(subject, since_ms)):
            data, pos = run.data, 0
            while pos + RECORD_HEADER_BYTES <= len(data):
                _magic, _crc, length, sequence, stored_ms = RECORD_HEADER.unpack_from(data, pos)
                body = data[pos + RECORD_HEADER_BYTES : pos + RECORD_HEADER_BYTES + length]
                pos += RECORD_HEADER_BYTES + length
                scanned += 1
                if wanted in body:  # the id's bytes: only then is the message decoded
                    fields = decode_message(body)
                    if fields.message_id == message_id and len(stored) < LISTED_MAX:
                        error = decode_properties(fields.properties_raw).get(ERROR_PROPERTY)
                        stored.append(
                            {
                                "subject": subject,
                                "sequence": sequence,
                                "at": rfc3339(stored_ms),
                                "attempt": delivery_attempt(fields.times),
                                "error": _text(error),
                            }
                        )
            if scanned >= scan_max:
                truncated = True
                break
    events = (_deliveries(reader, stored) + _dead(reader, message_id))[:LISTED_MAX]
    return {"stored": stored, "events": events, "scanned": scanned, "truncated": truncated}


def _deliveries(reader: StoreReader, stored: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A "pulled" event for each consumer a stored copy was handed to, and "acked" once it was:
    from the action log's PULL and ACK actions, then the progress for what it no longer holds."""
    out: list[dict[str, Any]] = []
    wanted = {(c["subject"], c["sequence"]) for c in stored}
    if not wanted:
        return out
    # (subject, group, consumer, pull-log offset) -> [acked, sequence, pulled at, acked at]
    pulls: dict[tuple[str, str, str, int], list[Any]] = {}
    for item in reader.actions():
        a = item.action
        if a[0] == act.PULL and len(a) >= 7:
            subject, group, consumer, p = str(a[1]), str(a[2]), str(a[3]), int(a[4])
            at_ms = a[8] if len(a) > 8 else None  # written since actions carry their time
            for seq0, count in a[5]:
                for subj, seq in wanted:
                    if subj == subject and seq0 <= seq < seq0 + count:
                        pulls[(subject, group, consumer, p + seq - seq0)] = [False, seq, at_ms, None]
                p += count
        elif a[0] == act.ACK and len(a) >= 5 and pulls:
            who = (str(a[1]), str(a[2]), str(a[3]))
            for key, state in pulls.items():
                if key[:3] == who and not state[0] and any(r[0] <= key[3] < r[1] for r in a[4]):
                    state[0], state[3] = True, a[5] if len(a) > 5 else None
    progress, _at_ms = reader.progress()
    for (subject, group, consumer, p), (acked, seq, pulled_ms, acked_ms) in pulls.items():
        if not acked:  # acks older than the kept action log are in the progress
            gp = progress.get(subject, group)
            cp = gp.consumers.get(consumer) if gp else None
            acked = cp is not None and (p < cp.ack_offset or any(s <= p < e for s, e in cp.acked))
        base = {"group": group, "consumer_id": consumer, "subject": subject, "sequence": seq}
        out.append({"event": "pulled", **base, "at": _at(pulled_ms)})
        if acked:
            out.append({"event": "acked", **base, "at": _at(acked_ms)})
    for subject, seq in sorted(wanted):
        for gp in progress.groups_of(subject):
            if any(k[0] == subject and k[1] == gp.group for k in pulls):
                continue
            if seq < gp.pull_offset:
                # no kept history names its consumer: acknowledged before it, or the group began after it
                out.append(
                    {
                        "event": "acked",
                        "group": gp.group,
                        "consumer_id": None,
                        "subject": subject,
                        "sequence": seq,
                        "at": None,
                    }
                )
    return out


def _at(ms: object) -> str | None:
    return rfc3339(ms) if isinstance(ms, int) and not isinstance(ms, bool) and ms > 0 else None


def _dead(reader: StoreReader, message_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for letter in reader.dead_letters():
        fields = decode_message(letter.message)
        if fields.message_id != message_id:
            continue
        _kind, _subject, group = parse_internal_subject(letter.dead_subject)
        error = decode_properties(fields.properties_raw).get(ERROR_PROPERTY)
        out.append(
            {
                "event": "dead_lettered",
                "group": group,
                "consumer_id": None,
                "at": rfc3339(letter.dead_at_ms),
                "attempts": fields.times,
                "error": _text(error),
                "removed": letter.removed,
            }
        )
    return out
