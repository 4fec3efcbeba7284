"""The fault campaign's checker (chaos/checker.py) counts each broken promise, and only those."""

from __future__ import annotations

from chaos.checker import History, check

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
