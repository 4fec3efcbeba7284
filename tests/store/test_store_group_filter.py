"""A group's server-side filter in the store: a message it cannot evaluate reaches the group's
dead letters within the pull that passed it over (a long poll's included), so a broker that stops
after that pull loses none, and a scan never passes over more such messages than it letters."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conftest import append, batch, flush
from qmq.common.naming import dead_subject
from qmq.protocol.message import decode_message, decode_properties
from qmq.store import group_filter
from qmq.store.broker_store import BrokerStore
from qmq.store.dead_letters import ERROR_PROPERTY
from qmq.store.group_filter import UNEVALUABLE_KEPT_MAX, GroupFilter

DEAD = dead_subject("s", "g")


def _letter_ids(store: BrokerStore) -> list[str]:
    out: list[str] = []
    after = -1
    while page := store.dead.letters(DEAD, after=after, limit=100):
        out.extend(decode_message(letter.message).message_id for letter in page)
        after = page[-1].number
    return out


def test_a_letter_is_written_by_the_pull_itself_and_outlives_a_stop(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("s", ["not-json"], body=b"not json") + batch("s", ["small"], body=b'{"amount": 1}'))
    flush(store)
    gp = store.group("s", "g", "earliest")
    # what a parked long poll does (broker/pulls.py): the store's pull alone, no handler after it
    assert store.pull(gp, gp.consumer("c"), "x", 10, GroupFilter("body.amount > `100`")) is None
    assert gp.pull_offset == 2  # both passed over: they count as consumed for the group
    assert _letter_ids(store) == ["not-json"]
    letter = store.dead.letters(DEAD)[0]
    assert "cannot evaluate it" in str(decode_properties(decode_message(letter.message).properties_raw)[ERROR_PROPERTY])
    store.close()  # the broker stops before the group ever pulls again

    again = open_store()
    assert _letter_ids(again) == ["not-json"]


def test_a_scan_stops_once_it_holds_as_many_unevaluable_messages_as_it_may(
    open_store: Callable[..., BrokerStore],
) -> None:
    store = open_store()
    n = UNEVALUABLE_KEPT_MAX + 50
    ids = [f"bad-{i}" for i in range(n)]
    append(store, batch("s", ids, body=b"not json") + batch("s", ["big"], body=b'{"amount": 500}'))
    flush(store)
    gp = store.group("s", "g", "earliest")
    gf = GroupFilter("body.amount > `100`")
    assert store.pull(gp, gp.consumer("c"), "x", 10, gf) is None
    assert gp.pull_offset == UNEVALUABLE_KEPT_MAX  # stopped there: the rest waits for the next pull
    assert gf.waiting == []
    got = store.pull(gp, gp.consumer("c"), "x", 10, gf)
    assert got is not None
    assert got.messages == 1  # the matching one, after the last 50 were lettered
    assert gp.pull_offset == n + 1
    assert _letter_ids(store) == ids  # every one, once, in order


def test_a_scan_stops_once_the_filter_spent_its_time(
    open_store: Callable[..., BrokerStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(group_filter, "SCAN_EVAL_NS_MAX", 0)  # any evaluation spends it
    store = open_store()
    append(store, batch("s", [f"m{i}" for i in range(3)], body=b'{"amount": 500}'))
    flush(store)
    gp = store.group("s", "g", "earliest")
    gf = GroupFilter("body.amount > `100`")
    for n in (1, 2, 3):  # one message a pull, every one handed out in turn
        got = store.pull(gp, gp.consumer("c"), "x", 10, gf)
        assert got is not None
        assert got.messages == 1
        assert gp.pull_offset == n


def test_a_filter_that_grows_without_end_dead_letters_the_message(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("s", ["m0"], body=b'["x"]'))
    flush(store)
    gp = store.group("s", "g", "earliest")
    assert store.pull(gp, gp.consumer("c"), "x", 10, GroupFilter("body" + "[].[@,@][]" * 40)) is None
    assert _letter_ids(store) == ["m0"]
    letter = store.dead.letters(DEAD)[0]
    error = str(decode_properties(decode_message(letter.message).properties_raw)[ERROR_PROPERTY])
    assert "takes more than" in error or "takes longer than" in error, error
