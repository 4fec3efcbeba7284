"""A resend whose subject's route cannot be looked up (the meta server unreachable: a delay server
cut off from it, handing over what it kept) waits for that route: it never goes to a group
picked among the broker groups last known to be available, which another sender of the same
message (the delay slave promoted meanwhile, with the route) does not pick. Each copy would
then be stored by another group and no duplicate window would drop the second (found by the
fault campaign, network scenario)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from clusterhelpers import cluster_up, fast_config, sent_one_by_one, stored_by_group

from qmq.aio import Producer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

SUBJECT = "resend.meta-away"
MESSAGES = 40
_CHUNK = 65_536


class MetaLink:
    """A TCP relay to the meta server that can be cut (its connections closed, new ones closed
    at once, each counted) and healed."""

    def __init__(self, meta_server: str) -> None:
        parts = urlsplit(meta_server)
        self._host, self._port, self._path = parts.hostname or "127.0.0.1", parts.port or 80, parts.path
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.is_cut = False
        self.refused = 0
        self._refused_changed = asyncio.Event()
        self.url = ""

    async def __aenter__(self) -> MetaLink:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}{self._path}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def cut(self) -> None:
        self.is_cut = True
        for w in list(self._writers):
            w.close()

    def heal(self) -> None:
        self.is_cut = False

    async def refusals(self, n: int) -> None:
        """Until ``n`` connections were refused while cut."""
        while self.refused < n:
            self._refused_changed.clear()
            await self._refused_changed.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_cut:
            self.refused += 1
            self._refused_changed.set()
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(self._host, self._port)
        self._writers.update((writer, up_writer))
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except asyncio.CancelledError:
            pass  # the relay is closing (the test's end): the connection goes with it
        finally:
            self._writers.difference_update((writer, up_writer))
            writer.close()
            up_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
    writer.close()


async def test_a_resend_whose_route_cannot_be_looked_up_waits_for_it_rather_than_pick_among_all_groups(
    tmp_path: Path,
) -> None:
    # one group a subject: the route is one of the two groups, "every available group" both
    args = ["--broker-groups", "2", "--slaves", "0", "--delay-groups", "0"]
    config = fast_config(tmp_path / "fast.toml", {"meta": {"route_groups": 1}})
    with cluster_up(tmp_path / "cluster", args, config) as c:
        messages = await sent_one_by_one(c.meta_server, SUBJECT, MESSAGES)
        stored = await stored_by_group(c.meta_server, SUBJECT)
        assert sorted(stored.values()) == [0, MESSAGES], stored  # all in the subject's one group
        # a resending producer (a delay server's hand-overs) that knows the groups but not yet the
        # subject's route, and then cannot reach the meta server
        link = MetaLink(c.meta_server)
        async with link, Producer(app_code="shop", meta_server=link.url, resends=True, send_timeout_ms=30_000) as again:
            link.cut()
            sends = asyncio.gather(
                *(again.send_encoded(SUBJECT, m.encode(), m.message_id) for m in messages),
                return_exceptions=True,
            )
            # the lookup and two refreshes found it unreachable: the sends were placed by now
            await asyncio.wait_for(link.refusals(3), 20)
            link.heal()
            results = await sends
        assert not [r for r in results if isinstance(r, BaseException)], results
        assert again.stats.duplicates == MESSAGES  # every one went to the group that stored it
        assert await stored_by_group(c.meta_server, SUBJECT) == stored
