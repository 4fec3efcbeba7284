"""Discovery through the meta server: which broker groups are available, where they listen,
and which broker groups each subject is routed to.

The meta server URL is the one ``qmq ready`` prints (a base URL ``http://host:port`` gets
its ``/meta/address``: ``qmq.client.options.check_url``), with one ``?subject=`` parameter
per subject whose route is wanted. The answer is refreshed in the
background every ``refresh_ms`` the meta server asks for; a failed refresh keeps the last
answer, so a meta server outage never stops sends or pulls to known brokers.

A refresh asks again for every subject's route only when it must: the meta server's
``routes_version`` changed since the last full refresh (a route widened or removed, a group
draining, a route retired), a broker group became available (routes may widen to it), or
``_FULL_REFRESH_EVERY`` refreshes passed (a route widened through another meta server sharing
the store). Between them a refresh asks for the groups and the subjects without a route only:
a consumer of 40,000 subjects makes one request every ``refresh_ms``, not 157.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from ssl import SSLContext
from typing import Any

import aiohttp
from yarl import URL

from qmq.client.options import check_url
from qmq.common.errors import AuthError, MetaServerError
from qmq.common.limits import META_SUBJECTS_PER_REQUEST_MAX

log = logging.getLogger(__name__)

_REFRESH_MS_MIN = 100
_REFRESH_MS_MAX = 600_000
_REFRESH_MS_DEFAULT = 10_000
# How long fresh() waits for the refresh it asked for.
_FRESH_WAIT_MS = 3_000
# The meta server takes at most META_SUBJECTS_PER_REQUEST_MAX subjects a request, and a URL
# must stay well inside an HTTP server's request-line limit (8 KiB in aiohttp).
_SUBJECT_CHARS_PER_REQUEST_MAX = 4_000
# Subjects whose routes are kept fresh; a producer that sends to more is unusual, and
# beyond it new subjects use every available broker group.
_SUBJECTS_MAX = 100_000
_ERROR_TEXT_CHARS_MAX = 300
_FULL_REFRESH_EVERY = 30
# Delay groups share the sender's name space with broker groups under this prefix; '%' is
# never part of a group name, so the two cannot collide.
DELAY_TARGET_PREFIX = "%delay%"


def describe_target(name: str) -> str:
    """``broker group g1`` or ``delay group d1`` for a name of the sender's name space."""
    if name.startswith(DELAY_TARGET_PREFIX):
        return f"delay group {name[len(DELAY_TARGET_PREFIX) :]}"
    return f"broker group {name}"


class MetaRefusedError(MetaServerError):
    """The meta server answered with an HTTP error status (a refused request, not an outage)."""

    def __init__(self, text: str, status: int) -> None:
        super().__init__(text)
        self.status = status


@dataclass(frozen=True, slots=True)
class BrokerGroup:
    """An available broker group and the address of its master."""

    name: str
    address: str


@dataclass(frozen=True, slots=True)
class MetaAnswer:
    groups: dict[str, BrokerGroup]
    routes: dict[str, tuple[str, ...]]
    refresh_ms: int
    # available delay groups, keyed (and named) DELAY_TARGET_PREFIX + group
    delay_groups: dict[str, BrokerGroup] = field(default_factory=dict)
    # available broker groups that take sends (a draining group does not: docs/cluster.md, "Operations")
    writable: frozenset[str] = frozenset()
    # each subject's groups to send to, when the meta server says (else: its routes' writable groups)
    send_routes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # changes whenever a route already answered may have (None: a meta server that does not say)
    routes_version: str | None = None


