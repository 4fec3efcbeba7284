"""Subject records — who owns a subject and what it is for — kept by the meta server in
``qmq_meta_subjects``:

    GET    /meta/subjects                 every record: {"subjects": [{subject, description, owner, created_ms}]}
    POST   /meta/subjects                 create one: {"subject", "description", "owner"}; 409 if it exists
    DELETE /meta/subjects?subject=S       remove one; 404 when there is none; 409 naming what
           [&force=true]                  remains while some group has not consumed it, messages
                                          wait with no group, or delay messages are pending
                                          (asked of every broker and delay group then:
                                          qmq.meta.broker_reads), unless ``force``

A record is what a person says of a subject; messages and consumer groups live on the brokers
(``qmq subjects``, ``qmq lag``). With an auth file, reading needs any known app and a change
an admin app (qmq.meta.server).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Final

import sqlalchemy as sa
from aiohttp import web

from qmq.common.errors import InvalidSubjectError
from qmq.common.naming import check_name
from qmq.meta.broker_reads import BrokerReads, credentials_of, describe_left
from qmq.meta.schema import OWNER_CHARS, SUBJECT_CHARS, metadata, name_type
from qmq.meta.store import MetaStore, MetaStoreError

SUBJECTS_PATH: Final = "/meta/subjects"
SUBJECTS_MAX: Final = 100_000
DESCRIPTION_CHARS: Final = 1_000

subjects_table = sa.Table(
    "qmq_meta_subjects",
    metadata,
    sa.Column("subject", name_type(SUBJECT_CHARS), primary_key=True),
    sa.Column("description", sa.String(DESCRIPTION_CHARS), nullable=False),
    sa.Column("owner", sa.String(OWNER_CHARS), nullable=False),
    sa.Column("created_ms", sa.BigInteger, nullable=False),
)

Call = Callable[..., Awaitable[Any]]


class SubjectRefusedError(MetaStoreError):
    retriable = False


class SubjectsStore:
    def __init__(self, store: MetaStore) -> None:
        self._store = store

    def create(self, row: dict[str, Any], now_ms: int) -> None:
        t = subjects_table
        with self._store.transaction("create a subject") as conn:
            if conn.scalar(sa.select(t.c.subject).where(t.c.subject == row["subject"])) is not None:
                raise SubjectRefusedError(
                    f"subject {row['subject']!r} exists already; delete it first or pick another name"
                )
            count = int(conn.scalar(sa.select(sa.func.count()).select_from(t)) or 0)
            if count >= SUBJECTS_MAX:
                raise SubjectRefusedError(f"the meta server keeps at most {SUBJECTS_MAX} subjects; delete one first")
            conn.execute(sa.insert(t).values(**row, created_ms=now_ms))

    def remove(self, subject: str) -> bool:
        t = subjects_table
        with self._store.transaction("delete a subject") as conn:
            return int(conn.execute(sa.delete(t).where(t.c.subject == subject)).rowcount) > 0

    def rows(self) -> list[dict[str, Any]]:
        t = subjects_table
        with self._store.transaction("read the subjects") as conn:
            rows = conn.execute(sa.select(t).order_by(t.c.subject).limit(SUBJECTS_MAX)).all()
        return [dict(r._mapping) for r in rows]


class SubjectError(ValueError):
    """A field of a subject record is wrong; the text names it."""


def parse_subject(doc: object) -> dict[str, Any]:
    """The row of a POST body; SubjectError naming the field at fault."""
    if not isinstance(doc, dict):
        raise SubjectError('the body must be a JSON object {"subject", "description", "owner"}')
    unknown = sorted(set(doc) - {"subject", "description", "owner"})
    if unknown:
        raise SubjectError(f"unknown field(s) {', '.join(unknown)}; known: subject, description, owner")
    try:
        subject = check_name("subject", doc.get("subject"))
    except InvalidSubjectError as exc:
        raise SubjectError(str(exc)) from None
    row: dict[str, Any] = {"subject": subject}
    for field, chars in (("description", DESCRIPTION_CHARS), ("owner", OWNER_CHARS)):
        value = doc.get(field, "")
        if not isinstance(value, str) or len(value) > chars:
            raise SubjectError(f"{field} must be a string of at most {chars} characters, got {value!r:.80}")
        row[field] = value
    if not row["owner"]:
        raise SubjectError("owner must not be empty: name the team or person who answers for the subject")
    return row


class SubjectsApi:
    """The subject routes of one meta server: ``call`` runs a function on its store thread."""

    def __init__(
        self,
        call: Call,
        store: Callable[[], SubjectsStore],
        now_ms: Callable[[], int],
        reads: BrokerReads | None = None,
    ) -> None:
        self._call = call
        self._store = store
        self._now_ms = now_ms
        self._reads = reads

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(SUBJECTS_PATH, self._list)
        app.router.add_post(SUBJECTS_PATH, self._create)
        app.router.add_delete(SUBJECTS_PATH, self._remove)

    async def _list(self, _request: web.Request) -> web.Response:
        rows = await self._call(lambda: self._store().rows())
        return web.json_response({"subjects": rows})

    async def _create(self, request: web.Request) -> web.Response:
        try:
            row = parse_subject(json.loads(await request.read()))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            return web.json_response({"error": f"{exc}"}, status=400)
        try:
            await self._call(lambda: self._store().create(row, self._now_ms()))
        except SubjectRefusedError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        return web.json_response({"ok": True, "subject": row}, status=201)

    async def _remove(self, request: web.Request) -> web.Response:
        subject = request.query.get("subject", "")
        force = request.query.get("force", "false")
        if force not in ("true", "false"):
            return web.json_response({"error": f"force = {force!r}: give true or false"}, status=400)
        missing = web.json_response({"error": f"no subject {subject!r} was created (`qmq subject list`)"}, status=404)
        known = {r["subject"] for r in await self._call(lambda: self._store().rows())}
        if subject not in known:
            return missing
        if force == "false" and self._reads is not None:
            left = await self._reads.left_of(subject, credentials_of(request))
            if left:
                return web.json_response({"error": describe_left(subject, left), "left": left}, status=409)
        removed = await self._call(lambda: self._store().remove(subject))
        if not removed:
            return missing
        return web.json_response({"ok": True, "subject": subject, "forced": force == "true"})
