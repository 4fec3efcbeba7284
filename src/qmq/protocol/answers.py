"""Answers that carry lists: one msgpack map in the frame body, cut into pages of bounded bytes.

A frame header is a small map of parameters (``frame_header_bytes_max``, 64 KiB); a list
whose length the peer does not bound — subjects, consumer groups, consumers, dead letters, a
send's refusals — does not fit it. So a command whose answer holds a list answers with an
empty header and its whole answer as one msgpack map in the body, the *answer document*
(``ANSWERED_IN_BODY``; errors stay ``{"error"}`` in the header of a non-OK answer).

A list that grows without a bound is paged: the request may carry ``after`` (the ``next`` of
the previous page, passed back unchanged) and ``limit`` (most items), and a page ends when it
holds ``limit`` items or about ``PAGE_BYTES_MAX`` bytes, whichever comes first; its
document then carries ``next``, or no ``next`` after the last page. A page's first item
always fits, so a page is at most ``PAGE_BYTES_MAX`` or one item, and an item is at most one
stored message's worth, which arrived in a frame. docs/protocol.md has each command's keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from qmq.common.limits import KiB
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import LocalProtocolError, RemoteProtocolError
from qmq.protocol.frame import Frame
from qmq.protocol.packing import PACK_BUFFER_BYTES, packb

# A page fits a frame (frame_bytes_max, 16 MiB) many times over and is packed in about a
# millisecond, so one listing request never holds a server's loop for long.
PAGE_BYTES_MAX = 256 * KiB

ANSWERED_IN_BODY = frozenset(
    {
        RequestCode.SEND_MESSAGES,
        RequestCode.SUBJECTS,
        RequestCode.LAG,
        RequestCode.DELAY_STATS,
        RequestCode.DELAY_LIST,
        RequestCode.DEAD_LETTERS,
        RequestCode.ACK_MANY,
        RequestCode.TRACE,
    }
)


def pack(value: Any) -> bytes:
    """One value as msgpack (an item of a page, a field of a document)."""
    try:
        packed = packb(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"answer cannot be encoded as msgpack: {exc}") from None
    return packed


def encode_answer(fields: Mapping[str, Any], lists: Mapping[str, Sequence[bytes]] | None = None) -> bytes:
    """The answer document: a map of ``fields`` and, under each key of ``lists``, an array of
    items already packed one by one (a ``Page``'s), so no item is packed twice."""
    lists = lists or {}
    packer = msgpack.Packer(buf_size=PACK_BUFFER_BYTES)
    parts = [packer.pack_map_header(len(fields) + len(lists))]
    for key, value in fields.items():
        parts.append(pack(key))
        parts.append(pack(value))
    for key, items in lists.items():
        parts.append(pack(key))
        parts.append(packer.pack_array_header(len(items)))
        parts.extend(items)
    return b"".join(parts)


def answer_of(frame: Frame) -> dict[str, Any]:
    """What an OK answer says: its body's document for a command in ``ANSWERED_IN_BODY``,
    its header for the others."""
    if frame.code not in ANSWERED_IN_BODY:
        return frame.header
    try:
        doc = msgpack.unpackb(bytes(frame.body), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises many types for bad input; all mean the same here
        raise RemoteProtocolError(
            f"the answer to {RequestCode(frame.code).name} has no answer document in its body: "
            f"{type(exc).__name__}: {exc} (a server older than this client?)"
        ) from None
    if not isinstance(doc, dict):
        raise RemoteProtocolError(
            f"the answer document of {RequestCode(frame.code).name} must be a map, got {type(doc).__name__}"
        )
    return doc


class Page:
    """Items of one page of a listing, packed as they are added, until it holds ``items_max``
    items or about ``bytes_max`` bytes (module docstring)."""

    __slots__ = ("bytes_max", "full", "items", "items_max", "nbytes")

    def __init__(self, items_max: int, bytes_max: int = PAGE_BYTES_MAX) -> None:
        self.items_max = items_max
        self.bytes_max = bytes_max
        self.items: list[bytes] = []
        self.nbytes = 0
        self.full = False  # an item was turned away: a next page has it

    @property
    def room_bytes(self) -> int:
        """Bytes an item may still take (all of them for the first item: it always fits)."""
        return self.bytes_max - self.nbytes if self.items else self.bytes_max

    def add(self, item: Any) -> bool:
        """Add ``item``; False, and the page is full, when it would pass a bound."""
        return self.add_packed(pack(item)) if self.has_room() else False

    def has_room(self) -> bool:
        """Whether another item may be tried (the count allows it); False makes the page full."""
        if len(self.items) >= self.items_max:
            self.full = True
        return not self.full

    def add_packed(self, packed: bytes) -> bool:
        if not self.has_room():
            return False
        if self.items and self.nbytes + len(packed) > self.bytes_max:
            self.full = True
            return False
        self.items.append(packed)
        self.nbytes += len(packed)
        return True
