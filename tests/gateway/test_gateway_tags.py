"""Pulling through the HTTP gateway with a tag filter (``tags`` and ``tag_match``): the broker
hands a group only the messages with any, or all, of the tags; a group keeps one filter."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest
from gatewayhelpers import post, pull_until

from qmq.testing import ReadyProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TAGGED = {"none": [], "a": ["a"], "b": ["b"], "ab": ["a", "b"], "c": ["c"]}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def _pull_all(http: aiohttp.ClientSession, url: str, **body: object) -> list[str]:
    """Every message the group gets (until a pull finds none), acked."""
    got = await pull_until(http, url, 5, 5, start_from="earliest", **body)
    if got:
        status, doc = await post(http, url.split("/v1/")[0] + "/v1/acks", {"acks": [m["receipt"] for m in got]})
        assert status == 200, doc
    return sorted(m["message_id"] for m in got)


async def test_a_pull_with_tags_gets_the_messages_with_any_or_all_of_them(
    shared_standalone: ReadyProcess, subject: str, http: aiohttp.ClientSession
) -> None:
    gw = shared_standalone.gateway
    batch = {"messages": [{"body": name, "message_id": name, "tags": tags} for name, tags in TAGGED.items()]}
    assert (await post(http, f"{gw}/v1/subjects/{subject}/messages", batch))[0] == 200

    def url(group: str) -> str:
        return f"{gw}/v1/subjects/{subject}/groups/{group}-{uuid.uuid4().hex[:6]}/pull"

    assert await _pull_all(http, url("any"), tags=["a", "b"], tag_match="any") == ["a", "ab", "b"]
    assert await _pull_all(http, url("any-default"), tags=["a"]) == ["a", "ab"]
    assert await _pull_all(http, url("all"), tags=["a", "b"], tag_match="all") == ["ab"]
    assert await _pull_all(http, url("none"), tags=["zzz"]) == []
    assert await _pull_all(http, url("everything")) == ["a", "ab", "b", "c", "none"]


async def test_a_group_keeps_one_tag_filter_and_bad_filters_are_refused(
    shared_standalone: ReadyProcess, subject: str, http: aiohttp.ClientSession
) -> None:
    gw = shared_standalone.gateway
    url = f"{gw}/v1/subjects/{subject}/groups/g{uuid.uuid4().hex[:8]}/pull"
    status, doc = await post(http, url, {"timeout_ms": 0, "tags": ["a"]})
    assert (status, doc) == (200, {"messages": []})
    status, doc = await post(http, url, {"timeout_ms": 0, "tags": ["b"]})
    assert status == 409
    assert doc["error"]["code"] == "TAG_FILTER_CONFLICT"
    assert "['a'] (any)" in doc["error"]["message"]
    assert "['b'] (any)" in doc["error"]["message"]
    for body, words in (
        ({"tags": ["a"], "tag_match": "some"}, "tag_match = 'some'"),
        ({"tags": "a"}, "must be a list of tag strings"),
        ({"tags": [""]}, "tag"),
        ({"tags": [f"t{i}" for i in range(11)]}, "limit is 10"),
    ):
        fresh = f"{gw}/v1/subjects/{subject}/groups/g{uuid.uuid4().hex[:8]}/pull"
        status, doc = await post(http, fresh, {"timeout_ms": 0, **body})
        assert status == 400, (body, doc)
        assert doc["error"]["code"] == "VALUE_INVALID"
        assert words in doc["error"]["message"], doc
