"""What the meta server asks the brokers and delay servers at the moment of a request, over the
protocol (the servers never import one another): a consumer group's consumers (LAG pages of each
broker group's master) and what is left of a subject before its record is deleted (LAG of each of
its consumer groups, the messages no group has taken, DELAY_LIST of each delay group).

With an auth file, the meta server asks with the credentials of the HTTP request it answers (its
``Authorization``), so a caller sees through it only what it may read itself. Every list is
bounded; a server that cannot be asked is named, never waited on past ``ASK_TIMEOUT_MS``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from ssl import SSLContext
from typing import Any, Final, Literal

from aiohttp import web

from qmq.auth.handshake import ClientCredentials
from qmq.auth.http import HttpAuthError, parse_authorization
from qmq.client.connection import Connection
from qmq.client.pages import pages
from qmq.common.errors import BrokerError, InvalidSubjectError, QmqError
from qmq.common.naming import check_name, retry_subject
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode

CONSUMERS_PATH: Final = "/meta/groups/consumers"
ASK_TIMEOUT_MS: Final = 5_000
CONSUMERS_LISTED_MAX: Final = 1_000
# pages of one delay group's DELAY_LIST a delete reads at most (each scans up to 20,000 records)
DELAY_PAGES_MAX: Final = 50
# subjects a delete asks each delay group about: the subject and its groups' retry subjects
DELAY_SUBJECTS_MAX: Final = 100
_SUBJECT_PAGES_MAX: Final = 10_000
# what a broker answers LAG for a group that has never pulled a subject there, or a subject it does not know
_NEVER_PULLED: Final = ("has never pulled", "is unknown here")
# the SDK's consumer ids: <hostname>-<pid>-<6 hex> (qmq.client.options.default_consumer_id)
_SDK_ID: Final = re.compile(r"^(?P<host>.+)-(?P<pid>[0-9]+)-[0-9a-f]{6}$")

Role = Literal["broker", "delay"]
Masters = Callable[[Role], Awaitable[dict[str, str]]]  # role -> {group: master address}


def host_of(consumer_id: str) -> str | None:
    """The host an SDK-made consumer id names, or None for an id set by hand."""
    m = _SDK_ID.match(consumer_id)
    return m.group("host") if m else None


class NotKnownError(QmqError):
    """No broker group knows the consumer group (or the subject)."""


def _never_pulled(exc: BaseException) -> bool:
    return isinstance(exc, BrokerError) and any(s in str(exc) for s in _NEVER_PULLED)


class BrokerReads:
    """``masters(role)`` gives the available groups' master addresses of a role ("broker", "delay")."""

    def __init__(self, masters: Masters, ssl: SSLContext | None) -> None:
        self._masters = masters
        self._ssl = ssl

    @asynccontextmanager
    async def _connections(
        self, role: Role, credentials: ClientCredentials | None
    ) -> AsyncIterator[dict[str, Connection]]:
        masters = await self._masters(role)
        conns = {
            name: Connection(address, connect_timeout_ms=ASK_TIMEOUT_MS, credentials=credentials, ssl=self._ssl)
            for name, address in sorted(masters.items())
        }
        try:
            yield conns
        finally:
            await asyncio.gather(*(c.close() for c in conns.values()), return_exceptions=True)

    async def _lag(
        self, conns: dict[str, Connection], subject: str, group: str, consumers_max: int
    ) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]], list[str]]:
        """({broker group: LAG figures}, up to ``consumers_max`` consumers, unreachable broker groups)."""

        async def one(name: str, conn: Connection) -> tuple[dict[str, Any], list[dict[str, Any]]]:
            listed: list[dict[str, Any]] = []
            first: dict[str, Any] | None = None
            async with asyncio.timeout(ASK_TIMEOUT_MS / 1000):
                header = {"subject": subject, "group": group, "limit": min(consumers_max, 1000) or 0}
                async with aclosing(pages(conn, RequestCode.LAG, header)) as listing:
                    async for page in listing:
                        first = first or page
                        for c in page.get("consumers", []):
                            if len(listed) >= consumers_max:
                                break
                            listed.append({**c, "broker_group": name})
                        if len(listed) >= consumers_max:
                            break
            assert first is not None  # pages yields at least one page
            return first, listed

        names = list(conns)
        results = await asyncio.gather(*(one(n, conns[n]) for n in names), return_exceptions=True)
        answers: dict[str, dict[str, Any]] = {}
        consumers: list[dict[str, Any]] = []
        unreachable: list[str] = []
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                if _never_pulled(result):
                    continue
                if not isinstance(result, QmqError | OSError | TimeoutError):
                    raise result
                unreachable.append(name)
                continue
            answers[name], listed = result
            consumers += listed
        return answers, consumers, unreachable

    async def consumers(
        self, subject: str, group: str, credentials: ClientCredentials | None, listed_max: int = CONSUMERS_LISTED_MAX
    ) -> dict[str, Any]:
        """The group's consumers on every broker group (up to ``listed_max``) and its totals;
        NotKnownError when no broker group knows it."""
        async with self._connections("broker", credentials) as conns:
            answers, consumers, unreachable = await self._lag(conns, subject, group, listed_max)
        if not answers and not unreachable:
            raise NotKnownError(
                f"consumer group {group!r} has never pulled {subject!r} on any broker group "
                "(`qmq subject list` lists the subjects and their groups)"
            )
        total = sum(int(a.get("consumers_total", 0)) for a in answers.values())
        consumers.sort(key=lambda c: (str(c["consumer_id"]), c["broker_group"]))
        del consumers[listed_max:]  # each broker group listed up to the bound: the whole list is bounded too
        return {
            "subject": subject,
            "group": group,
            "backlog": sum(int(a.get("backlog", 0)) for a in answers.values()),
            "unacked": sum(int(a.get("unacked", 0)) for a in answers.values()),
            "consumers_total": total,
            "truncated": total > len(consumers),
            "consumers": [
                {
                    "consumer_id": c["consumer_id"],
                    "host": host_of(str(c["consumer_id"])),
                    "broker_group": c["broker_group"],
                    "since_ms": c.get("since_ms"),
                    "last_seen_ms": c.get("last_seen_ms"),
                    "unacked": c.get("unacked", 0),
                    "offline": bool(c.get("offline")),
                }
                for c in consumers
            ],
            "unreachable": unreachable,
        }

    async def ordered(self, subject: str, group: str, credentials: ClientCredentials | None) -> bool:
        """Whether a broker group knows ``group`` of ``subject`` as ordered (it pulled ``ordered``);
        a broker group that cannot be asked, or never saw the group, says nothing."""
        async with self._connections("broker", credentials) as conns:
            answers, _consumers, _unreachable = await self._lag(conns, subject, group, 0)
        return any(bool(a.get("ordered")) for a in answers.values())

    async def left_of(self, subject: str, credentials: ClientCredentials | None) -> list[dict[str, Any]]:
        """What remains of ``subject``: per consumer group what it has not pulled and not
        acknowledged, the messages no group has taken, the delay messages pending, and the
        servers that could not be asked (their part is unknown). Empty: nothing remains."""
        left: list[dict[str, Any]] = []
        unreachable: set[str] = set()
        async with self._connections("broker", credentials) as conns:
            groups: set[str] = set()
            loose = 0
            for name, conn in conns.items():
                try:
                    async with asyncio.timeout(ASK_TIMEOUT_MS / 1000):
                        found = await _groups_of(conn, subject)
                        groups |= found
                        if not found:
                            loose += await _messages_of(conn, subject)
                except (QmqError, OSError, TimeoutError):
                    unreachable.add(f"broker group {name}")
            for group in sorted(groups):
                backlog = unacked = 0
                # the group's retry subject too: what it failed and has not consumed again
                for pulled in (subject, retry_subject(subject, group)):
                    answers, _consumers, missed = await self._lag(conns, pulled, group, 0)
                    unreachable.update(f"broker group {n}" for n in missed)
                    backlog += sum(int(a.get("backlog", 0)) for a in answers.values())
                    unacked += sum(int(a.get("unacked", 0)) for a in answers.values())
                if backlog or unacked:
                    left.append({"group": group, "backlog": backlog, "unacked": unacked})
            if loose:
                left.append({"group": None, "messages": loose})
        # delay messages of the subject, and retries of its groups waiting for their back-off
        delayed = [subject, *(retry_subject(subject, g) for g in sorted(groups))][:DELAY_SUBJECTS_MAX]
        async with self._connections("delay", credentials) as conns:
            for name, conn in conns.items():
                try:
                    pending = [await self._delay_pending(conn, d) for d in delayed]
                except (QmqError, OSError, TimeoutError):
                    unreachable.add(f"delay group {name}")
                    continue
                if any(pending):
                    known = [p for p in pending if isinstance(p, int)]
                    count: int | str = "unknown" if len(known) < len(pending) else sum(known)
                    left.append({"delay_pending": count, "delay_group": name})
        return left + [{"unreachable": u} for u in sorted(unreachable)]

    async def _delay_pending(self, conn: Connection, subject: str) -> int | str:
        """Pending delay messages of ``subject`` on one delay group: 0, a count, or "unknown"
        when ``DELAY_PAGES_MAX`` pages did not finish the walk."""
        header: dict[str, Any] = {"subject": subject, "limit": 10_000}
        n = 0
        for _ in range(DELAY_PAGES_MAX):
            async with asyncio.timeout(ASK_TIMEOUT_MS / 1000):
                doc = answer_of(await conn.request(RequestCode.DELAY_LIST, header))
            n += len(doc.get("messages", []))
            if n or doc.get("next") is None:
                return n
            header["after"] = doc["next"]
        return "unknown"


