"""The fault campaign's checker (chaos/checker.py) counts each broken promise, and only those."""

from __future__ import annotations

from chaos.checker import History, check, periodic_allowance

GROUPS = ("g1", "g2")


def _history(*lines: str) -> History:
    h = History()
    h.read_lines(line.replace(" ", "\t") + "\n" for line in lines)
    return h


def test_a_clean_history_breaks_nothing() -> None:
    fig = check(
        _history(
            "S a rt 0", "A a 10", "S b delay 500", "A b 20", "S c rt 0",  # c: never answered
            "D g1 a 1 30", "D g2 a 1 31", "D g1 b 1 500", "D g2 b 1 501",
            "D g1 a 1 35",  # a repeat before the ack was answered is allowed
            "K g1 a 1 40", "K g2 a 1 41", "K g1 b 1 600",
        ),
        GROUPS,
    )
    assert (fig.sent, fig.acked, fig.lost, fig.duplicated_after_ack, fig.early) == (3, 2, 0, 0, 0)
    assert fig.unanswered_sends == 1
    assert fig.redelivered_before_ack == 1
    assert fig.ok()


def test_lost_duplicated_and_early_are_each_counted() -> None:
    fig = check(
        _history(
            "S a rt 0", "A a 10", "S b delay 500", "A b 20",
            "D g1 a 1 30", "K g1 a 1 40", "D g1 a 1 50",  # a again to g1 after its ack: a duplicate
            "D g2 a 2 60",  # a retry copy (attempt 2) is another delivery, fine
            "D g1 b 1 499", "D g2 b 1 700",  # b early to g1
            "D g1",  # a line cut by kill -9
        ),
        GROUPS,
    )
    assert fig.duplicated_after_ack == 1
    assert fig.early == 1
    assert fig.lost == 0
    assert not fig.ok()
    lost = check(_history("S a rt 0", "A a 10", "D g1 a 1 30"), GROUPS)
    assert lost.lost == 1
    assert "never delivered to g2" in lost.examples[0]


def test_the_periodic_allowance_excuses_what_a_cut_may_undo_and_nothing_else() -> None:
    # a cut at 10,000 ms, a window of 1,000 ms before it
    h = _history(
        "S a rt 0", "A a 9500",  # acknowledged 500 ms before the cut, never delivered: allowed
        "S b rt 0", "A b 5000",  # acknowledged 5 s before it, never delivered: lost
        "S c rt 0", "A c 100", "D g1 c 1 200", "D g2 c 1 200", "K g1 c 1 9800", "D g1 c 1 12000",  # ack undone
        "K g2 c 1 300", "D g2 c 1 12000",  # an ack answered 9.7 s before the cut: beyond
        # delivered 300 ms before the cut, its ack answered after the restart: the pull was undone
        "S d rt 0", "A d 100", "D g1 d 1 9700", "D g2 d 1 200", "K g1 d 1 13000", "D g1 d 1 13100",
        # delivered 9.8 s before the cut (its pull durable by then), acked after it: beyond
        "K g2 d 1 13000", "D g2 d 1 13100",
    )
    a = periodic_allowance(h, GROUPS, [10_000], 1_000)
    assert (a.lost_within, a.lost_beyond) == (2, 2)  # a and b, to both groups
    assert (a.again_within, a.again_beyond) == (2, 2)
    assert len(a.examples) == 2
    assert all("again after ack" in e for e in a.examples)


def test_a_repeat_names_where_each_copy_came_from() -> None:
    fig = check(
        _history(
            "S a rt 0", "A a 10",
            "D g1 a 1 30", "W g1 a 1 30 b2 306", "K g1 a 1 40",
            "D g1 a 1 50", "W g1 a 1 50 b1 362",  # another group's copy: stored twice
            "D g2 a 1 30", "D g2 a 1 31",  # no W lines (an older history): no places named
        ),
        GROUPS,
    )
    assert fig.duplicated_after_ack == 1
    assert fig.examples[0].endswith("; copies from b2#306, b1#362"), fig.examples