def parse_answer(url: str, doc: object) -> MetaAnswer:
    """Check and read a ``GET /meta/address`` answer; MetaServerError saying what is wrong."""

    def bad(what: str) -> MetaServerError:
        return MetaServerError(
            f"meta server {url} answered with {what}; is meta_server the URL printed by `qmq ready`?"
        )

    if not isinstance(doc, dict):
        raise bad(f"a JSON {type(doc).__name__}, not an object")
    raw_groups = doc.get("broker_groups")
    if not isinstance(raw_groups, list):
        raise bad("no 'broker_groups' list")
    groups: dict[str, BrokerGroup] = {}
    writable: set[str] = set()
    for g in raw_groups:
        if not isinstance(g, dict) or not isinstance(g.get("group"), str) or not isinstance(g.get("address"), str):
            raise bad(f"a broker group without a 'group' name and an 'address': {g!r:.200}")
        if g.get("state") == "available" and g.get("role", "master") == "master":
            groups[g["group"]] = BrokerGroup(g["group"], g["address"])
            if g.get("writable", True) is not False:
                writable.add(g["group"])
    delay_groups: dict[str, BrokerGroup] = {}
    raw_delay = doc.get("delay_groups", [])
    if not isinstance(raw_delay, list):
        raise bad(f"'delay_groups' that is a {type(raw_delay).__name__}, not a list")
    for g in raw_delay:
        if not isinstance(g, dict) or not isinstance(g.get("group"), str) or not isinstance(g.get("address"), str):
            raise bad(f"a delay group without a 'group' name and an 'address': {g!r:.200}")
        if g.get("state") == "available" and g.get("role", "master") == "master":
            key = DELAY_TARGET_PREFIX + g["group"]
            delay_groups[key] = BrokerGroup(key, g["address"])
    routes: dict[str, tuple[str, ...]] = {}
    raw_routes = doc.get("routes", {})
    if not isinstance(raw_routes, dict):
        raise bad(f"'routes' that is a {type(raw_routes).__name__}, not an object")
    for subject, names in raw_routes.items():
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise bad(f"a route of {subject!r} that is not a list of group names: {names!r:.200}")
        if names:  # an empty route means "not routed yet": no broker group was available
            routes[subject] = tuple(names)
    send_routes: dict[str, tuple[str, ...]] = {}
    raw_send = doc.get("send_routes", {})
    if not isinstance(raw_send, dict):
        raise bad(f"'send_routes' that is a {type(raw_send).__name__}, not an object")
    for subject, names in raw_send.items():
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise bad(f"a send route of {subject!r} that is not a list of group names: {names!r:.200}")
        if subject in routes:
            send_routes[subject] = tuple(names)
    refresh_ms = doc.get("refresh_ms", _REFRESH_MS_DEFAULT)
    if isinstance(refresh_ms, bool) or not isinstance(refresh_ms, int):
        raise bad(f"'refresh_ms' = {refresh_ms!r}, not a whole number")
    routes_version = doc.get("routes_version")
    if routes_version is not None and not isinstance(routes_version, str):
        raise bad(f"'routes_version' = {routes_version!r:.200}, not a string")
    return MetaAnswer(
        groups,
        routes,
        min(max(refresh_ms, _REFRESH_MS_MIN), _REFRESH_MS_MAX),
        delay_groups,
        frozenset(writable),
        send_routes,
        routes_version,
    )


def _chunks(subjects: list[str]) -> Iterable[list[str]]:
    chunk: list[str] = []
    chars = 0
    for s in subjects:
        if chunk and (len(chunk) >= META_SUBJECTS_PER_REQUEST_MAX or chars + len(s) > _SUBJECT_CHARS_PER_REQUEST_MAX):
            yield chunk
            chunk, chars = [], 0
        chunk.append(s)
        chars += len(s)
    yield chunk


def _auth_refusal(url: str, text: str) -> AuthError:
    """The AuthError of a 401 or 403 of the meta server, from its JSON body."""
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        return AuthError(f"meta server {url} refused the app: {text[:_ERROR_TEXT_CHARS_MAX]}")
    return AuthError(
        f"meta server {url}: {doc.get('error', '')}",
        app_code=str(doc.get("app", "")),
        action=str(doc.get("action", "")),
    )