async def _groups_of(conn: Connection, subject: str) -> set[str]:
    """The consumer groups ``subject`` has on one broker (SUBJECTS pages from the subject on)."""
    groups: set[str] = set()
    header: dict[str, Any] = {"after": [subject, ""], "limit": 1}
    for _ in range(_SUBJECT_PAGES_MAX):
        doc = answer_of(await conn.request(RequestCode.SUBJECTS, header))
        items = doc.get("subjects", [])
        for item in items:
            if item.get("subject") != subject:
                return groups
            groups.update(str(g) for g in item.get("groups", []))
        if not items or doc.get("next") is None:
            return groups
        header["after"] = doc["next"]
    return groups


async def _messages_of(conn: Connection, subject: str) -> int:
    """The messages one broker keeps of ``subject`` (READ's bounds; 0 for a subject it does not know)."""
    header = {"subject": subject, "from": 0, "max": 1}
    reply = await conn.request(RequestCode.READ, header)
    doc = answer_of(reply)
    return max(0, int(doc.get("end", 0)) - int(doc.get("start", 0)))


def describe_left(subject: str, left: list[dict[str, Any]]) -> str:
    """One sentence naming what remains of ``subject``."""
    parts: list[str] = []
    for item in left:
        if "unreachable" in item:
            parts.append(f"{item['unreachable']} cannot be asked, so what it holds is unknown")
        elif "delay_pending" in item:
            parts.append(f"{item['delay_pending']} delay message(s) pending on delay group {item['delay_group']}")
        elif item.get("group") is None:
            parts.append(f"{item['messages']:,} message(s) no consumer group has pulled")
        else:
            parts.append(f"group {item['group']!r}: {item['backlog']:,} not pulled, {item['unacked']:,} unacknowledged")
    return (
        f"cannot delete subject {subject!r}: it is not empty ({'; '.join(parts)}); let the consumers finish, reset "
        "their offset (`qmq reset-offset`), or delete it anyway with --force (force=true)"
    )


