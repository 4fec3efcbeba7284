"""Backlog alarms: kept by the meta server, checked against the brokers' own reports.

An alarm watches one consumer group on one subject: it is *breached* while the group has more
than ``lag_over`` messages left there (not yet pulled, or pulled and not acknowledged), summed
over the broker groups. What is left comes from each broker master's heartbeat
(``qmq.broker.backlog``: its largest backlogs by subject and group), so the meta server asks no
broker anything. A pair missing from a master's report is 0 there when the report lists every
pair, and at most the report's smallest when it was cut to its largest: a lag known only by a
bound over ``lag_over`` changes nothing.

Each alarm is a row of ``qmq_meta_alarms`` (``qmq.meta.schema``) holding its state, so a restart
of the meta server neither forgets an alarm nor notifies a breach twice:

    ok --over--> pending --over for for_ms--> firing   (notify "breach_started")
    pending --not over--> ok                           (nothing was notified)
    firing --not over--> clearing --not over for for_ms--> ok   (notify "breach_ended")
    clearing --over--> firing                          (the breach goes on: nothing notified)

So a breach is notified once when it starts and once when it ends, however the lag wavers in
between: never a storm. Only the leading meta server checks (``MetaServer._tick``), and each
change of state is a conditional UPDATE on the state it read, so of two meta servers at most one
makes it (and notifies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from qmq.meta.operations_store import Backlog, OperationsStore
from qmq.meta.schema import alarms_table
from qmq.meta.store import MetaStore, MetaStoreError

ALARMS_MAX: Final = 1_000
LAG_OVER_MAX: Final = 1 << 62
FOR_MS_MAX: Final = 7 * 86_400_000
FOR_MS_DEFAULT: Final = 60_000

State = Literal["ok", "pending", "firing", "clearing"]
Event = Literal["breach_started", "breach_ended"]


class AlarmExistsError(MetaStoreError):
    """An alarm of that subject and group exists already."""

    retriable = False


class AlarmsFullError(MetaStoreError):
    """ALARMS_MAX alarms exist already."""

    retriable = False


@dataclass(frozen=True, slots=True)
class Alarm:
    subject: str
    group: str
    lag_over: int
    for_ms: int
    webhook: str
    secret: str
    created_at_ms: int
    state: State = "ok"
    state_since_ms: int = 0
    lag: int = -1  # at the last check; -1: never known
    checked_ms: int = 0

    def json(self) -> dict[str, object]:
        """The alarm as the API shows it (the secret as "***")."""
        return {
            "subject": self.subject,
            "group": self.group,
            "lag_over": self.lag_over,
            "for_ms": self.for_ms,
            "webhook": self.webhook,
            "secret": "***" if self.secret else "",
            "created_at_ms": self.created_at_ms,
            "state": self.state,
            "state_since_ms": self.state_since_ms,
            "lag": None if self.lag < 0 else self.lag,
            "checked_ms": self.checked_ms,
        }


@dataclass(frozen=True, slots=True)
class Notice:
    """A notification to send: the alarm as it was when its breach started or ended."""

    alarm: Alarm
    event: Event
    lag: int
    at_ms: int
    crossed_ms: int  # when the lag crossed the bound (it held since, for_ms or more)


def lag_of(subject: str, group: str, backlogs: dict[tuple[str, str], Backlog]) -> tuple[int, bool]:
    """``(lag, exact)``: what the broker masters last reported left of ``group`` on ``subject``;
    when a report cut to its largest pairs misses it, ``lag`` is the most it could be."""
    total = 0
    exact = True
    for (role, _name), backlog in backlogs.items():
        if role != "broker":
            continue
        listed = [n for s, g, n in backlog.top if s == subject and g == group]
        if listed:
            total += listed[0]
        elif backlog.pairs > len(backlog.top):
            exact = False
            total += min((n for _s, _g, n in backlog.top), default=0)
    return total, exact


def next_state(alarm: Alarm, lag: int, exact: bool, now_ms: int) -> tuple[State, Event | None]:
    """The state ``alarm`` moves to on seeing ``lag`` now, and what to notify (see the module)."""
    over = lag > alarm.lag_over
    if over and not exact:
        return alarm.state, None  # only its bound is over: nothing is known to have changed
    held_ms = now_ms - alarm.state_since_ms
    match alarm.state:
        case "ok":
            if over:
                return ("firing", "breach_started") if alarm.for_ms == 0 else ("pending", None)
        case "pending":
            if not over:
                return "ok", None
            if held_ms >= alarm.for_ms:
                return "firing", "breach_started"
        case "firing":
            if not over:
                return ("ok", "breach_ended") if alarm.for_ms == 0 else ("clearing", None)
        case "clearing":
            if over:
                return "firing", None
            if held_ms >= alarm.for_ms:
                return "ok", "breach_ended"
    return alarm.state, None


class AlarmStore:
    """Alarms in ``store``'s database; each method one short transaction (on the store thread)."""

    def __init__(self, store: MetaStore) -> None:
        self._store = store
        self._operations = OperationsStore(store)

    def add(self, alarm: Alarm) -> Alarm:
        t = alarms_table
        try:
            with self._store.transaction("add a backlog alarm") as conn:
                count = int(conn.scalar(sa.select(sa.func.count()).select_from(t)) or 0)
                if count >= ALARMS_MAX:
                    raise AlarmsFullError(
                        f"the meta server keeps at most {ALARMS_MAX} alarms and has {count}; "
                        "remove one first (qmq alarm remove)"
                    )
                conn.execute(
                    sa.insert(t).values(
                        subject=alarm.subject,
                        group_name=alarm.group,
                        lag_over=alarm.lag_over,
                        for_ms=alarm.for_ms,
                        webhook=alarm.webhook,
                        secret=alarm.secret,
                        created_at_ms=alarm.created_at_ms,
                        state="ok",
                        state_since_ms=alarm.created_at_ms,
                        lag=-1,
                        checked_ms=0,
                    )
                )
        except sa_exc.IntegrityError:
            raise AlarmExistsError(
                f"an alarm of subject {alarm.subject!r} for group {alarm.group!r} exists already; "
                "remove it first (qmq alarm remove) to change it"
            ) from None
        return alarm

    def remove(self, subject: str, group: str) -> bool:
        t = alarms_table
        with self._store.transaction("remove a backlog alarm") as conn:
            return int(conn.execute(sa.delete(t).where(t.c.subject == subject, t.c.group_name == group)).rowcount) > 0

    def rows(self) -> list[Alarm]:
        t = alarms_table
        with self._store.transaction("read the backlog alarms") as conn:
            rows = conn.execute(sa.select(t).order_by(t.c.subject, t.c.group_name).limit(ALARMS_MAX)).all()
        return [
            Alarm(
                r.subject,
                r.group_name,
                int(r.lag_over),
                int(r.for_ms),
                r.webhook,
                r.secret,
                int(r.created_at_ms),
                r.state,
                int(r.state_since_ms),
                int(r.lag),
                int(r.checked_ms),
            )
            for r in rows
        ]

    def check(self, now_ms: int) -> list[Notice]:
        """Move every alarm on by the brokers' latest reports; the notifications due."""
        alarms = self.rows()
        if not alarms:
            return []
        backlogs = self._operations.backlogs()
        notices: list[Notice] = []
        t = alarms_table
        # one transaction for every alarm: a commit (and its fsync) a tick, not one an alarm
        with self._store.transaction("check the backlog alarms") as conn:
            for alarm in alarms:
                lag, exact = lag_of(alarm.subject, alarm.group, backlogs)
                state, event = next_state(alarm, lag, exact, now_ms)
                values: dict[str, object] = {"lag": lag if exact else alarm.lag, "checked_ms": now_ms}
                if state != alarm.state:
                    values.update(state=state, state_since_ms=now_ms)
                key = (t.c.subject == alarm.subject, t.c.group_name == alarm.group, t.c.state == alarm.state)
                changed = conn.execute(sa.update(t).where(*key).values(**values)).rowcount
                if event is not None and changed:
                    crossed_ms = alarm.state_since_ms if alarm.state in ("pending", "clearing") else now_ms
                    notices.append(Notice(alarm, event, lag, now_ms, crossed_ms))
        return notices
