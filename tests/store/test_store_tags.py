"""Tag filters on the broker: only matching messages leave the store, the group moves past the rest."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_store_send_pull import records

from conftest import append, batch, flush
from qmq.store.broker_store import BrokerStore
from qmq.store.consume_log import tag_bloom
from qmq.store.tags import TagFilter


def tagged(store: BrokerStore) -> None:
    body = (
        batch("s", ["vip-eu"], tags=("vip", "eu"))
        + batch("s", ["plain"])
        + batch("s", ["vip"], tags=("vip",))
        + batch("s", ["eu"], tags=("eu",))
        + batch("s", ["other"], tags=("other",))
    )
    append(store, body)
    flush(store)


@pytest.mark.parametrize(
    ("tags", "mode", "expected"),
    [
        (["vip"], "or", ["vip-eu", "vip"]),
        (["vip", "eu"], "or", ["vip-eu", "vip", "eu"]),
        (["vip", "eu"], "and", ["vip-eu"]),
        (["missing"], "or", []),
    ],
)
def test_group_gets_only_matching_messages(
    open_store: Callable[..., BrokerStore], tags: list[str], mode: str, expected: list[str]
) -> None:
    store = open_store()
    tagged(store)
    gp = store.group("s", "g", "earliest")
    got = store.pull(gp, gp.consumer("c"), "x", 100, TagFilter(tags, mode))
    assert ([i for _s, i in records(got)] if got else []) == expected
    assert gp.pull_offset == 5  # scanned past everything, matching or not
    assert store.pull(gp, gp.consumer("c"), "x", 100, TagFilter(tags, mode)) is None


def test_max_messages_stops_the_scan_at_the_last_match(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    tagged(store)
    gp = store.group("s", "g", "earliest")
    tf = TagFilter(["vip", "eu"], "or")
    first = store.pull(gp, gp.consumer("c"), "x", 1, tf)
    second = store.pull(gp, gp.consumer("c"), "x", 10, tf)
    assert first is not None
    assert second is not None
    assert [i for _s, i in records(first)] == ["vip-eu"]
    assert [i for _s, i in records(second)] == ["vip", "eu"]


def test_unacked_filtered_messages_are_redelivered_to_a_new_session(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    tagged(store)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    got = store.pull(gp, cp, "one", 100, TagFilter(["eu"], "or"))
    assert got is not None
    store.ack(gp, cp, [[got.runs[0][0], got.runs[0][0] + 1]])
    again = store.pull(gp, cp, "two", 100, TagFilter(["eu"], "or"))
    assert again is not None
    assert [i for _s, i in records(again)] == ["eu"]


def test_bloom_never_says_no_to_a_match() -> None:
    tf_or = TagFilter(["a", "b"], "or")
    tf_and = TagFilter(["a", "b"], "and")
    from qmq.protocol.message import encode_tags

    assert tf_or.maybe(tag_bloom(encode_tags(["b", "z"])))
    assert tf_and.maybe(tag_bloom(encode_tags(["z", "b", "a"])))
    assert not tf_and.maybe(0)
