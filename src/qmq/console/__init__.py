"""The web console, served by the meta server at ``/console`` (docs/console.md).

Server-rendered pages (Jinja2 templates) made live with htmx and charted with uPlot, both
vendored under ``static/vendor`` with their licences, so the console needs no network beyond
the cluster. It reads and acts only through what the ``qmq`` command uses: the meta server's
HTTP API and the brokers' and delay servers' admin requests, by calling the command's own
functions (``qmq.cli``) as the person signed in.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from qmq.console.base import CONSOLE_PATH, STATIC_DIR, Console, page

__all__ = ["CONSOLE_PATH", "ConsoleApi"]


class ConsoleApi:
    """The console's routes; ``add_routes(app)`` puts them on the meta server's application."""

    def __init__(self, meta_server: Callable[[], str], *, auth: bool) -> None:
        """``meta_server()``: the meta server's own ``meta_server`` URL, once it listens;
        ``auth``: whether it has an auth file (then every console request carries an admin's
        HTTP Basic credentials, checked by its middleware)."""
        self.console = Console(meta_server, auth=auth)

    def add_routes(self, app: web.Application) -> None:
        from qmq.console import (
            cluster_pages,
            delay_pages,
            group_pages,
            letter_pages,
            message_pages,
            plane_pages,
            subject_pages,
        )

        c = self.console
        r = app.router
        r.add_get(CONSOLE_PATH, _to_home)
        r.add_get(CONSOLE_PATH + "/", page(c, cluster_pages.cluster))
        r.add_static(CONSOLE_PATH + "/static", STATIC_DIR)
        group_pages.add_routes(c, app)
        subject_pages.add_routes(c, app)
        letter_pages.add_routes(c, app)
        delay_pages.add_routes(c, app)
        message_pages.add_routes(c, app)
        plane_pages.add_routes(c, app)
        app.on_cleanup.append(self._close)

    async def _close(self, _app: web.Application) -> None:
        await self.console.sampler.close()


async def _to_home(_request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound(CONSOLE_PATH + "/")
