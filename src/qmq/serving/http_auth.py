"""The ``Authorization`` check of an HTTP role with an auth file (the meta server, the gateway):
an aiohttp middleware that authenticates each request (HTTP Basic, ``qmq.auth.http``) and
checks the action its route needs (``qmq.auth.permissions``).

A role says what each route needs with ``needs(request)``: an ``Action`` (``CLUSTER`` for
registration, ``ADMIN`` for promotion), an (action, subject, group) triple (the gateway's send
to a subject), ``"authenticated"`` for any known app, or ``"open"`` for none (``/health``).
A refusal is 401 (no or a wrong secret) or 403 (the app may not), with a body naming the app,
the action and the subject and nothing else (``render`` shapes it), counted by reason and
logged without the secret.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from qmq.auth.file import App, AuthConfig, load_auth_file
from qmq.auth.http import HttpAuthError, HttpVerifier, parse_authorization
from qmq.auth.permissions import Action
from qmq.common.errors import ConfigError

log = logging.getLogger(__name__)

Need = Action | tuple[Action, str | None, str | None] | Literal["authenticated", "open"]
# answers a refusal: (HTTP status, {"error", "app", "action"[, "subject"]}) → the response
Render = Callable[[int, dict[str, Any]], web.Response]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
APP_KEY: web.RequestKey[App] = web.RequestKey("qmq_app", App)  # the authenticated app of a request


class HttpAuth:
    """The auth file of an HTTP role, its verifier and its denial counter; ``middleware`` gates requests."""

    def __init__(
        self,
        auth: AuthConfig,
        needs: Callable[[web.Request], Need],
        registry: CollectorRegistry,
        render: Render | None = None,
    ) -> None:
        self.verifier = HttpVerifier(auth)
        self._needs = needs
        self._render: Render = render or _json_refusal
        self.denials = Counter(
            "qmq_http_auth_denials",
            "HTTP requests refused by the auth file, by reason: unauthenticated (no or a wrong secret, 401), "
            "forbidden (an action the app may not do, 403)",
            ["reason"],
            registry=registry,
        )

    def reload(self, auth: AuthConfig) -> None:
        self.verifier.reload(auth)

    def reload_file(self, path: str) -> None:
        """Read the auth file again (SIGHUP); a wrong new file is logged and the old one kept."""
        try:
            auth = load_auth_file(Path(path))
        except ConfigError as exc:
            log.error("SIGHUP: kept the auth file in use, the new one is wrong: %s", exc)
            return
        self.reload(auth)
        log.info("SIGHUP: reloaded %s, %d app(s)", path, len(auth.apps))

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        need = self._needs(request)
        if need == "open":
            return await handler(request)
        try:
            app_code, secret = parse_authorization(request.headers.get("Authorization"))
            verifier = self.verifier
            if verifier.known(app_code, secret):
                app = verifier.verify(app_code, secret)
            else:  # scrypt: off the event loop
                app = await asyncio.get_running_loop().run_in_executor(None, verifier.verify, app_code, secret)
        except HttpAuthError as exc:
            self.denials.labels("unauthenticated").inc()
            log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, exc)
            body: dict[str, Any] = {"error": str(exc), "app": exc.app_code, "action": "authenticate"}
            response = self._render(401, body)
            response.headers["WWW-Authenticate"] = 'Basic realm="qmq"'
            return response
        if need != "authenticated":
            action, subject, group = need if isinstance(need, tuple) else (need, None, None)
            if not app.grants.allows(action, subject, group):
                self.denials.labels("forbidden").inc()
                what = f"{action.value} {subject!r}" if subject is not None else action.value
                log.warning("refused %s %s of app %r: %s", request.method, request.path, app.code, what)
                text = (
                    f"app {app.code!r} may not {what} ({request.method} {request.path}); "
                    f"ask for it in the auth file's [apps.{app.code}] (docs/security.md)"
                )
                body = {"error": text, "app": app.code, "action": action.value}
                if subject is not None:
                    body["subject"] = subject
                return self._render(403, body)
        request[APP_KEY] = app
        return await handler(request)


def _json_refusal(status: int, body: dict[str, Any]) -> web.Response:
    return web.json_response(body, status=status)
