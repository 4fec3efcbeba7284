"""msgpack encoding with a small first buffer: what every frame header, answer and action-log
record is packed with.

``msgpack.packb`` makes a ``Packer`` whose buffer starts at 256 KiB. The servers lower glibc's
mmap threshold to that size (``serving/runner.py``: large freed blocks go back to the system),
so each such buffer was an ``mmap`` and a ``munmap`` — with the servers' fsync threads about,
a TLB shootdown across cores each time: 16 to 34 µs to pack a header of a few dozen bytes,
against 2 µs with a buffer of 1 KiB that grows (by ``realloc``) only when a value needs it.
"""

from __future__ import annotations

from typing import Any

import msgpack

__all__ = ["PACK_BUFFER_BYTES", "packb"]

# the first buffer of a pack: a frame header, an ack or a pull's action-log record fits
PACK_BUFFER_BYTES = 1024


def packb(value: Any) -> bytes:
    """``value`` as msgpack (bin type for bytes, as ``msgpack.packb``); raises what it raises."""
    packed: bytes = msgpack.packb(value, use_bin_type=True, buf_size=PACK_BUFFER_BYTES)
    return packed