def credentials_of(request: web.Request) -> ClientCredentials | None:
    """The caller's app and secret (its Basic ``Authorization``), to ask the servers as it; None without."""
    value = request.headers.get("Authorization")
    if not value:
        return None
    try:
        app_code, secret = parse_authorization(value)
    except HttpAuthError:
        return None
    return ClientCredentials(app_code, secret)


class GroupsApi:
    """``GET /meta/groups/consumers?subject=S&group=G``: a group's consumers, from the brokers.
    ``paused(subject, group)`` says whether the group is paused (the control records)."""

    def __init__(self, reads: BrokerReads, paused: Callable[[str, str], Awaitable[bool]]) -> None:
        self._reads = reads
        self._paused = paused

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(CONSUMERS_PATH, self._consumers)

    async def _consumers(self, request: web.Request) -> web.Response:
        try:
            subject = check_name("subject", request.query.get("subject", ""))
            group = check_name("consumer group", request.query.get("group", ""))
        except InvalidSubjectError as exc:
            return web.json_response({"error": f"{exc}; ask ?subject=S&group=G"}, status=400)
        try:
            doc = await self._reads.consumers(subject, group, credentials_of(request))
        except NotKnownError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        except QmqError as exc:
            return web.json_response({"error": f"the brokers could not be asked: {exc}"}, status=503)
        doc["paused"] = await self._paused(subject, group)
        return web.json_response(doc)
