"""The console's routes on the meta server's aiohttp application, and what every page and
action shares: the person it acts for, the CSRF check, rendering and errors.

Who: with an auth file, the meta server's middleware has already checked that the request's
HTTP Basic credentials are an admin app (``/console`` needs ``admin``, qmq.meta.server), so a
browser asks for them with its own login box; the console then runs the CLI's calls as that
app (``ACTING_FOR``), through the same HTTP API and broker requests, with its permissions.

CSRF: a browser sends Basic credentials with any request to the site, a forged cross-site form
post too; every action (POST) must carry htmx's ``HX-Request`` header, which a cross-site form
cannot set and a cross-site script cannot send without a CORS preflight the meta server never
grants, and, when the browser says where it comes from, an ``Origin`` of this very server.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import click
import jinja2
from aiohttp import web

from qmq.auth.http import HttpAuthError, parse_authorization
from qmq.cli.auth_commands import ACTING_FOR
from qmq.common.errors import QmqError
from qmq.console.history import Sampler

log = logging.getLogger(__name__)

CONSOLE_PATH: Final = "/console"
STATIC_DIR: Final = Path(__file__).parent / "static"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Page = Callable[["Console", web.Request], Awaitable[web.StreamResponse]]


class ActionRefused(QmqError):
    """An action the console will not do as asked (a missing field, no confirmation)."""


class Console:
    """What pages and actions need: the meta server's URL, the sampler, the templates."""

    def __init__(self, meta_server: Callable[[], str], *, auth: bool) -> None:
        self._meta_server = meta_server
        self.auth = auth
        self.sampler = Sampler(meta_server)
        self.templates = jinja2.Environment(
            loader=jinja2.PackageLoader("qmq.console", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.templates.filters["thousands"] = lambda n: "–" if n is None else f"{n:,}"
        self.templates.filters["rate"] = lambda r: "–" if r is None else f"{r:,.1f}"
        self.templates.filters["utc"] = _utc

    @property
    def meta_server(self) -> str:
        """The ``meta_server`` URL the CLI takes (``.../meta/address``)."""
        return self._meta_server()

    def render(self, template: str, status: int = 200, **context: Any) -> web.Response:
        text = self.templates.get_template(template).render(**context)
        return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


def _acting(console: Console, request: web.Request) -> tuple[str, str] | None:
    """The app and secret the request authenticated with (None without an auth file): the
    console's calls go out as that app, never as the meta server's own environment."""
    if not console.auth:
        return ("", "")  # no secret: the CLI's calls go out without credentials
    try:
        return parse_authorization(request.headers.get("Authorization"))
    except HttpAuthError:  # the middleware let it through: cannot happen with an auth file
        return None


def _check_action(request: web.Request) -> None:
    if request.headers.get("HX-Request") != "true":
        raise web.HTTPForbidden(text="console actions are sent by its pages (htmx), not by plain forms")
    origin = request.headers.get("Origin")
    if origin is not None and origin != f"{request.scheme}://{request.host}":
        raise web.HTTPForbidden(text=f"console actions come from the console itself, not from {origin}")


def page(console: Console, fn: Page) -> Handler:
    """A page: rendered as the person asking; a failure of the cluster is shown on an error page."""

    async def handle(request: web.Request) -> web.StreamResponse:
        token = ACTING_FOR.set(_acting(console, request))
        try:
            console.sampler.touch()
            return await fn(console, request)
        except (QmqError, click.ClickException) as exc:
            log.info("console page %s: %s", request.path, _said(exc))
            return console.render("error.html", status=502, title="Error", active="", error=_said(exc))
        finally:
            ACTING_FOR.reset(token)

    return handle


def action(console: Console, fn: Page) -> Handler:
    """An action: its answer is a fragment htmx puts in the page; a refusal is shown there too
    (an HTTP 200 carrying the message, as htmx swaps only successful answers)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        _check_action(request)
        token = ACTING_FOR.set(_acting(console, request))
        try:
            return await fn(console, request)
        except (QmqError, click.ClickException) as exc:
            log.info("console action %s: %s", request.path, _said(exc))
            return console.render("flash.html", ok=False, text=_said(exc))
        finally:
            ACTING_FOR.reset(token)

    return handle


def flash(console: Console, text: str) -> web.Response:
    return console.render("flash.html", ok=True, text=text)


def changed(response: web.Response) -> web.Response:
    """Tell the page to read what the action changed again (the htmx event ``qmq-changed``)."""
    response.headers["HX-Trigger"] = "qmq-changed"
    return response


def _utc(ms: object) -> str:
    """An epoch time in ms as ISO 8601 UTC to the second ("–" for none)."""
    if not isinstance(ms, int | float) or ms <= 0:
        return "–"
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _said(exc: BaseException) -> str:
    if isinstance(exc, click.ClickException):
        return exc.format_message()
    return str(exc)


def field(form: Any, name: str, *, required: bool = True) -> str:
    """A form field, stripped; ActionRefused naming it when required and empty."""
    value = str(form.get(name, "")).strip()
    if required and not value:
        raise ActionRefused(f"{name.replace('_', ' ')} is empty; fill it in")
    return value
