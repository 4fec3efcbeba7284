"""HTTP push in a gateway: hold leases of push subscriptions from the meta server and run a
``PushRunner`` (``qmq.gateway.push_delivery``) for each one held.

A service of the gateway process (``await start()`` once its HTTP server is up, ``await
stop()`` before it goes). Every third of ``lease_ms`` it asks ``POST /meta/push/lease``, which
renews what it holds and takes subscriptions that are free or whose gateway stopped renewing,
up to its share among the gateways asking (qmq.meta.push_store); the answer is the whole set it
holds, so it starts a runner for each new one and stops the runners of those it no longer
holds (removed, given up to another gateway's share, or taken after it failed to renew).
When it cannot reach the meta server it keeps delivering until its own copy of the lease,
counted from before the last successful ask, runs out, then stops every runner: by then
another gateway may hold them. ``stop()`` gives the leases up, so another gateway takes
over at its next ask rather than after the expiry.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import socket
from collections.abc import Callable
from ssl import SSLContext
from typing import Any, Final

import aiohttp

from qmq.client.options import META_ADDRESS_PATH, ConnectOptions, authorization_of, check_url, secret_of
from qmq.common.errors import QmqError
from qmq.gateway.push_delivery import PushRunner
from qmq.gateway.transforms import Transforms
from qmq.protocol.push import PushFieldError, PushSubscription, parse_subscription

log = logging.getLogger(__name__)

LEASE_MS_DEFAULT: Final = 6_000
# Subscriptions one gateway runs at most (each is a consumer and a connection pool).
HELD_MAX_DEFAULT: Final = 1_000
_ASKS_PER_LEASE: Final = 3
_OWNER_CHARS_MAX: Final = 200

RunnerFactory = Callable[[PushSubscription, int], PushRunner]


def default_owner() -> str:
    """``<host>-<pid>-<random>``: this gateway in the lease rows and the logs."""
    return f"{socket.gethostname()[:100]}-gateway-{os.getpid()}-{secrets.token_hex(4)}"[:_OWNER_CHARS_MAX]


def meta_base_url(meta_server: str) -> str:
    """The meta server's base URL from its discovery URL or base URL (ConfigError when neither)."""
    return check_url("meta_server", meta_server).removesuffix(META_ADDRESS_PATH)


