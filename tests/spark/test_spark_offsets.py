"""Options, offset JSON, maxOffsetsPerTrigger shares and partition planning (no Spark needed)."""

from __future__ import annotations

import pytest

from qmq.common.errors import ConfigError
from qmq.spark.offsets import Slice, from_json, limit, parse_offsets, parse_options, plan, resolve, to_json

URL = "http://127.0.0.1:1/meta/address"


def test_options_follow_the_kafka_source_and_default_like_it() -> None:
    batch = parse_options({"meta_server": URL, "subscribe": "a, b"}, streaming=False)
    assert batch.subscribe == ("a", "b")
    assert batch.starting == "earliest"
    assert batch.ending == "latest"
    assert batch.fail_on_data_loss is True
    stream = parse_options({"meta_server": URL, "subscribePattern": "order\\..*"}, streaming=True)
    assert stream.starting == "latest"
    assert stream.selects("order.paid")
    assert not stream.selects("xorder.paid")
    # keys are case-insensitive, as Spark gives them
    assert (
        parse_options({"PATH": "/d", "SUBSCRIBE": "a", "MAXOFFSETSPERTRIGGER": "5"}, True).max_offsets_per_trigger == 5
    )


@pytest.mark.parametrize(
    ("options", "streaming", "message"),
    [
        ({"subscribe": "a"}, False, "exactly one of option meta_server"),
        ({"meta_server": URL, "path": "/d", "subscribe": "a"}, False, "exactly one of option meta_server"),
        ({"meta_server": URL}, False, "subscribe"),
        ({"meta_server": URL, "subscribe": "a", "subscribePattern": "a"}, False, "exactly one of option subscribe"),
        ({"meta_server": URL, "subscribePattern": "("}, False, "not a valid regex"),
        ({"meta_server": URL, "subscribe": "a", "startingOffsets": "latest"}, False, "would read nothing"),
        ({"meta_server": URL, "subscribe": "a", "endingOffsets": "latest"}, True, "for batch reads"),
        ({"meta_server": URL, "subscribe": "a", "maxOffsetsPerTrigger": "0"}, True, "at least 1"),
        ({"meta_server": URL, "subscribe": "a", "failOnDataLoss": "maybe"}, True, "not true or false"),
        ({"meta_server": URL, "subscribe": "a", "startingOffsets": "{bad"}, False, "neither earliest"),
        ({"meta_server": URL, "subscribe": "a", "startingOffsets": '{"a": {"g": -3}}'}, False, "-2 \\(earliest\\)"),
    ],
)
def test_bad_options_name_the_option_and_the_way_out(options: dict[str, str], streaming: bool, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_options(options, streaming)


def test_offset_json_is_per_subject_then_broker_group_with_minus_two_and_minus_one() -> None:
    spec = parse_offsets("startingOffsets", '{"a": {"g1": 5, "g2": -2}, "b": {"g1": -1}}', "earliest")
    assert spec == {("g1", "a"): 5, ("g2", "a"): -2, ("g1", "b"): -1}
    bounds = {("g1", "a"): (3, 10), ("g2", "a"): (4, 9), ("g1", "b"): (0, 7), ("g1", "c"): (2, 8)}
    assert resolve(spec, bounds, "earliest") == {("g1", "a"): 5, ("g2", "a"): 4, ("g1", "b"): 7, ("g1", "c"): 2}
    assert resolve(spec, bounds, "latest")[("g1", "c")] == 8
    positions = {("g1", "a"): 5, ("g2", "a"): 4}
    assert to_json(positions) == {"a": {"g1": 5, "g2": 4}}
    assert from_json(to_json(positions)) == positions


def test_max_offsets_per_trigger_is_shared_in_proportion_to_backlog() -> None:
    start = {("g", "a"): 0, ("g", "b"): 100, ("g", "c"): 7}
    latest = {("g", "a"): 300, ("g", "b"): 200, ("g", "c"): 7}
    end = limit(start, latest, 100)
    assert end == {("g", "a"): 75, ("g", "b"): 125, ("g", "c"): 7}
    assert limit(start, latest, None) == latest
    assert limit(start, latest, 10_000) == latest
    # leftovers of floor division go out one by one, and the total is exact
    odd = limit({("g", "a"): 0, ("g", "b"): 0, ("g", "c"): 0}, {("g", "a"): 1, ("g", "b"): 1, ("g", "c"): 1}, 2)
    assert sum(odd.values()) == 2


def test_positions_never_go_back_and_vanished_pairs_stay() -> None:
    end = limit({("g", "a"): 50, ("g2", "x"): 9}, {("g", "a"): 40}, 10)
    assert end == {("g", "a"): 50, ("g2", "x"): 9}


def test_plan_splits_ranges_and_honours_min_partitions() -> None:
    start = {("g", "a"): 0, ("g", "b"): 10}
    end = {("g", "a"): 10, ("g", "b"): 10, ("g", "new"): 5}
    assert plan(start, end, 4, None) == [Slice("g", "a", 0, 4), Slice("g", "a", 4, 8), Slice("g", "a", 8, 10)]
    assert len(plan(start, end, 1_000, 5)) == 5
    assert plan(start, start, 4, None) == []
