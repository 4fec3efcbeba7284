"""The console's memory of rates (qmq.console.history): bounded in samples and series, every
series lined up with the time axis."""

from __future__ import annotations

from qmq.console.history import RateHistory, sample_values


def test_series_line_up_with_the_times_and_old_samples_go() -> None:
    history = RateHistory(points_max=3, series_max=10)
    history.add(1.0, {("in", "a"): 1.0})
    history.add(2.0, {("in", "a"): 2.0, ("in", "b"): 5.0})
    history.add(3.0, {("in", "b"): 6.0})
    history.add(4.0, {("in", "a"): 4.0})
    chart = history.chart([("a", ("in", "a")), ("b", ("in", "b")), ("c", ("in", "c"))])
    assert chart["t"] == [2.0, 3.0, 4.0]
    assert chart["series"] == [[2.0, None, 4.0], [5.0, 6.0, None], [None, None, None]]
    assert chart["labels"] == ["a", "b", "c"]


def test_series_past_the_bound_are_counted_not_kept() -> None:
    history = RateHistory(points_max=5, series_max=2)
    history.add(1.0, {("in", "a"): 1.0, ("in", "b"): 1.0, ("in", "c"): 1.0})
    assert set(history.series) == {("in", "a"), ("in", "b")}
    assert history.dropped_series == 1


def test_a_top_view_becomes_rates_per_subject_and_lag_per_group() -> None:
    doc = {
        "subjects": [{"subject": "s", "in_per_s": 3.5, "out_per_s": None}],
        "groups": [{"subject": "s", "group": "g", "lag": 7}],
    }
    assert sample_values(doc) == {("in", "s"): 3.5, ("out", "s"): None, ("lag", "s", "g"): 7.0}
