"""qmq.protocol.packing: msgpack with a small first buffer that grows when a value needs it."""

import msgpack
import pytest

from qmq.protocol.packing import PACK_BUFFER_BYTES, packb


@pytest.mark.parametrize(
    "value",
    [
        {},
        [3, "orders.created", "g1", "c1", 0, [[0, 1]], 1, 0, 1_764_370_000_000],
        {"body": b"\x00\xff" * 10, "text": "é", "n": -(2**63), "f": 0.5, "none": None, "ok": True},
        # far past the first buffer: grown, not cut
        {"results": [{"n": i, "body": bytes([i % 256]) * 1000} for i in range(300)]},
    ],
)
def test_what_is_packed_unpacks_to_the_same_value_whatever_its_size(value: object) -> None:
    packed = packb(value)
    assert packed == msgpack.packb(value, use_bin_type=True)
    assert msgpack.unpackb(packed, raw=False) == value


def test_bytes_are_packed_as_bin_and_the_first_buffer_is_small() -> None:
    assert packb(b"ab") == b"\xc4\x02ab"  # bin 8, not raw str
    assert PACK_BUFFER_BYTES <= 4096  # well below glibc's mmap threshold as the servers set it


def test_a_value_msgpack_cannot_encode_raises_and_the_next_pack_is_whole() -> None:
    with pytest.raises(TypeError):
        packb({"x": object()})
    assert msgpack.unpackb(packb({"after": [1, 2, 3]}), raw=False) == {"after": [1, 2, 3]}
