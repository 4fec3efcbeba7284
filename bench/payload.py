"""The benchmark message: a 24-byte header (sequence, two timestamps) and filler, 1 KiB
unless a cell asks for another size (W11: 64 KiB and 1 MiB).

Byte layout (little-endian):

    0        8              16             24                    1024
    +--------+--------------+--------------+---------------------+
    | seq u64| stamp_a_ns   | stamp_b_ns   | pseudo-random filler|
    +--------+--------------+--------------+---------------------+

What the stamps mean depends on the workload: W3 puts the CLOCK_MONOTONIC send time in
`stamp_a` and the intended (scheduled) send time in `stamp_b`; W4/W5 put the due time in
epoch nanoseconds in `stamp_a`.
"""

from __future__ import annotations

import os
import struct

from bench.settings import PAYLOAD_BYTES

HEADER = struct.Struct("<QQQ")
FILLER_BYTES = PAYLOAD_BYTES - HEADER.size
# Random filler so that no layer can compress the payload to nothing; slices of one
# pool keep building a body cheap on the client side.
_POOL = os.urandom(2 << 20)
BODY_BYTES_MAX = len(_POOL) // 2
_STRIDE = 7919


def make_body(seq: int, stamp_a_ns: int, stamp_b_ns: int, size: int = PAYLOAD_BYTES) -> bytes:
    """A body of `size` bytes (HEADER.size..BODY_BYTES_MAX)."""
    if not HEADER.size <= size <= BODY_BYTES_MAX:
        raise ValueError(f"body size {size}: expected {HEADER.size}..{BODY_BYTES_MAX} bytes")
    filler = size - HEADER.size
    start = (seq * _STRIDE) % (len(_POOL) - filler)
    return HEADER.pack(seq, stamp_a_ns, stamp_b_ns) + _POOL[start : start + filler]


def read_header(body: bytes | memoryview) -> tuple[int, int, int]:
    seq, stamp_a_ns, stamp_b_ns = HEADER.unpack_from(body)
    return seq, stamp_a_ns, stamp_b_ns
