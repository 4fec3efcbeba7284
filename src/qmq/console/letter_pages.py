"""Dead letters (``/console/dead-letters``): a group's letters with attempts and last error,
one letter's body, resend and purge — the calls of ``qmq dead-letters``, ``qmq resend-dead`` and
``qmq purge-dead`` (and DEAD_LETTERS of one message id, for the body)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from qmq.common.errors import QmqError
from qmq.console.base import ActionRefused, Console, action, changed, field, flash, page

_LISTED_MAX = 200  # letters listed per broker group
_COPIES_MAX = 10  # letters of one message id shown (it may have died more than once)


def add_routes(console: Console, app: web.Application) -> None:
    app.router.add_get("/console/dead-letters", page(console, letters_page))
    app.router.add_get("/console/dead-letters/letter", page(console, letter_page))
    app.router.add_post("/console/dead-letters/resend", action(console, _resend))
    app.router.add_post("/console/dead-letters/purge", action(console, _purge))


async def letters_page(console: Console, request: web.Request) -> web.StreamResponse:
    from qmq.cli.group_commands import _dead_letters
    from qmq.cli.subject_commands import held_by_brokers

    subject, group = request.query.get("subject", "").strip(), request.query.get("group", "").strip()
    held = await held_by_brokers(console.meta_server)
    choices = [(s, g) for s, h in sorted(held.items()) for g in h["consumer_groups"]]
    letters: list[dict[str, Any]] = []
    total = None
    if subject and group:
        total = await _dead_letters(console.meta_server, subject, group, _LISTED_MAX, letters.append)
    context: dict[str, Any] = {"subject": subject, "group": group, "letters": letters, "total": total}
    if request.query.get("part") == "list":
        return console.render("letters_list.html", **context)
    return console.render("letters.html", title="Dead letters", active="dead", choices=choices, **context)


async def letter_page(console: Console, request: web.Request) -> web.StreamResponse:
    from qmq.cli.admin import ask_every_broker
    from qmq.protocol.codes import RequestCode

    subject, group = request.query.get("subject", ""), request.query.get("group", "")
    message_id = request.query.get("message_id", "")
    header = {"subject": subject, "group": group, "message_id": message_id, "limit": _COPIES_MAX}
    answers = await ask_every_broker(console.meta_server, RequestCode.DEAD_LETTERS, header)
    copies: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for name, answer in sorted(answers.items()):
        if isinstance(answer, QmqError):
            errors[name] = str(answer)
            continue
        for letter in answer.get("letters", []):
            body = bytes(letter.get("body", b""))
            try:
                text, binary = body.decode("utf-8"), False
            except UnicodeDecodeError:
                text, binary = body.hex(" "), True
            copies.append({**letter, "broker_group": name, "body_text": text, "binary": binary})
    return console.render(
        "letter.html",
        title=f"Dead letter {message_id}",
        active="dead",
        subject=subject,
        group=group,
        message_id=message_id,
        copies=copies,
        errors=errors,
    )


def _selection(form: Any) -> dict[str, Any]:
    if form.get("all"):
        return {"all": True}
    message_id = field(form, "message_id", required=False)
    if not message_id:
        raise ActionRefused("choose a dead letter (its message id) or all of them")
    return {"message_id": message_id}


async def _resend(console: Console, request: web.Request) -> web.StreamResponse:
    from qmq.cli.group_commands import _answers
    from qmq.protocol.codes import RequestCode

    form = await request.post()
    header = {"subject": field(form, "subject"), "group": field(form, "group"), **_selection(form)}
    answers = await asyncio.to_thread(_answers, console.meta_server, RequestCode.RESEND_DEAD, header)
    return changed(flash(console, f"resent {sum(h['resent'] for h in answers.values())} dead letter(s)"))


async def _purge(console: Console, request: web.Request) -> web.StreamResponse:
    from qmq.cli.group_commands import _answers
    from qmq.protocol.codes import RequestCode

    form = await request.post()
    header = {"subject": field(form, "subject"), "group": field(form, "group"), **_selection(form)}
    answers = await asyncio.to_thread(_answers, console.meta_server, RequestCode.PURGE_DEAD, header)
    return changed(flash(console, f"purged {sum(h['purged'] for h in answers.values())} dead letter(s)"))
