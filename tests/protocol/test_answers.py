"""Answer documents and pages (qmq.protocol.answers): a list answer in the body, cut by count and by bytes."""

from __future__ import annotations

import msgpack
import pytest

from qmq.protocol.answers import Page, answer_of, encode_answer, pack
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.frame import Frame


def test_a_document_of_fields_and_packed_items_reads_back_whole() -> None:
    page = Page(10)
    for name in ("a", "b"):
        assert page.add({"subject": name})
    body = encode_answer({"next": ["b", None], "total": 2}, {"subjects": page.items})
    frame = Frame(RequestCode.SUBJECTS, 1, {}, body, response=True)
    assert answer_of(frame) == {"next": ["b", None], "total": 2, "subjects": [{"subject": "a"}, {"subject": "b"}]}


def test_a_command_answered_in_its_header_reads_the_header() -> None:
    frame = Frame(RequestCode.ACK, 1, {"ack_offset": 3}, b"", response=True)
    assert answer_of(frame) == {"ack_offset": 3}


@pytest.mark.parametrize("body", [b"", msgpack.packb([1, 2]), b"\xc1"])
def test_an_answer_without_a_document_is_the_peers_fault_and_says_so(body: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match="LAG"):
        answer_of(Frame(RequestCode.LAG, 1, {}, body, response=True))


def test_a_page_ends_at_its_count() -> None:
    page = Page(2)
    assert page.add(1)
    assert page.add(2)
    assert not page.full
    assert not page.add(3)
    assert page.full
    assert [msgpack.unpackb(i) for i in page.items] == [1, 2]


def test_a_page_ends_at_its_bytes_but_its_first_item_always_fits() -> None:
    big = "x" * 300
    page = Page(100, bytes_max=1000)
    added = 0
    while page.add(big):
        added += 1
    assert added == 3  # 3 x 303 bytes; a fourth would pass 1000
    assert page.full
    assert page.nbytes <= 1000
    alone = Page(100, bytes_max=100)
    assert alone.add(big)  # larger than the page, but first
    assert not alone.add("y")
    assert alone.room_bytes < 0


def test_an_item_that_cannot_be_packed_is_a_local_error() -> None:
    from qmq.protocol.errors import LocalProtocolError

    with pytest.raises(LocalProtocolError, match="cannot be encoded"):
        pack({"x": object()})