class MetaClient:
    """The last known answer of the meta server, kept fresh by a background task."""

    def __init__(
        self, url: str, *, timeout_ms: int, authorization: str | None = None, ssl: SSLContext | None = None
    ) -> None:
        self._ssl = ssl  # TLS to an https:// meta server (None: aiohttp's default verification)
        self.url = check_url("meta_server", url)
        # the app's Authorization header, for a meta server with an auth file (qmq.auth.http)
        self._headers = {"Authorization": authorization} if authorization else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_ms / 1000)
        self._session: aiohttp.ClientSession | None = None
        self.groups: dict[str, BrokerGroup] = {}
        # available delay groups, keyed DELAY_TARGET_PREFIX + group (see describe_target)
        self.delay_groups: dict[str, BrokerGroup] = {}
        self._all_groups: tuple[str, ...] = ()
        self._writable: frozenset[str] = frozenset()
        self._all_writable: tuple[str, ...] = ()
        self._routes: dict[str, tuple[str, ...]] = {}
        self._send_routes: dict[str, tuple[str, ...]] = {}
        # Subjects whose route was asked for (routed or not): kept fresh by each refresh.
        self._subjects: set[str] = set()
        # Subjects the meta server refused to route (4xx): every available group, never asked again.
        self._refused: set[str] = set()
        self._lookups: dict[str, asyncio.Future[None]] = {}
        self._queued: list[str] = []  # subjects asked for this loop turn, looked up together
        self._lookup_tasks: set[asyncio.Task[None]] = set()
        self._refresh_ms = _REFRESH_MS_DEFAULT
        self._wake = asyncio.Event()
        # callers of fresh(): resolved when a refresh that began after they asked has ended
        self._fresh_waiters: list[asyncio.Future[None]] = []
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[], None]] = []
        # The meta server's routes_version at the last full refresh (None: the next is full) and
        # the refreshes since, which asked for unrouted subjects only.
        self._routes_version: str | None = None
        self._partial_refreshes = 0
        self.refreshes = 0
        self.full_refreshes = 0

    async def start(self) -> None:
        """Fetch the first answer; MetaServerError naming the URL if the meta server is unreachable."""
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers, connector=connector)
        try:
            self._apply(await self._fetch([]), [])
        except BaseException:
            await self.close()
            raise
        self._task = asyncio.ensure_future(self._refresh_loop())

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for lookup in list(self._lookup_tasks):
            lookup.cancel()
        for fut in self._lookups.values():
            fut.cancel()
        for fut in self._fresh_waiters:
            fut.cancel()
        self._fresh_waiters.clear()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every refresh that changed the groups or a route."""
        self._listeners.append(callback)

    def off_change(self, callback: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(callback)

    def route(self, subject: str) -> tuple[str, ...] | None:
        """The broker groups of ``subject``, or None when its route was never asked for.

        A subject the meta server has not routed (or that could not be asked about) goes to
        every available broker group.
        """
        groups = self._routes.get(subject)
        if groups is not None:
            return groups
        return self._all_groups if subject in self._subjects or subject in self._refused else None

    def routed(self, subject: str) -> tuple[str, ...] | None:
        """The broker groups the meta server routes ``subject`` to; None while they are not known
        (never asked for, the lookup failed, or no group was available to route it to).

        A subject the meta server refused to route (or one past the subjects tracked) has every
        available group, as in ``route``: it never gets a route of its own.
        """
        groups = self._routes.get(subject)
        if groups is not None:
            return groups
        return self._all_groups if subject in self._refused else None

    def send_route(self, subject: str) -> tuple[str, ...] | None:
        """The broker groups a message of ``subject`` goes to: its route less the groups that take
        no sends (draining, or a route being retired); None when its route was never asked for."""
        groups = self._send_routes.get(subject)
        if groups is not None:
            return groups
        route = self.route(subject)
        if route is None:
            return None
        if route is self._all_groups:
            return self._all_writable
        return tuple(g for g in route if g in self._writable)

    def available(self, names: Iterable[str]) -> list[BrokerGroup]:
        """The available groups among ``names`` (broker or delay groups), in order."""
        out = []
        for n in names:
            g = self.target(n)
            if g is not None:
                out.append(g)
        return out

    def target(self, name: str) -> BrokerGroup | None:
        """The available broker group, or delay group (``DELAY_TARGET_PREFIX`` + name), called ``name``."""
        g = self.groups.get(name)
        if g is None and name.startswith(DELAY_TARGET_PREFIX):
            g = self.delay_groups.get(name)
        return g

    def targets(self) -> list[str]:
        """Every available broker group and delay group, by the names the sender uses."""
        return [*self.groups, *self.delay_groups]

    def delay_route(self) -> tuple[str, ...]:
        """The available delay groups, as a route of the sender; empty when there is none."""
        return tuple(sorted(self.delay_groups))

    async def resolve(self, subject: str) -> tuple[str, ...]:
        """The route of ``subject``, asking the meta server the first time.

        Subjects first asked for in the same loop turn (a consumer starting on many subjects, a
        producer fanning out) are looked up together, up to 256 a request.
        """
        route = self.route(subject)
        if route is not None:
            return route
        fut = self._lookups.get(subject)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._lookups[subject] = fut
            self._queued.append(subject)
            if len(self._queued) == 1:  # the first of this loop turn: a lookup task takes them all
                task = asyncio.ensure_future(self._lookup_queued())
                self._lookup_tasks.add(task)
                task.add_done_callback(self._lookup_tasks.discard)
        await asyncio.shield(fut)
        return self.route(subject) or self._all_groups

    async def _lookup_queued(self) -> None:
        # Starts a loop turn after the first resolve, when that turn's resolves have queued;
        # later turns start tasks of their own, so lookups overlap instead of queueing.
        queued, self._queued = self._queued, []
        closing = False
        try:
            for chunk in _chunks(queued):
                await self._lookup(chunk)
                self._answered(chunk, closing=False)
        except asyncio.CancelledError:
            closing = True  # the client is closing: nobody waits for an answer that will not come
            raise
        except Exception:  # a bug: the resolvers fall back to every available group
            log.exception("looking up routes failed")
        finally:
            self._answered(queued, closing=closing)

    def _answered(self, subjects: list[str], closing: bool) -> None:
        for s in subjects:
            fut = self._lookups.pop(s, None)
            if fut is not None and not fut.done():
                if closing:
                    fut.cancel()
                else:
                    fut.set_result(None)

    async def _lookup(self, subjects: list[str]) -> None:
        room = _SUBJECTS_MAX - len(self._subjects) - len(self._refused)
        if room < len(subjects):
            for s in subjects[max(room, 0) :]:
                log.warning("tracking %d subjects already; %r goes to every available broker group", _SUBJECTS_MAX, s)
                self._refused.add(s)
            subjects = subjects[: max(room, 0)]
            if not subjects:
                return
        try:
            answer = await self._fetch(subjects)
        except MetaRefusedError as exc:
            if exc.status >= 500:  # the meta server failing (its store away), not a refusal: asked again
                self._unreachable(subjects, exc)
                return
            if len(subjects) > 1:  # one of them was refused: find which, one request each
                for s in subjects:
                    await self._lookup([s])
                return
            # Kept out of the refreshes, so one refused subject cannot fail them all.
            log.warning("the meta server refused to route %r; using every available broker group: %s", subjects[0], exc)
            self._refused.add(subjects[0])
            return
        except (MetaServerError, AuthError) as exc:
            self._unreachable(subjects, exc)
            return
        self._apply(answer, subjects)

    def _unreachable(self, subjects: list[str], exc: Exception) -> None:
        """The routes of ``subjects`` could not be looked up: every refresh asks for them again;
        meanwhile they go to every available broker group (``route``), but for resends, which
        wait for the route (``routed``; client/routing.py)."""
        log.warning(
            "cannot look up the route of %s, using every available broker group until it is known: %s",
            ", ".join(map(repr, subjects[:3])) + (f" and {len(subjects) - 3} more" if len(subjects) > 3 else ""),
            exc,
        )
        self._subjects.update(subjects)

    def refresh_soon(self) -> None:
        """Refresh now rather than at the next period (a broker said it is not master)."""
        self._wake.set()

    async def fresh(self, timeout_ms: int = _FRESH_WAIT_MS) -> None:
        """Refresh now and return when it has ended (answered or failed) or after ``timeout_ms``,
        whichever is first: the groups are then the meta server's of this moment, or the last
        answer's. Callers at once share the background loop's refresh, at most one per
        _REFRESH_MS_MIN, so asking often costs the meta server nothing more."""
        if self._task is None:
            raise MetaServerError(f"meta server {self.url}: the client is not started")
        waiter = asyncio.get_running_loop().create_future()
        self._fresh_waiters.append(waiter)
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_ms / 1000):
                await waiter

    async def _refresh_loop(self) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._refresh_ms / 1000):
                    await self._wake.wait()
            self._wake.clear()
            started = loop.time()
            waiters, self._fresh_waiters = self._fresh_waiters, []
            try:
                await self.refresh()
            except (MetaServerError, AuthError) as exc:
                failures += 1
                # Logged on the first failure and then rarely, so an outage does not flood the log.
                if failures == 1 or failures % 30 == 0:
                    log.warning("meta server refresh failed %d time(s), keeping the last answer: %s", failures, exc)
            else:
                if failures:
                    log.info("meta server %s answers again after %d failed refresh(es)", self.url, failures)
                failures = 0
            finally:
                for waiter in waiters:
                    if not waiter.done():
                        waiter.set_result(None)
            # At most one refresh per _REFRESH_MS_MIN, however often refresh_soon is called.
            rest = _REFRESH_MS_MIN / 1000 - (loop.time() - started)
            if rest > 0:
                await asyncio.sleep(rest)

    async def refresh(self) -> None:
        """Ask again for the groups and the routes: of every subject asked for so far when a
        route may have changed (see the module's docstring), else of the unrouted ones only.

        What could be fetched is applied; MetaServerError if any request failed.
        """
        if self._routes_version is not None and self._partial_refreshes < _FULL_REFRESH_EVERY:
            groups_before = set(self.groups)
            unrouted = sorted(s for s in self._subjects if s not in self._routes)
            version = await self._refresh_routes(unrouted)
            if version == self._routes_version and self.groups.keys() <= groups_before:
                self._partial_refreshes += 1
                return
        self._routes_version = None  # a failed full refresh leaves the next one full
        version = await self._refresh_routes(sorted(self._subjects))
        self._routes_version = version
        self._partial_refreshes = 0
        self.full_refreshes += 1

    async def _refresh_routes(self, subjects: list[str]) -> str | None:
        """Fetch and apply the routes of ``subjects`` (and the groups, with every answer); the
        answers' routes_version, None when they did not all give the same one."""
        failed: MetaServerError | None = None
        versions: set[str | None] = set()
        for chunk in _chunks(subjects):
            try:
                answer = await self._fetch(chunk)
            except MetaRefusedError as exc:
                failed = exc
                continue
            except MetaServerError:
                raise  # unreachable: the other chunks would fail the same way
            self._apply(answer, chunk)
            versions.add(answer.routes_version)
        if failed is not None:
            raise failed
        return versions.pop() if len(versions) == 1 else None

    async def _fetch(self, subjects: list[str]) -> MetaAnswer:
        session = self._session
        if session is None:
            raise MetaServerError(f"meta server {self.url}: the client is closed")
        url = URL(self.url, encoded=False)
        if subjects:
            url = url.extend_query([("subject", s) for s in subjects])
        try:
            async with session.get(url) as resp:
                if resp.status in (401, 403):
                    raise _auth_refusal(self.url, await resp.text(errors="replace"))
                if resp.status != 200:
                    text = (await resp.text(errors="replace"))[:_ERROR_TEXT_CHARS_MAX]
                    raise MetaRefusedError(f"meta server {self.url} answered HTTP {resp.status}: {text}", resp.status)
                doc: Any = await resp.json(content_type=None)
        except (MetaServerError, AuthError):
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            reason = "no answer in time" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            raise MetaServerError(f"cannot reach the meta server at {self.url}: {reason}") from None
        self.refreshes += 1
        return parse_answer(self.url, doc)

    def _apply(self, answer: MetaAnswer, subjects: list[str]) -> None:
        self._refresh_ms = answer.refresh_ms
        changed = answer.groups != self.groups or answer.writable != self._writable
        if changed:
            self.groups = answer.groups
            self._all_groups = tuple(sorted(answer.groups))
            self._writable = answer.writable
            self._all_writable = tuple(g for g in self._all_groups if g in answer.writable)
        if answer.delay_groups != self.delay_groups:
            self.delay_groups = answer.delay_groups
            changed = True
        for s in subjects:
            route = answer.routes.get(s)
            if self._routes.get(s) != route:
                changed = True
                if route is None:
                    self._routes.pop(s, None)
                else:
                    self._routes[s] = route
            send = answer.send_routes.get(s)
            if self._send_routes.get(s) != send:
                changed = True
                if send is None:
                    self._send_routes.pop(s, None)
                else:
                    self._send_routes[s] = send
        self._subjects.update(subjects)
        if changed:
            for callback in self._listeners:
                try:
                    callback()
                except Exception:
                    log.exception("a meta server change listener failed")