class PushService:
    """Leases of push subscriptions, and a runner for each one held."""

    def __init__(
        self,
        meta_server: str,
        *,
        app_code: str = "gateway",
        url: str = "",
        owner: str | None = None,
        lease_ms: int = LEASE_MS_DEFAULT,
        held_max: int = HELD_MAX_DEFAULT,
        make_runner: RunnerFactory | None = None,
        ssl: SSLContext | None = None,
        transforms: Transforms | None = None,
    ) -> None:
        self.meta_url = meta_base_url(meta_server)
        self._transforms = transforms
        # the gateway's TLS toward the meta server and brokers (its CA, its certificate as the
        # client's); None: plaintext, or the default trust for an https:// meta server
        self._ssl = ssl
        self._meta_server = meta_server
        self._app_code = app_code
        self.url = url
        self.owner = owner or default_owner()
        self.lease_ms = lease_ms
        self.held_max = held_max
        self._make_runner: RunnerFactory = make_runner or self._runner
        self.runners: dict[tuple[str, str], PushRunner] = {}
        # Runners being stopped, in the background: a stop waits for deliveries in flight (up to
        # the consumer's close timeout), longer than a renewal may wait. A subscription is not
        # started again here while its previous runner is still stopping.
        self._stopping: dict[tuple[str, str], asyncio.Task[None]] = {}
        # Runners being started, in the background too (a consumer's start asks the meta server
        # and may take its timeout); one keeps running only if it is still held when it is up.
        self._starting: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._held: dict[tuple[str, str], tuple[PushSubscription, int]] = {}
        self._closing = False
        self._http: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._valid_until = 0.0
        self._failures = 0
        # one renewal at a time: two would start a runner of the same subscription twice
        self._renewing = asyncio.Lock()

    def _runner(self, sub: PushSubscription, generation: int) -> PushRunner:
        return PushRunner(sub, generation, self._meta_server, self._app_code, self._ssl, self._transforms)

    async def start(self) -> None:
        """Ask for leases once (a meta server that is down is retried in the background), then every
        third of the lease."""
        if self._http is not None:
            raise RuntimeError("PushService.start() was called twice")
        if self.held_max == 0:
            log.info("push: this gateway runs no push subscription (push_subscriptions_max = 0)")
            return
        # the gateway's app, as its SDK clients authenticate: $QMQ_SECRET (a meta server with an
        # auth file hands push leases to the cluster's servers only)
        authorization = authorization_of(self._app_code, ConnectOptions(secret=secret_of(None)))
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None,
            timeout=aiohttp.ClientTimeout(total=self.lease_ms / _ASKS_PER_LEASE / 1000),
            headers={"Authorization": authorization} if authorization is not None else None,
        )
        await self.renew()
        self._task = asyncio.get_running_loop().create_task(self._renew_forever())

    async def stop(self) -> None:
        """Stop every runner (deliveries in flight finish, acks are sent), then give up the leases."""
        self._closing = True
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*self._starting.values(), return_exceptions=True)
        self._stop_runners(list(self.runners))
        await asyncio.gather(*self._stopping.values(), return_exceptions=True)
        http, self._http = self._http, None
        if http is None:
            return
        try:
            async with http.post(self.meta_url + "/meta/push/release", json={"owner": self.owner}) as answer:
                if answer.status != 200:
                    log.warning("giving up push leases: the meta server answered HTTP %d", answer.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("could not give up push leases (they run out by themselves): %s", exc)
        finally:
            await http.close()

    async def settle(self) -> None:
        """Wait until the runners being started are up (or failed): ``runners`` is then what runs."""
        await asyncio.gather(*self._starting.values(), return_exceptions=True)

    async def _renew_forever(self) -> None:
        loop = asyncio.get_running_loop()
        period_s = self.lease_ms / _ASKS_PER_LEASE / 1000
        next_s = loop.time() + period_s
        while True:
            # one ask a period, counted from the start of the last: a slow answer must not push
            # the next past the lease's expiry
            await asyncio.sleep(max(0.0, next_s - loop.time()))  # the renewal period, not a readiness wait
            next_s = loop.time() + period_s
            try:
                await self.renew()
            except Exception:  # a bug must not end the renewals (the leases would lapse unseen)
                log.exception("renewing push leases failed")

    async def renew(self) -> None:
        """Ask for leases once and start or stop runners to match what is held."""
        async with self._renewing:
            await self._renew()

    async def _renew(self) -> None:
        http = self._http
        if http is None:
            raise QmqError("the push service is not started")
        loop = asyncio.get_running_loop()
        asked_at = loop.time()
        try:
            held = await self._ask(http)
        except (aiohttp.ClientError, TimeoutError, QmqError) as exc:
            self._failures += 1
            if self._failures == 1 or self._failures % 30 == 0:
                log.warning(
                    "push leases: asking the meta server %s failed %d time(s): %s", self.meta_url, self._failures, exc
                )
            if self.runners and loop.time() >= self._valid_until:
                self._held = {}
                log.warning(
                    "push leases ran out unrenewed; stopping %d subscription(s) (another gateway may hold them)",
                    len(self.runners),
                )
                self._stop_runners(list(self.runners))
            return
        self._failures = 0
        self._valid_until = asked_at + self.lease_ms / 1000
        await self._match(held)

    async def _ask(self, http: aiohttp.ClientSession) -> dict[tuple[str, str], tuple[PushSubscription, int]]:
        body = {"owner": self.owner, "url": self.url, "lease_ms": self.lease_ms, "held_max": self.held_max}
        async with http.post(self.meta_url + "/meta/push/lease", json=body) as answer:
            doc: Any = await answer.json(content_type=None)
            if answer.status != 200:
                error = doc.get("error") if isinstance(doc, dict) else doc
                raise QmqError(f"the meta server answered HTTP {answer.status}: {error}")
        held: dict[tuple[str, str], tuple[PushSubscription, int]] = {}
        for entry in doc.get("subscriptions", []) if isinstance(doc, dict) else []:
            try:
                sub = parse_subscription(entry.get("subscription") if isinstance(entry, dict) else entry)
                generation = int(entry["generation"])
            except (PushFieldError, KeyError, TypeError, ValueError) as exc:
                log.error("push leases: skipping a subscription the meta server sent that cannot be read: %s", exc)
                continue
            held[sub.key] = (sub, generation)
        return held

    async def _match(self, held: dict[tuple[str, str], tuple[PushSubscription, int]]) -> None:
        """Stop the runners of what is no longer held as it was (removed, changed, lost and taken
        back) or whose listener gave up; start runners for what is held and runs nowhere here."""
        gone = [
            key
            for key, runner in self.runners.items()
            if key not in held or held[key] != (runner.sub, runner.generation) or runner.errors
        ]
        for key in gone:
            errors = self.runners[key].errors
            if errors:
                log.error("push subscription %s / %s stopped delivering (%s); starting it again", *key, errors[0])
        self._stop_runners(gone)
        self._held = held
        loop = asyncio.get_running_loop()
        for key, (sub, generation) in held.items():
            if key in self.runners or key in self._stopping or key in self._starting:
                continue
            task = loop.create_task(self._start_runner(sub, generation))
            self._starting[key] = task
            task.add_done_callback(functools.partial(self._started, key))

    def _started(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._starting.get(key) is task:
            del self._starting[key]

    async def _start_runner(self, sub: PushSubscription, generation: int) -> None:
        runner = self._make_runner(sub, generation)
        try:
            await runner.start()
        except Exception as exc:  # one subscription that cannot start must not stop the others
            log.warning(
                "push subscription %s / %s cannot start (tried again in %d ms): %s",
                sub.subject,
                sub.group,
                self.lease_ms // _ASKS_PER_LEASE,
                exc,
                exc_info=not isinstance(exc, QmqError),
            )
            return
        self.runners[sub.key] = runner
        if self._closing or self._held.get(sub.key) != (sub, generation):
            self._stop_runners([sub.key])  # lost, changed or stopping while it started
            return
        log.info("push subscription %s / %s -> %s runs here (lease %d)", sub.subject, sub.group, sub.url, generation)

    def _stop_runners(self, keys: list[tuple[str, str]]) -> None:
        """Take the runners of ``keys`` out of service now and stop them in the background."""
        for key in keys:
            runner = self.runners.pop(key, None)
            if runner is None:
                continue
            task = asyncio.get_running_loop().create_task(self._stop_runner(runner))
            self._stopping[key] = task
            task.add_done_callback(functools.partial(self._stopped, key))

    def _stopped(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._stopping.get(key) is task:
            del self._stopping[key]

    async def _stop_runner(self, runner: PushRunner) -> None:
        sub = runner.sub
        try:
            await runner.stop()
        except Exception as exc:  # one runner failing to stop must not stop the others
            log.warning("stopping push subscription %s / %s: %s", sub.subject, sub.group, exc)
        else:
            log.info("push subscription %s / %s stopped here", sub.subject, sub.group)
