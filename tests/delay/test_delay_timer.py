"""The in-memory timer: rows come out in due order, never before they are due, from compact arrays."""

from __future__ import annotations

import numpy as np

from qmq.delay.timer import ROW, ROW_BYTES, Timer, merge_rows, sort_rows


def rows(dues: list[int], bucket: int = 0, first_entry: int = 0) -> np.ndarray:
    out = np.zeros(len(dues), dtype=ROW)
    out["due"] = dues
    out["bucket"] = bucket
    out["entry"] = np.arange(first_entry, first_entry + len(dues))
    out["size"] = 100
    out["offset"] = out["entry"].astype(np.uint64) * 100
    return out


def test_rows_come_out_in_due_order_across_main_and_late_runs() -> None:
    t = Timer(late_rows_max=1000)
    t.add_sorted_main(sort_rows(rows([50, 10, 30], bucket=1)))
    t.add(rows([20, 40, 5], bucket=2))
    assert t.next_due() == 5
    out = t.take(1_000, 100)
    assert out["due"].tolist() == [5, 10, 20, 30, 40, 50]
    assert len(t) == 0
    assert t.next_due() is None


def test_never_early_only_rows_due_by_now() -> None:
    t = Timer()
    t.add(rows([100, 200, 300]))
    assert len(t.take(99, 10)) == 0
    assert t.take(200, 10)["due"].tolist() == [100, 200]
    assert t.next_due() == 300
    assert len(t.take(299, 10)) == 0


def test_rows_max_leaves_the_rest_in_place() -> None:
    t = Timer(late_rows_max=1000)
    t.add_sorted_main(rows([1, 3, 5, 7]))
    t.add(rows([2, 4, 6, 8], first_entry=10))
    first = t.take(100, 3)
    assert first["due"].tolist() == [1, 2, 3]
    second = t.take(100, 3)
    assert second["due"].tolist() == [4, 5, 6]
    assert t.take(100, 10)["due"].tolist() == [7, 8]


def test_equal_due_times_keep_the_order_they_were_added_in() -> None:
    t = Timer()
    t.add(rows([7, 7, 7], first_entry=0))
    t.add(rows([7, 7], first_entry=3))
    assert t.take(7, 10)["entry"].tolist() == [0, 1, 2, 3, 4]


def test_late_run_merges_into_main_past_its_bound() -> None:
    t = Timer(late_rows_max=8)
    t.add_sorted_main(rows(list(range(0, 100, 10))))
    for i in range(5):
        t.add(rows([i * 20 + 5, i * 20 + 15], first_entry=100 + 2 * i))
    # 10 late rows passed the bound of 8: one merge happened, the late run holds what came after
    assert len(t._late) - t._late_head <= 8
    out = t.take(10_000, 100)
    assert out["due"].tolist() == sorted(out["due"].tolist())
    assert len(out) == 20


def test_merge_reports_where_the_second_run_went() -> None:
    a = rows([1, 3, 5])
    b = rows([2, 3, 6], first_entry=10)
    merged, at_b = merge_rows(a, b)
    assert merged["due"].tolist() == [1, 2, 3, 3, 5, 6]
    assert merged["entry"][at_b].tolist() == [10, 11, 12]
    # a's row sorts first among equal due times
    assert merged["entry"].tolist()[2:4] == [1, 11]


def test_drop_bucket_removes_only_its_rows() -> None:
    t = Timer()
    t.add(rows([1, 2], bucket=1))
    t.add(rows([3, 4], bucket=2))
    assert t.drop_bucket(1) == 2
    assert t.take(10, 10)["bucket"].tolist() == [2, 2]


def test_memory_is_arrays_not_an_object_per_message() -> None:
    t = Timer()
    n = 200_000
    due = np.random.default_rng(1).integers(0, 30_000, n)
    t.add_sorted_main(sort_rows(rows(due.tolist())))
    assert len(t) == n
    assert isinstance(t._main, np.ndarray)
    assert t.nbytes == n * ROW_BYTES
    assert ROW_BYTES == 32
    taken = 0
    while len(t):
        taken += len(t.take(30_000, 7_000))
    assert taken == n
    assert t.nbytes <= 64 * 7_000  # taken prefixes are dropped as the timer drains


def test_small_batches_wait_unsorted_until_one_is_due_or_enough_came() -> None:
    t = Timer(incoming_rows_max=100)
    t.add_sorted_main(rows(list(range(1_000, 2_000, 100))))
    for i in range(10):  # 50 rows in batches of 5: none merged yet, so no copy of the late run per batch
        t.add(rows([5_000 - i * 10 - j for j in range(5)], first_entry=100 + 5 * i))
    assert len(t._late) == 0
    assert len(t) == 60
    assert t.next_due() == 1_000
    t.add(rows([900], first_entry=999))  # earlier than everything held: next_due sees it at once
    assert t.next_due() == 900
    assert t.take(950, 10)["entry"].tolist() == [999]  # a due one brings the batches into the late run
    assert len(t._late) - t._late_head == 50
    for i in range(10):
        t.add(rows([9_000 + i] * 10, first_entry=200 + 10 * i))
    assert len(t._late) - t._late_head == 150  # 100 incoming rows reached the bound and were merged
    out = t.take(100_000, 1_000)
    assert out["due"].tolist() == sorted(out["due"].tolist())
    assert len(out) == 160
    # equal due times kept the order their batches came in
    assert out["entry"][out["due"] >= 9_000].tolist()[:10] == list(range(200, 210))
