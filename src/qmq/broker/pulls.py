"""Long polls: pulls that found nothing wait here until their subject gets new messages.

A parked pull is retried when a flush makes messages of its subject visible, and answered
empty when its timeout passes or its connection goes. A PULL_MANY that found nothing waits
the same way on each of its subjects at once (``ParkedMany``): the first of them to get
messages makes it pull them all again. No task per pull: a timer handle and
an entry in a per-subject list. A retry that fails (a read error) answers that pull with the
error; the others, and the flush that woke them, go on.

A pull of an ordered group may hand messages to other consumers of the group (the owners of
their slots, ``store/ordered_take.py``): their parked pulls are then tried again, at most
``_ORDERED_PASSES_MAX`` rounds a notification.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from qmq.store.broker_store import BrokerStore, PullResult
from qmq.store.group_filter import GroupFilter
from qmq.store.progress import ConsumerProgress, GroupProgress
from qmq.store.tags import RecordFilter

_ORDERED_PASSES_MAX = 3


class PullAnswer(Protocol):
    def __call__(self, result: PullResult | None) -> None: ...


class ParkedPull:
    __slots__ = ("answer", "cp", "fail", "gp", "max_n", "owner", "session", "tag_filter", "timer")

    def __init__(
        self,
        owner: object,
        gp: GroupProgress,
        cp: ConsumerProgress,
        session: str,
        max_n: int,
        tag_filter: RecordFilter | None,
        answer: PullAnswer,
        fail: Callable[[Exception], None],
    ) -> None:
        """``fail`` answers the pull with what a retry of it raised."""
        self.owner = owner
        self.gp = gp
        self.cp = cp
        self.session = session
        self.max_n = max_n
        self.tag_filter = tag_filter
        self.answer = answer
        self.fail = fail
        self.timer: asyncio.TimerHandle | None = None


class ParkedMany:
    """A PULL_MANY (broker/pull_many.py) that found nothing: waits on each of its ``subjects``.
    ``retry()`` makes its pulls again and answers it if they handed out something (True);
    ``answer_empty()`` answers it with nothing; ``fail`` with what a retry raised."""

    __slots__ = ("answer_empty", "fail", "owner", "retry", "subjects", "timer")

    def __init__(
        self,
        owner: object,
        subjects: frozenset[str],
        retry: Callable[[], bool],
        answer_empty: Callable[[], None],
        fail: Callable[[Exception], None],
    ) -> None:
        self.owner = owner
        self.subjects = subjects
        self.retry = retry
        self.answer_empty = answer_empty
        self.fail = fail
        self.timer: asyncio.TimerHandle | None = None


class ParkedPulls:
    def __init__(self, store: BrokerStore, on_count: Callable[[int], None]) -> None:
        self.store = store
        self.on_count = on_count
        self._by_subject: dict[str, list[ParkedPull]] = {}
        # parked PULL_MANYs by each subject they wait on (one object under several subjects)
        self._many_by_subject: dict[str, list[ParkedMany]] = {}
        self._count = 0
        # (subject, group) whose consumers get nothing for now (qmq.broker.controls)
        self.paused: frozenset[tuple[str, str]] = frozenset()
        self.filters: dict[tuple[str, str], GroupFilter] = {}  # qmq.broker.controls
        self._at_flush: set[str] = set()  # subjects whose long polls are tried when the next flush begins

    def park(self, parked: ParkedPull, timeout_ms: int) -> None:
        self._by_subject.setdefault(parked.gp.subject, []).append(parked)
        parked.cp.parked += 1
        parked.timer = asyncio.get_running_loop().call_later(timeout_ms / 1000, self._expire, parked)
        self._count += 1
        self.on_count(self._count)

    def _remove(self, parked: ParkedPull) -> None:
        lst = self._by_subject.get(parked.gp.subject)
        if lst is not None and parked in lst:
            lst.remove(parked)
            parked.cp.parked -= 1
            if not lst:
                del self._by_subject[parked.gp.subject]
            self._count -= 1
            self.on_count(self._count)
        if parked.timer is not None:
            parked.timer.cancel()
            parked.timer = None

    def _expire(self, parked: ParkedPull) -> None:
        parked.timer = None
        self._remove(parked)
        parked.answer(None)

    def park_many(self, parked: ParkedMany, timeout_ms: int) -> None:
        for subject in parked.subjects:
            self._many_by_subject.setdefault(subject, []).append(parked)
        parked.timer = asyncio.get_running_loop().call_later(timeout_ms / 1000, self._expire_many, parked)
        self._count += 1
        self.on_count(self._count)

    def _remove_many(self, parked: ParkedMany) -> bool:
        """Forget ``parked`` (False if it was not parked any more)."""
        if parked.timer is None:
            return False
        parked.timer.cancel()
        parked.timer = None
        for subject in parked.subjects:
            lst = self._many_by_subject.get(subject)
            if lst is not None and parked in lst:
                lst.remove(parked)
                if not lst:
                    del self._many_by_subject[subject]
        self._count -= 1
        self.on_count(self._count)
        return True

    def _expire_many(self, parked: ParkedMany) -> None:
        if self._remove_many(parked):
            parked.answer_empty()

    def _pass_many(self, subject: str) -> None:
        lst = self._many_by_subject.get(subject)
        if not lst:
            return
        for parked in list(lst):
            if parked.timer is None:
                continue  # answered by an earlier subject of this notification
            try:
                answered = parked.retry()
            except Exception as exc:  # fails this PULL_MANY only
                self._remove_many(parked)
                parked.fail(exc)
                continue
            if answered:
                self._remove_many(parked)

    def notify(self, subjects: set[str]) -> None:
        """New messages became visible on ``subjects``: answer the parked pulls that can now get some."""
        for subject in subjects:
            for _ in range(_ORDERED_PASSES_MAX):
                if not self._pass(subject):
                    break
            if self._many_by_subject:
                self._pass_many(subject)

    def notify_at_flush(self, subjects: set[str]) -> None:
        """Messages of ``subjects`` were written and wait for the group commit's next flush: the
        long polls of those subjects take them when that flush begins (``take_flush_wakes``),
        since a pull's answer waits for the flush covering what it hands out anyway (store/take.py)
        and the sends made until then are taken by the same pull."""
        if self._by_subject or self._many_by_subject:
            self._at_flush.update(subjects)

    def take_flush_wakes(self) -> None:
        """A flush begins: try the long polls ``notify_at_flush`` named since the last one."""
        if self._at_flush:
            subjects, self._at_flush = self._at_flush, set()
            self.notify(subjects)

    def notify_soon(self, subject: str) -> None:
        """A pull handed messages to other consumers of an ordered group: try their parked pulls."""
        if subject in self._by_subject or subject in self._many_by_subject:
            asyncio.get_running_loop().call_soon(self.notify, {subject})

    def notify_later(self, subject: str, delay_ms: int) -> None:
        """Try the parked pulls of ``subject`` in ``delay_ms`` (an ordered group starts placing slots)."""
        asyncio.get_running_loop().call_later(delay_ms / 1000, self.notify, {subject})

    def _pass(self, subject: str) -> bool:
        """Try the parked pulls of ``subject`` once; True if one handed messages to other consumers."""
        lst = self._by_subject.get(subject)
        if not lst:
            return False
        dispatched = False
        settling_ms = 0
        for parked in list(lst):
            if self.paused and (parked.gp.subject, parked.gp.group) in self.paused:
                continue
            try:
                result = self.store.pull(parked.gp, parked.cp, parked.session, parked.max_n, parked.tag_filter)
            except Exception as exc:  # fails this pull only, as a handler's failure would
                self._remove(parked)
                parked.fail(exc)
                continue
            dispatched = dispatched or self.store.dispatched
            settling_ms = max(settling_ms, self.store.settling_ms)
            if result is not None or self.store.scan_cut:  # cut short: the consumer pulls again at once
                self._remove(parked)
                parked.answer(result)
        if settling_ms:
            self.notify_later(subject, settling_ms)  # still settling (a consumer joined meanwhile)
        return dispatched

    def answer_empty(self, cp: ConsumerProgress) -> None:
        """Answer the parked pulls of ``cp`` empty now (it leaves its ordered group)."""
        for lst in list(self._by_subject.values()):
            for parked in [p for p in lst if p.cp is cp]:
                self._remove(parked)
                parked.answer(None)

    def drop_owner(self, owner: object) -> None:
        """The connection went: forget its parked pulls without answering."""
        for lst in list(self._by_subject.values()):
            for parked in [p for p in lst if p.owner is owner]:
                self._remove(parked)
        for many in {id(m): m for lst in self._many_by_subject.values() for m in lst if m.owner is owner}.values():
            self._remove_many(many)

    def answer_all_empty(self) -> None:
        for lst in list(self._by_subject.values()):
            for parked in list(lst):
                self._remove(parked)
                parked.answer(None)
        for many in {id(m): m for lst in self._many_by_subject.values() for m in lst}.values():
            if self._remove_many(many):
                many.answer_empty()
