"""Order keys and logical slots: what a valid order key is, which slot it hashes to, and which
broker group of a subject's route holds a slot (see docs/ordered.md).

A key hashes to one of ``SLOTS`` logical slots; slots, never keys, are placed on broker groups
and handed to consumers. A message carries ``order_slot`` = slot + 1 in its header (0: no key),
so old messages, written with 0 there, read as unordered.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Literal

from qmq.common.errors import InvalidMessageError

SLOTS = 1024
ORDER_KEY_CHARS_MAX = 128
ORDER_KEY_PROPERTY = "qmq.order_key"  # the key itself, for consumers that group by it
OrderMode = Literal["strict", "best_effort"]
ORDER_MODES: tuple[OrderMode, ...] = ("strict", "best_effort")


def check_order_key(key: object) -> str:
    """``key`` if it is a valid order key (a str of 1–128 characters), else InvalidMessageError."""
    if not isinstance(key, str):
        raise InvalidMessageError(f"order key must be a str, got {type(key).__name__} {key!r}")
    if not 1 <= len(key) <= ORDER_KEY_CHARS_MAX:
        raise InvalidMessageError(
            f"order key {key[:40]!r} has {len(key)} characters; use 1 to {ORDER_KEY_CHARS_MAX} "
            "(e.g. the order id the messages are about)"
        )
    try:
        key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(
            f"order key {key[:40]!r} holds a lone surrogate at position {exc.start} that UTF-8 cannot carry"
        ) from None
    return key


def check_order_mode(order: object) -> OrderMode:
    for mode in ORDER_MODES:
        if order == mode:
            return mode
    raise InvalidMessageError(
        f"order={order!r} is not allowed; use 'strict' (wait for the key's broker group, fail rather than "
        "write elsewhere) or 'best_effort' (fail over to another group, which may break the key's order)"
    )


def slot_of(key: str) -> int:
    """The logical slot of an order key: CRC32 of its UTF-8 bytes, modulo ``SLOTS``."""
    return zlib.crc32(key.encode("utf-8")) % SLOTS


def group_of_slot(slot: int, route: Sequence[str]) -> str:
    """The broker group of ``route`` (any order; sorted here) that holds ``slot``: the route is
    cut into equal ranges of slots, so a slot stays on its group while the route is the same."""
    groups = sorted(route)
    return groups[slot * len(groups) // SLOTS]
