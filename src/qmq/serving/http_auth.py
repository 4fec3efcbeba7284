"""The ``Authorization`` check of an HTTP role with an auth file (the meta server, the gateway):
an aiohttp middleware that authenticates each request (HTTP Basic, ``qmq.auth.http``) and
checks the action its route needs (``qmq.auth.permissions``).

A role says what each route needs with ``needs(request)``: an ``Action`` (``CLUSTER`` for
registration, ``ADMIN`` for promotion), ``AUTHENTICATED`` for any known app, or ``OPEN`` for
none (``/health``). A refusal is 401 (no or a wrong secret) or 403 (the app may not), with a
JSON body naming the app, the action and the path and nothing else, counted by reason and
logged without the secret.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Literal

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from qmq.auth.file import App, AuthConfig
from qmq.auth.http import HttpAuthError, HttpVerifier, parse_authorization
from qmq.auth.permissions import Action

log = logging.getLogger(__name__)

Need = Action | Literal["authenticated", "open"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
APP_KEY: web.RequestKey[App] = web.RequestKey("qmq_app", App)  # the authenticated app of a request


class HttpAuth:
    """The auth file of an HTTP role, its verifier and its denial counter; ``middleware`` gates requests."""

    def __init__(self, auth: AuthConfig, needs: Callable[[web.Request], Need], registry: CollectorRegistry) -> None:
        self.verifier = HttpVerifier(auth)
        self._needs = needs
        self.denials = Counter(
            "qmq_http_auth_denials",
            "HTTP requests refused by the auth file, by reason: unauthenticated (no or a wrong secret, 401), "
            "forbidden (an action the app may not do, 403)",
            ["reason"],
            registry=registry,
        )

    def reload(self, auth: AuthConfig) -> None:
        self.verifier.reload(auth)

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
            body = {"error": str(exc), "app": exc.app_code, "action": "authenticate"}
            return web.json_response(body, status=401, headers={"WWW-Authenticate": 'Basic realm="qmq"'})
        if need != "authenticated" and not app.grants.allows(need):
            self.denials.labels("forbidden").inc()
            log.warning("refused %s %s of app %r: %s", request.method, request.path, app.code, need.value)
            text = (
                f"app {app.code!r} may not {need.value} ({request.method} {request.path}); "
                f"ask for it in the auth file's [apps.{app.code}] (docs/security.md)"
            )
            return web.json_response({"error": text, "app": app.code, "action": need.value}, status=403)
        request[APP_KEY] = app
        return await handler(request)
