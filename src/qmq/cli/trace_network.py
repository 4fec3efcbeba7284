"""``qmq trace MESSAGE_ID --meta-server URL``: a message's life as every broker group tells it
(the TRACE request, qmq.broker.trace), with no data directory and no Spark.

The document (``--json``)::

    {"message_id", "subject", "stored": {"broker_group", "subject", "sequence", "at"} | null,
     "events": [{"event": "pulled" | "acked" | "nacked" | "retried" | "dead_lettered" | "resent", "group",
                 "consumer_id",
                 "at" (RFC 3339, or null where the broker keeps no time), "broker_group", ...}],
     "errors": {broker group: why it did not answer}, "truncated": bool}

``retried`` is a copy stored in ``%RETRY%<subject>%<group>`` (its ``attempt`` and the handler's
``error``): a delivery whose handler failed (the SDK, or the gateway for an HTTP nack, stores that
copy; the broker sees no nack of its own); ``pulled``/``acked`` say which consumer received which
copy (``subject``) and whether it acknowledged it; ``dead_lettered`` carries ``removed`` once
resent or purged; ``resent`` is a dead letter put back on the retry subject (``qmq resend-dead``):
a copy there with attempt 1, where a failed delivery's copy has 2 or more. ``nacked`` is a
delivery whose handler failed, told from what its failure left: the next attempt's copy on the
retry subject, or the dead letter after the last attempt (``at`` then, ``attempt`` the one that
failed, its ``error``, and ``consumer_id`` the consumer that pulled that attempt's copy, when the
broker's action log still tells). Such a copy is also ``acked``: its consumer settled it once the
retry copy or dead letter was stored.
"""

from __future__ import annotations

import asyncio
from typing import Any

import click

from qmq.cli.main import CommandError
from qmq.cli.output import echo_json
from qmq.common.errors import InvalidSubjectError, QmqError
from qmq.common.naming import parse_internal_subject
from qmq.protocol.codes import RequestCode

_AFTER_DEAD = 1 << 30  # where events without a time are placed after every attempt (see network_trace)


def print_network_trace(meta_server: str, message_id: str, as_json: bool) -> None:
    """Print the trace (``--json``: the document); CommandError when no broker group answered."""
    doc = asyncio.run(network_trace(meta_server, message_id))
    if as_json:
        echo_json(doc)
    else:
        for line in trace_lines(doc):
            click.echo(line)
    if doc["errors"] and doc["stored"] is None and not doc["events"]:
        raise CommandError(f"no broker group could tell: {'; '.join(doc['errors'].values())}")


async def network_trace(meta_server: str, message_id: str) -> dict[str, Any]:
    from qmq.cli.admin import ask_every_broker

    answers = await ask_every_broker(meta_server, RequestCode.TRACE, {"message_id": message_id})
    doc: dict[str, Any] = {
        "message_id": message_id,
        "subject": None,
        "stored": None,
        "events": [],
        "errors": {},
        "truncated": False,
    }
    events: list[dict[str, Any]] = []
    attempt_of: dict[tuple[str, str, int], int] = {}  # (broker group, subject, sequence) of a stored copy
    for name, answer in sorted(answers.items()):
        if isinstance(answer, QmqError):
            doc["errors"][name] = str(answer)
            continue
        doc["truncated"] = doc["truncated"] or bool(answer.get("truncated"))
        for copy in answer.get("stored", []):
            subject = str(copy["subject"])
            attempt = int(copy.get("attempt") or 1)
            attempt_of[(name, subject, int(copy["sequence"]))] = attempt
            if not subject.startswith("%"):
                if doc["stored"] is None:
                    doc["stored"] = {
                        "broker_group": name,
                        "subject": subject,
                        "sequence": copy["sequence"],
                        "at": copy["at"],
                    }
                    doc["subject"] = subject
                continue
            try:
                kind, origin, group = parse_internal_subject(subject)
            except InvalidSubjectError:
                continue
            doc["subject"] = doc["subject"] or origin
            resent = kind == "retry" and attempt == 1  # resend_dead resets the attempts (store/redelivery.py)
            if resent:  # it, and its pulls and acks, come after the dead letter it was
                attempt_of[(name, subject, int(copy["sequence"]))] = _AFTER_DEAD
            if kind == "retry":
                events.append(
                    {
                        "event": "resent" if resent else "retried",
                        "group": group,
                        "consumer_id": None,
                        "at": copy["at"],
                        "attempt": copy.get("attempt"),
                        "error": None if resent else copy.get("error"),
                        "subject": subject,
                        "broker_group": name,
                    }
                )
        events.extend({**e, "broker_group": name} for e in answer.get("events", []))
    events.extend(_nacks(events, attempt_of))
    # by time; where some event has none (logged by an older qmq, or known from a checkpoint only),
    # attempt by attempt: the copy's storing (retried), who pulled it, its ack; dead letters last
    order = {"retried": 0, "pulled": 1, "acked": 2, "nacked": 3, "dead_lettered": 4, "resent": 5}

    def place(e: dict[str, Any]) -> tuple[int, int, str]:
        if e["event"] in ("dead_lettered", "resent"):
            attempt = _AFTER_DEAD - 1 if e["event"] == "dead_lettered" else _AFTER_DEAD
        elif e["event"] in ("retried", "nacked"):
            attempt = int(e.get("attempt") or 1)
        else:
            attempt = attempt_of.get((e["broker_group"], e.get("subject", ""), int(e.get("sequence", -1))), 1)
        return attempt, order.get(e["event"], 9), e["at"] or ""

    if all(e["at"] for e in events):
        # RFC 3339 in UTC sorts as time; a nack is stored with its retry copy: it goes first
        events.sort(key=lambda e: (e["at"], -1 if e["event"] == "nacked" else order.get(e["event"], 9)))
    else:
        events.sort(key=place)
    doc["events"] = events
    return doc


