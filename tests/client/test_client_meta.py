"""Discovery against a real meta server: groups, routes, and a refused subject that must not
stop the background refresh of the others."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from qmq.client.meta import MetaClient
from qmq.common.limits import META_SUBJECTS_PER_REQUEST_MAX

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def _started(meta_server: str) -> AsyncIterator[MetaClient]:
    meta = MetaClient(meta_server, timeout_ms=5000)
    await meta.start()
    try:
        yield meta
    finally:
        await meta.close()


async def test_groups_and_routes_come_from_the_meta_server(meta_server: str, subject: str) -> None:
    async with _started(meta_server) as meta:
        assert meta.route(subject) is None  # never asked
        route = await meta.resolve(subject)
        assert route == tuple(meta.groups)
        assert meta.route(subject) == route
        assert [g.name for g in meta.available(route)] == list(route)


async def test_a_refused_subject_falls_back_and_refreshes_go_on(meta_server: str, subject: str) -> None:
    async with _started(meta_server) as meta:
        await meta.resolve(subject)
        # Not a valid retry subject: the meta server answers 400 for it.
        assert await meta.resolve("%RETRY%no-group") == tuple(meta.groups)
        before = meta.refreshes
        await meta.refresh()  # raises if the refused subject were asked again
        assert meta.refreshes == before + 1
        assert meta.route(subject) is not None


async def test_a_client_of_more_subjects_than_one_request_holds_refreshes_them_all(
    meta_server: str, subject: str
) -> None:
    async with _started(meta_server) as meta:
        # short names, so that the URL length alone would not split the request
        subjects = [f"r{i}.{subject[-6:]}" for i in range(META_SUBJECTS_PER_REQUEST_MAX + 44)]
        for s in subjects:
            await meta.resolve(s)
        before = meta.refreshes
        await meta.refresh()  # in several requests: the meta server refuses one this large
        assert meta.refreshes == before + 2
        assert all(meta.route(s) for s in subjects)


async def test_subjects_first_asked_for_together_are_looked_up_in_one_request(meta_server: str, subject: str) -> None:
    async with _started(meta_server) as meta:
        subjects = [f"{subject}.{i}" for i in range(40)]
        before = meta.refreshes
        routes = await asyncio.gather(*(meta.resolve(s) for s in subjects))
        assert meta.refreshes == before + 1
        assert all(r == tuple(meta.groups) for r in routes)
        # one subject the meta server refuses: the others are still routed, it falls back
        more = [f"{subject}.more{i}" for i in range(5)]
        routes = await asyncio.gather(*(meta.resolve(s) for s in [*more, "%RETRY%no-group"]))
        assert all(r == tuple(meta.groups) for r in routes)
        assert all(meta.route(s) for s in more)
        await meta.refresh()  # the refused one is not asked again
