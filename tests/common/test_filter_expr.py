"""The groups' expressions (filters and transforms) as one piece of code: compiled with the
position of an error, evaluated over {properties, tags, body} within the bounds, a transform's
result bounded; and a version 1 receipt (without the message's sequence) still read."""

from __future__ import annotations

import json
import time

import pytest

from qmq.common.filter_expr import (
    BODY_BYTES_MAX,
    EVAL_MS_MAX,
    EVAL_VALUE_ITEMS_MAX,
    RESULT_BYTES_MAX,
    FilterExprError,
    UnevaluableError,
    compile_filter,
    evaluate,
    needs_body,
    result_json,
)
from qmq.gateway.receipts import Receipt, ReceiptCodec, _b64
from qmq.gateway.transforms import Transforms


def test_an_invalid_expression_names_its_kind_and_position() -> None:
    with pytest.raises(FilterExprError, match=r"invalid transform '\{id: body.id': .* at position 12"):
        compile_filter("{id: body.id", "transform")
    with pytest.raises(FilterExprError, match="invalid filter"):
        compile_filter("body.amount >")
    with pytest.raises(FilterExprError, match="the limit is 4096"):
        compile_filter("a" * 4097, "transform")


def test_evaluation_reads_the_document_and_names_what_it_cannot() -> None:
    compiled = compile_filter("{id: body.id, eu: properties.region == 'eu', vip: contains(tags, 'vip')}")
    doc = evaluate(compiled, {"region": "eu"}, ["vip"], json.dumps({"id": 7}).encode())
    assert doc == {"id": 7, "eu": True, "vip": True}
    assert needs_body("body.id")
    assert not needs_body("properties.region")
    assert evaluate(compile_filter("properties.region"), {"region": "us"}, [], None) == "us"
    with pytest.raises(UnevaluableError, match="Expecting value"):
        evaluate(compiled, {}, [], b"not json")
    with pytest.raises(UnevaluableError, match=f"at most {BODY_BYTES_MAX}"):
        evaluate(compiled, {}, [], b" " * (BODY_BYTES_MAX + 1))
    with pytest.raises(UnevaluableError):
        evaluate(compile_filter("abs(body)"), {}, [], b'"text"')  # a type error of a function


@pytest.mark.parametrize(
    ("expr", "body", "why"),
    [
        # each "[].[@,@][]" doubles the list: 40 of them would make 2**40 items in 400 characters
        ("body" + "[].[@,@][]" * 40, b'["x"]', "takes (more than|longer than)"),
        # each join doubles the string: 60 of them, 2**60 characters
        ("body" + " | join('', [@, @])" * 60, b'"abc"', f"the limit is {EVAL_VALUE_ITEMS_MAX:,}"),
    ],
)
def test_an_evaluation_that_grows_without_end_is_stopped_within_its_bounds(expr: str, body: bytes, why: str) -> None:
    compiled = compile_filter(expr)
    began = time.monotonic()
    with pytest.raises(UnevaluableError, match=why):
        evaluate(compiled, {}, [], body)
    # the deadline, plus one step at most (a value within the bound), on a loaded machine
    assert time.monotonic() - began < EVAL_MS_MAX / 1000 + 2.0


def test_a_transform_result_is_json_text_within_its_bound() -> None:
    assert result_json({"a": "é"}) == '{"a":"é"}'.encode()
    with pytest.raises(UnevaluableError, match=f"the limit is {RESULT_BYTES_MAX}"):
        result_json("x" * RESULT_BYTES_MAX)


def test_transforms_keep_compiled_ones_and_skip_bad_rows() -> None:
    t = Transforms()
    t.apply([["s", "g", "{a: body.a}"], ["s", "bad", "{a:"], ["only", "two"]])
    first = t.of("s", "g")
    assert first is not None
    assert t.of("s", "bad") is None
    t.apply([["s", "g", "{a: body.a}"]])
    assert t.of("s", "g") is first  # compiled once
    t.apply([])
    assert t.of("s", "g") is None


def test_a_receipt_of_version_1_is_still_read() -> None:
    codec = ReceiptCodec(b"k" * 32)
    r = Receipt("b1", "s", "g", "c", 5, 1_000, 42)
    assert codec.decode(codec.encode(r)) == r
    old = b"1\nb1\ns\ng\nc\n5\n1000"
    text = f"{_b64(old)}.{_b64(codec._mac(old))}"
    assert codec.decode(text) == Receipt("b1", "s", "g", "c", 5, 1_000, -1)
