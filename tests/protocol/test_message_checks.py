"""What a broker checks of each message at send, beyond splitting the batch (scan_batch's problems)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qmq.common.limits import DEFAULT_LIMITS
from qmq.protocol.message import encode_message, encode_properties, encode_tags, scan_batch


def _message(
    message_id: bytes = b"id-1", props: bytes = b"", tags: bytes = b"", tag_count: int = 0, times: int = 0
) -> bytes:
    return encode_message(b"orders.paid", message_id, tags, tag_count, props, b"body", 1, 0, times)


GOOD = _message(props=encode_properties({"orderId": "42", "n": 7, "ok": True, "raw": b"\xff"}))


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (_message(message_id=b"id-\xff"), "message id is not valid UTF-8 (byte 3)"),
        (_message(tags=b"\x02\xc3(", tag_count=1), "tags are not valid UTF-8"),
        (_message(times=DEFAULT_LIMITS.attempts_max + 1), "attempt count (times) 10002 is over attempts_max 10001"),
        (_message(times=65535), "attempt count (times) 65535"),
        (_message(props=b"\xc1"), "properties are not one msgpack map"),
        (_message(props=msgpack.packb([1, 2])), "properties are not one msgpack map"),
        (_message(props=msgpack.packb({"a": 1}) + b"\x01"), "properties are not one msgpack map"),
        (_message(props=msgpack.packb({"a": "b"})[:-1]), "properties are not one msgpack map"),
    ],
)
def test_a_bad_message_is_named_by_index_and_the_rest_pass(bad: bytes, reason: str) -> None:
    problems: dict[int, str] = {}
    scanned = scan_batch(GOOD + bad + GOOD, problems=problems)
    assert len(scanned) == 3
    assert list(problems) == [1]
    assert reason in problems[1]


def test_good_batches_have_no_problems_and_cost_no_check_without_asking() -> None:
    tagged = _message(tags=encode_tags(["vip", "中文"]), tag_count=2, times=DEFAULT_LIMITS.attempts_max)
    problems: dict[int, str] = {}
    assert len(scan_batch(GOOD + tagged + _message(), problems=problems)) == 3
    assert problems == {}
    assert len(scan_batch(_message(message_id=b"\xff"))) == 1  # no problems asked for: not checked


def test_two_property_blocks_that_only_parse_together_are_both_refused() -> None:
    # a truncated map followed by a block that completes it: each block alone is not one map
    whole = msgpack.packb({"a": "b", "c": 1})
    cut = 5
    problems: dict[int, str] = {}
    scan_batch(_message(props=whole[:cut]) + _message(props=whole[cut:]), problems=problems)
    assert set(problems) == {0, 1}


@given(st.lists(st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=4), max_size=20))
def test_any_properties_the_sdk_encodes_pass(all_props: list[dict[str, str]]) -> None:
    body = b"".join(_message(props=encode_properties(p)) for p in all_props)
    problems: dict[int, str] = {}
    scan_batch(body, problems=problems)
    assert problems == {}


@given(st.binary(min_size=1, max_size=64))
def test_random_property_bytes_are_refused_unless_one_map(raw: bytes) -> None:
    problems: dict[int, str] = {}
    scan_batch(_message(props=raw), problems=problems)
    try:
        unpacker = msgpack.Unpacker()
        unpacker.feed(raw)
        unpacker.skip()
        one_map = raw[0] in {*range(0x80, 0x90), 0xDE, 0xDF} and unpacker.tell() == len(raw)
    except Exception:
        one_map = False
    assert (0 not in problems) == one_map
