"""Ack ranges: coalescing, put-back after a failed request, the per-request bound."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from qmq.client.acks import AckTracker, coalesce


def _covered(ranges: list[list[int]]) -> set[int]:
    return {o for s, e in ranges for o in range(s, e)}


def test_in_order_offsets_make_one_range() -> None:
    assert coalesce(range(10)) == [[0, 10]]


def test_out_of_order_offsets_make_disjoint_sorted_ranges() -> None:
    assert coalesce([9, 3, 4, 0, 8, 2]) == [[0, 1], [2, 5], [8, 10]]


def test_repeats_and_put_back_ranges_merge() -> None:
    assert coalesce([5, 5, 6], [[0, 3], [2, 5], [10, 12]]) == [[0, 7], [10, 12]]
    assert coalesce([], [[3, 3]]) == []


@given(st.lists(st.integers(0, 500)), st.lists(st.tuples(st.integers(0, 500), st.integers(0, 50))))
def test_coalesce_covers_exactly_what_was_acked(offsets: list[int], spans: list[tuple[int, int]]) -> None:
    ranges = [[s, s + n] for s, n in spans]
    out = coalesce(offsets, ranges)
    assert _covered(out) == set(offsets) | _covered(ranges)
    # sorted, disjoint and not touching: nothing could be merged further
    for (_, e1), (s2, _) in itertools.pairwise(out):
        assert e1 < s2


@given(st.lists(st.integers(0, 300)))
def test_tracker_take_matches_coalesce(offsets: list[int]) -> None:
    t = AckTracker("b1", "s", "g", "s")
    for o in offsets:
        t.ack(o)
    assert t.take() == coalesce(offsets)
    assert not t.pending
    assert t.take() == []


def test_put_back_ranges_ride_on_the_next_take() -> None:
    t = AckTracker("b1", "s", "g", "s")
    t.ack_many([0, 1, 2])
    first = t.take()
    t.requeue(first)  # the request carrying them failed
    t.ack(3)
    assert t.take() == [[0, 4]]


def test_a_take_is_bounded_and_keeps_the_rest_pending() -> None:
    t = AckTracker("b1", "s", "g", "s")
    t.ack_many(range(0, 20, 2))  # ten separate ranges
    assert t.take(ranges_max=4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.pending
    assert _covered(t.take(ranges_max=100)) == set(range(8, 20, 2))


class _Puller:
    """Stands for a SubjectPuller in ack_many_chunks: it only asks for ``ack_entry``."""

    def __init__(self, subject: str) -> None:
        self.subject = subject

    def ack_entry(self, tracker: AckTracker) -> tuple[dict[str, object], list[list[int]]] | None:
        ranges = tracker.take()
        return ({"subject": self.subject, "group": "g", "ranges": ranges}, ranges) if ranges else None


def test_ack_many_requests_stay_within_their_entry_and_byte_bounds() -> None:
    import msgpack

    from qmq.client.puller import ack_many_chunks

    pairs = []
    for i in range(300):
        subject = f"{i:03d}" + "s" * 150
        tracker = AckTracker("b1", subject, "g", subject)
        tracker.ack_many(range(0, 40, 2))  # 20 disjoint ranges
        pairs.append((_Puller(subject), tracker))
    pairs.append((_Puller("idle"), AckTracker("b1", "idle", "g", "idle")))  # nothing pending: no entry
    chunks = ack_many_chunks(pairs, entries_max=100, header_bytes=16 * 1024)  # type: ignore[arg-type]
    assert sum(len(c) for c in chunks) == 300
    assert [e["subject"] for c in chunks for _p, _t, e, _r in c] == [p.subject for p, _t in pairs[:300]]
    for chunk in chunks:
        assert len(chunk) <= 100
        assert len(msgpack.packb({"consumer_id": "c", "acks": [e for _p, _t, e, _r in chunk]})) <= 16 * 1024 + 64
    assert len(chunks) > 3  # the byte bound cut them, not only the count
    assert not any(t.pending for _p, t in pairs)  # taken: requeued by the sender if a request fails


def test_a_tracker_is_listed_while_it_has_acks_no_request_took() -> None:
    listed: set[AckTracker] = set()
    t = AckTracker("b1", "s", "g", "s", listed=listed)
    idle = AckTracker("b1", "idle", "g", "idle", listed=listed)
    assert not listed  # nothing acked yet: a flush does not look at either
    t.ack(0)
    t.ack(1)
    assert listed == {t}
    listed.pop()  # a flush took it out ...
    t.relist()  # ... and its request could not go: back in
    assert listed == {t}
    listed.pop()
    assert t.take() == [[0, 2]]
    t.relist()  # nothing left pending: not listed
    assert not listed
    t.requeue([[0, 2]])  # the request carrying them failed
    assert listed == {t}
    listed.clear()
    t.take()
    t.ack_many([5, 6])
    assert listed == {t}
    assert not idle.pending
