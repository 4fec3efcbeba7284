"""A proxy between the SDK and real brokers that loses or refuses chosen frames, for tests of
what the SDK does when a request or its answer never arrives.

``proxied_brokers(meta_server)`` starts one ``FrameProxy`` per broker group the meta server
lists and a small HTTP server answering ``GET /meta/address`` as the meta server does, with
each broker group's address replaced by its proxy's. A producer given that URL sends through
the proxies; everything else (the servers, their answers) is real. A proxy forwards whole
frames both ways and, when told, does one of these to the next frames of a command:

- ``lose_answers``: forwards the request, so the broker handles it, then closes the client's
  connection instead of relaying the answer (the client cannot know it was stored);
- ``drop_requests``: closes the client's connection instead of forwarding the request;
- ``refuse_requests``: answers the request itself with a status (e.g. BUSY), keeping the
  connection, and never forwards it.

A helper module, not a conftest: test modules import it by name (it sits beside them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import ClientSession, web

from qmq.protocol.codes import Status
from qmq.protocol.frame import FLAG_RESPONSE, PREFIX, PREFIX_BYTES, Frame, encode_frame

_LEN_BYTES = 4


async def _read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """One whole frame as it came (prefix included), or None at the end of the stream."""
    try:
        head = await reader.readexactly(PREFIX_BYTES)
        frame_len = PREFIX.unpack(head)[0]
        rest = await reader.readexactly(frame_len + _LEN_BYTES - PREFIX_BYTES)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    return head + rest


@dataclass
class _Plan:
    """What to do to the next ``count`` frames of a command."""

    count: int
    status: Status = Status.OK


@dataclass
class FrameProxy:
    """Forwards frames between clients and ``target`` (``host:port``), losing or refusing some."""

    target: str
    address: str = ""
    answers_lost: Counter[int] = field(default_factory=Counter)
    requests_dropped: Counter[int] = field(default_factory=Counter)
    requests_refused: Counter[int] = field(default_factory=Counter)
    requests_forwarded: Counter[int] = field(default_factory=Counter)
    _lose: dict[int, _Plan] = field(default_factory=dict)
    _drop: dict[int, _Plan] = field(default_factory=dict)
    _refuse: dict[int, _Plan] = field(default_factory=dict)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def lose_answers(self, code: int, count: int = 1) -> None:
        self._lose[code] = _Plan(count)

    def drop_requests(self, code: int, count: int = 1) -> None:
        self._drop[code] = _Plan(count)

    def refuse_requests(self, code: int, status: Status, count: int = 1) -> None:
        self._refuse[code] = _Plan(count, status)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    @staticmethod
    def _take(plans: dict[int, _Plan], code: int) -> _Plan | None:
        plan = plans.get(code)
        if plan is None or plan.count <= 0:
            return None
        plan.count -= 1
        return plan

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        host, port = self.target.rsplit(":", 1)
        broker_w: asyncio.StreamWriter | None = None
        try:
            broker_r, broker_w = await asyncio.open_connection(host, int(port))
            # request id -> code, of requests forwarded and not answered yet
            pending: dict[int, int] = {}
            upstream = asyncio.ensure_future(self._requests(client_r, client_w, broker_w, pending))
            downstream = asyncio.ensure_future(self._answers(broker_r, client_w, pending))
            try:
                await asyncio.wait([upstream, downstream], return_when=asyncio.FIRST_COMPLETED)
            finally:
                upstream.cancel()
                downstream.cancel()
                await asyncio.gather(upstream, downstream, return_exceptions=True)
        except OSError:
            pass  # the broker is gone: the client sees its connection close
        finally:
            for w in (client_w, broker_w):
                if w is not None:
                    w.close()
            self._tasks.discard(task)

    async def _requests(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        broker_w: asyncio.StreamWriter,
        pending: dict[int, int],
    ) -> None:
        while (raw := await _read_frame(client_r)) is not None:
            _len, _magic, _ver, _flags, code, _status, request_id, _hlen = PREFIX.unpack_from(raw)
            if self._take(self._drop, code) is not None:
                self.requests_dropped[code] += 1
                return  # the connection closes with the request unsent
            plan = self._take(self._refuse, code)
            if plan is not None:
                self.requests_refused[code] += 1
                answer = Frame(code, request_id, {"error": "refused by the test's proxy"}, b"", plan.status, True)
                client_w.write(encode_frame(answer))
                continue
            pending[request_id] = code
            self.requests_forwarded[code] += 1
            broker_w.write(raw)
            await broker_w.drain()

    async def _answers(
        self, broker_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, pending: dict[int, int]
    ) -> None:
        while (raw := await _read_frame(broker_r)) is not None:
            _len, _magic, _ver, flags, code, _status, request_id, _hlen = PREFIX.unpack_from(raw)
            answered = flags & FLAG_RESPONSE and pending.pop(request_id, None) is not None
            if answered and self._take(self._lose, code) is not None:
                self.answers_lost[code] += 1
                return  # the connection closes: the answer never reaches the client
            client_w.write(raw)
            await client_w.drain()


def _meta_document(meta_server: str) -> dict[str, object]:
    with urllib.request.urlopen(meta_server, timeout=10) as resp:
        doc: dict[str, object] = json.load(resp)
    return doc


@contextlib.asynccontextmanager
async def proxied_brokers(meta_server: str) -> AsyncIterator[tuple[str, dict[str, FrameProxy]]]:
    """(a meta server URL whose broker groups are the proxies, {broker group: its proxy})."""
    doc = await asyncio.to_thread(_meta_document, meta_server)
    groups = doc["broker_groups"]
    assert isinstance(groups, list)
    assert groups, f"the meta server lists no broker group: {doc}"
    proxies = {g["group"]: FrameProxy(g["address"]) for g in groups}
    for proxy in proxies.values():
        await proxy.start()
    to_proxy = {p.target: p.address for p in proxies.values()}

    async def address(request: web.Request) -> web.Response:
        async with session.get(meta_server, params=list(request.query.items())) as resp:
            answer = await resp.json(content_type=None)
        for g in answer.get("broker_groups", []):
            g["address"] = to_proxy.get(g["address"], g["address"])
        return web.json_response(answer, status=resp.status)

    app = web.Application()
    app.router.add_get("/meta/address", address)
    runner = web.AppRunner(app)
    session = ClientSession()
    try:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}/meta/address", proxies
    finally:
        await runner.cleanup()
        await session.close()
        for proxy in proxies.values():
            await proxy.close()