def _nacks(events: list[dict[str, Any]], attempt_of: dict[tuple[str, str, int], int]) -> list[dict[str, Any]]:
    """A "nacked" event for each failed delivery: one per retry copy of a failed attempt (its
    attempt less one failed) and one per dead letter (its last attempt failed), naming the consumer
    that pulled the failed attempt's copy in that group when a "pulled" event tells."""
    pullers: dict[tuple[str, int], str] = {}  # (group, attempt) -> the consumer that pulled it
    for e in events:
        if e["event"] == "pulled" and e.get("consumer_id"):
            attempt = attempt_of.get((e["broker_group"], e.get("subject", ""), int(e.get("sequence", -1))))
            if attempt is not None and attempt != _AFTER_DEAD:
                pullers.setdefault((e["group"], attempt), e["consumer_id"])
    nacks = []
    for e in events:
        if e["event"] == "retried":
            failed = int(e.get("attempt") or 2) - 1
        elif e["event"] == "dead_lettered":
            failed = int(e.get("attempts") or 1)
        else:
            continue
        nacks.append(
            {
                "event": "nacked",
                "group": e["group"],
                "consumer_id": pullers.get((e["group"], failed)),
                "at": e["at"],
                "attempt": failed,
                "error": e.get("error"),
                "broker_group": e["broker_group"],
            }
        )
    return nacks


def trace_lines(doc: dict[str, Any]) -> list[str]:
    """The document as lines for people."""
    lines = [f"message {doc['message_id']}"]
    stored = doc["stored"]
    if stored is not None:
        lines.append(
            f"  stored         {stored['at']}  {stored['subject']} #{stored['sequence']} ({stored['broker_group']})"
        )
    for e in doc["events"]:
        at = e["at"] or "–" * 24
        who = f" consumer {e['consumer_id']}" if e.get("consumer_id") else ""
        more = ""
        if e["event"] in ("retried", "nacked"):
            more = f" attempt {e.get('attempt')}" + (f": {e['error']}" if e.get("error") else "")
        elif e["event"] == "dead_lettered":
            more = f" after {e.get('attempts')} attempts" + (f": {e['error']}" if e.get("error") else "")
            more += " (since resent or purged)" if e.get("removed") else ""
        elif e["event"] == "resent":
            more = " (the dead letter back on the retry subject)"
        elif e.get("subject", "").startswith("%"):
            more = " (a retry copy)"
        lines.append(f"  {e['event']:<14} {at}  group {e['group']}{who}{more} ({e['broker_group']})")
    if stored is None and not doc["events"]:
        lines.append("  no broker group holds it (retention may have removed it, or the id is wrong)")
    for name, error in doc["errors"].items():
        lines.append(f"  broker group {name} did not answer: {error}")
    if doc["truncated"]:
        lines.append("  (a broker group read its most records for one trace: older copies may be missing)")
    return lines
