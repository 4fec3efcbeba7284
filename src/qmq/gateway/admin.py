"""The gateway's read-and-manage routes: subjects, a group's lag, and dead letters (list,
resend, purge), asked of every available broker group's master and merged, as the CLI does.

It keeps its own meta client (kept fresh) and connections; every listing is bounded.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from ssl import SSLContext
from typing import Any, Final

from qmq.client.connection import ConnectionPool
from qmq.client.failure import is_internal
from qmq.client.meta import MetaClient
from qmq.client.options import ConnectOptions, authorization_of, credentials_of, secret_of
from qmq.client.pages import pages
from qmq.client.pages import subjects as subjects_of
from qmq.common.errors import BrokerError, NoBrokerError, QmqError
from qmq.gateway.errors import ApiError, bad_request
from qmq.gateway.payload import json_object
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode

_TIMEOUT_MS: Final = 10_000
# The most subjects one GET /v1/subjects lists (more: "truncated": true).
SUBJECTS_MAX: Final = 10_000
# The most consumers one lag answer lists per broker group.
LAG_CONSUMERS_MAX: Final = 10_000
DEAD_LETTERS_LIMIT_MAX: Final = 1_000
DEAD_LETTERS_LIMIT_DEFAULT: Final = 100
# what a broker answers LAG for a group that never pulled there / a subject it does not know
_NEVER_PULLED: Final = "has never pulled"
_UNKNOWN_SUBJECT: Final = "is unknown here"


class Admin:
    """The gateway's listing and dead-letter calls, as its own app (``app_code`` and
    $QMQ_SECRET, like its SDK clients) and over TLS when ``ssl`` is given."""

    def __init__(self, meta_server: str, app_code: str, ssl: SSLContext | None = None) -> None:
        options = ConnectOptions(secret=secret_of(None))
        self.meta = MetaClient(
            meta_server, timeout_ms=_TIMEOUT_MS, authorization=authorization_of(app_code, options), ssl=ssl
        )
        self.pool = ConnectionPool(
            connect_timeout_ms=_TIMEOUT_MS, credentials=credentials_of(app_code, options), ssl=ssl
        )

    async def start(self) -> None:
        await self.meta.start()

    async def stop(self) -> None:
        await self.meta.close()
        await self.pool.close()

    async def _brokers(self) -> dict[str, Any]:
        if not self.meta.groups:
            await self.meta.fresh()  # none at the last refresh: a broker may have started beside this gateway
        groups = dict(sorted(self.meta.groups.items()))
        if not groups:
            raise NoBrokerError(
                f"the meta server {self.meta.url} knows no available broker group; is a broker running?"
            )
        return {name: self.pool.get(g.address) for name, g in groups.items()}

    async def _ask_each(self, code: int, header: dict[str, Any]) -> dict[str, dict[str, Any] | QmqError]:
        conns = await self._brokers()

        async def ask(conn: Any) -> dict[str, Any]:
            async with asyncio.timeout(_TIMEOUT_MS / 1000):
                return answer_of(await conn.request(code, dict(header)))

        results = await asyncio.gather(*(ask(c) for c in conns.values()), return_exceptions=True)
        out: dict[str, dict[str, Any] | QmqError] = {}
        for name, result in zip(conns, results, strict=True):
            if isinstance(result, TimeoutError):
                out[name] = BrokerError(
                    0, "TIMEOUT", f"broker group {name} did not answer in {_TIMEOUT_MS} ms", retriable=True
                )
            elif isinstance(result, QmqError):
                out[name] = result
            elif isinstance(result, BaseException):
                raise result
            else:
                out[name] = result
        return out

    async def subjects(self, include_internal: bool) -> dict[str, Any]:
        merged: dict[str, dict[str, Any]] = {}
        truncated = False
        for name, conn in (await self._brokers()).items():
            async with aclosing(subjects_of(conn)) as listing:
                async for item in listing:
                    subject = str(item["subject"])
                    if is_internal(subject) and not include_internal:
                        continue
                    entry = merged.get(subject)
                    if entry is None:
                        if len(merged) >= SUBJECTS_MAX:
                            truncated = True
                            break
                        entry = merged[subject] = {
                            "subject": subject,
                            "messages": 0,
                            "consumer_groups": set(),
                            "broker_groups": {},
                        }
                    entry["messages"] += int(item.get("messages", 0))
                    entry["consumer_groups"].update(item.get("groups", []))
                    entry["broker_groups"][name] = int(item.get("messages", 0))
        listed = [{**e, "consumer_groups": sorted(e["consumer_groups"])} for _k, e in sorted(merged.items())]
        return {"subjects": listed, "truncated": truncated}

    async def lag(self, subject: str, group: str) -> dict[str, Any]:
        header = {"subject": subject, "group": group}
        answers: dict[str, dict[str, Any]] = {}
        unknown = 0
        conns = await self._brokers()
        for name, answer in (await self._ask_each(RequestCode.LAG, header)).items():
            if isinstance(answer, QmqError):
                if isinstance(answer, BrokerError) and (
                    _NEVER_PULLED in str(answer) or _UNKNOWN_SUBJECT in str(answer)
                ):
                    unknown += _UNKNOWN_SUBJECT in str(answer)
                    continue
                raise answer
            answers[name] = answer
        if not answers:
            if unknown == len(conns):
                raise ApiError(404, "SUBJECT_UNKNOWN", f"subject {subject!r} is unknown: no broker group holds it")
            raise ApiError(404, "GROUP_UNKNOWN", f"consumer group {group!r} has never pulled {subject!r}")
        consumers: list[dict[str, Any]] = []
        for name, first in answers.items():
            taken = [{**c, "broker_group": name} for c in first.get("consumers", [])]
            if first.get("next") is not None:
                async with aclosing(pages(conns[name], RequestCode.LAG, {**header, "after": first["next"]})) as more:
                    async for doc in more:
                        taken += [{**c, "broker_group": name} for c in doc.get("consumers", [])]
                        if len(taken) >= LAG_CONSUMERS_MAX:
                            break
            consumers += taken[:LAG_CONSUMERS_MAX]
        groups = {n: {k: v for k, v in h.items() if k not in ("consumers", "next")} for n, h in answers.items()}
        return {
            "subject": subject,
            "group": group,
            "backlog": sum(int(h.get("backlog", 0)) for h in groups.values()),
            "unacked": sum(int(h.get("unacked", 0)) for h in groups.values()),
            "broker_groups": groups,
            "consumers": consumers,
        }

    async def dead_letters(self, subject: str, group: str, limit: int) -> dict[str, Any]:
        letters: list[dict[str, Any]] = []
        total = 0
        for name, conn in (await self._brokers()).items():
            shown = held = 0
            header = {"subject": subject, "group": group, "limit": limit}
            async with aclosing(pages(conn, RequestCode.DEAD_LETTERS, header)) as listing:
                async for page in listing:
                    held = int(page["total"])
                    for letter in page["letters"][: limit - shown]:
                        letters.append({**letter, "broker_group": name})
                    shown += len(page["letters"])
                    if shown >= limit:
                        break
            total += held
        return {"subject": subject, "group": group, "total": total, "letters": letters}

    async def act_on_dead(self, subject: str, group: str, action: str, raw: bytes) -> dict[str, Any]:
        doc = json_object(raw)
        message_id, all_ = doc.get("message_id"), doc.get("all", False)
        if set(doc) - {"message_id", "all"} or not isinstance(all_, bool) or bool(message_id) == all_:
            raise bad_request("BODY_INVALID", 'send exactly one of {"message_id": "..."} or {"all": true}')
        if message_id is not None and not isinstance(message_id, str):
            raise bad_request("BODY_INVALID", "message_id must be a string")
        selection: dict[str, Any] = {"message_id": message_id} if message_id else {"all": True}
        code, key = (RequestCode.RESEND_DEAD, "resent") if action == "resend" else (RequestCode.PURGE_DEAD, "purged")
        answers = await self._ask_each(code, {"subject": subject, "group": group, **selection})
        for answer in answers.values():
            if isinstance(answer, QmqError):
                raise answer
        return {key: sum(int(a[key]) for a in answers.values() if isinstance(a, dict))}
