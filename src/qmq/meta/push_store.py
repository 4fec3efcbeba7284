"""HTTP push subscriptions in the meta store, and the leases that let exactly one gateway run each.

A subscription is one row of ``qmq_meta_push`` (drawn in ``qmq.meta.schema``), so it survives a
restart of the meta server and is shared by meta servers using one database. Its lease lives
in the same row: ``owner`` and ``lease_expires_ms``. A gateway calls ``lease`` every third of
the lease time; one call renews the rows it holds (``owner = me``) and takes free ones with
the conditional UPDATE ``... WHERE key AND (owner = '' OR lease_expires_ms < now)``, so of two
gateways racing for a row exactly one matches. ``lease_generation`` rises each time a row
changes hands, so a gateway can tell "renewed" from "lost and taken back".

Subscriptions are shared out: every gateway that asked within its lease time counts (table
``qmq_meta_push_gateways``), and none holds more than its share: ``ceil(subscriptions /
gateways)``, or more where some gateways run fewer (their ``held_max``) so that together they
can run them all (``fair_share``). A gateway holding more (another gateway just started) gives the excess up at its
next ask, and the others take it at theirs; when a gateway dies, its share is taken once its
leases and its row run out.

A lease is measured by clocks, so it cannot stop a gateway that froze past its expiry from
delivering once more; the gateway stops its runners when its own copy of the lease runs out
(measured from before it asked), and what two gateways could both deliver in that instant is
what any at-least-once consumer may see twice: receivers deduplicate on X-Qmq-Message-Id.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from qmq.meta.schema import OWNER_CHARS, URL_CHARS, push_gateways_table, push_table
from qmq.meta.store import MetaStore, MetaStoreError
from qmq.protocol.push import PushSubscription

# Subscriptions the meta server keeps; an add past this is refused (each one is a consumer
# and a connection pool in some gateway).
PUSH_SUBSCRIPTIONS_MAX: Final = 10_000
# A gateway that has not asked for this many of its leases is forgotten (its row deleted).
_GATEWAY_FORGET_LEASES: Final = 10


def fair_share(capacities: list[int], total: int) -> int:
    """The smallest share ``s`` such that gateways running ``min(capacity, s)`` each run all
    ``total`` subscriptions; the largest capacity when even that is not enough."""
    remaining, left = total, len(capacities)
    for capacity in sorted(capacities):
        level = math.ceil(remaining / left)
        if capacity >= level:
            return level
        remaining -= capacity
        left -= 1
    return max(capacities, default=total)


class PushExistsError(MetaStoreError):
    """A subscription of that subject and group exists already."""

    retriable = False


class PushFullError(MetaStoreError):
    """PUSH_SUBSCRIPTIONS_MAX subscriptions exist already."""

    retriable = False


@dataclass(frozen=True, slots=True)
class PushRow:
    """A stored subscription with its lease as last written."""

    subscription: PushSubscription
    owner: str
    owner_url: str
    lease_expires_ms: int
    lease_generation: int


class PushStore:
    """Push subscriptions and their leases in ``store``'s database; each method one short transaction."""

    def __init__(self, store: MetaStore) -> None:
        self._store = store

    def add(self, sub: PushSubscription) -> PushSubscription:
        """Store ``sub`` (created_at_ms as given); PushExistsError when its (subject, group) is taken."""
        t = push_table
        try:
            with self._store.transaction("add a push subscription") as conn:
                count = int(conn.scalar(sa.select(sa.func.count()).select_from(t)) or 0)
                if count >= PUSH_SUBSCRIPTIONS_MAX:
                    raise PushFullError(
                        f"the meta server keeps at most {PUSH_SUBSCRIPTIONS_MAX} push subscriptions and has "
                        f"{count}; remove one first (qmq push remove)"
                    )
                conn.execute(sa.insert(t).values(_values(sub)))
        except sa_exc.IntegrityError:
            raise PushExistsError(
                f"a push subscription of subject {sub.subject!r} for group {sub.group!r} exists already; "
                "remove it first (qmq push remove) to change it"
            ) from None
        return sub

    def remove(self, subject: str, group: str) -> bool:
        """Delete the subscription; whether there was one. Its gateway stops it at its next renewal."""
        t = push_table
        with self._store.transaction("remove a push subscription") as conn:
            return int(conn.execute(sa.delete(t).where(t.c.subject == subject, t.c.group_name == group)).rowcount) > 0

    def rows(self) -> list[PushRow]:
        """Every subscription with its lease, by subject and group."""
        t = push_table
        with self._store.transaction("read the push subscriptions") as conn:
            rows = conn.execute(sa.select(t).order_by(t.c.subject, t.c.group_name).limit(PUSH_SUBSCRIPTIONS_MAX)).all()
        return [_row(r) for r in rows]

    def lease(self, owner: str, owner_url: str, now_ms: int, lease_ms: int, held_max: int) -> list[PushRow]:
        """Renew ``owner``'s leases, give up what is past its share, take free or expired ones up to
        its share (and ``held_max``), each until ``now_ms + lease_ms``; the rows ``owner`` holds now."""
        t = push_table
        owner, owner_url = owner[:OWNER_CHARS], owner_url[:URL_CHARS]
        until = now_ms + lease_ms
        mine = t.c.owner == owner
        share = min(held_max, self._share(owner, owner_url, now_ms, lease_ms, held_max))
        with self._store.transaction("renew push leases") as conn:
            conn.execute(sa.update(t).where(mine).values(lease_expires_ms=until, owner_url=owner_url))
            held = int(conn.scalar(sa.select(sa.func.count()).select_from(t).where(mine)) or 0)
            if held > share:
                excess = conn.execute(
                    sa.select(t.c.subject, t.c.group_name)
                    .where(mine)
                    .order_by(t.c.subject.desc(), t.c.group_name.desc())
                    .limit(held - share)
                ).all()
                for subject, group in excess:
                    conn.execute(
                        sa.update(t)
                        .where(t.c.subject == subject, t.c.group_name == group, mine)
                        .values(owner="", lease_expires_ms=0)
                    )
                held = share
            free = (t.c.owner == "") | (t.c.lease_expires_ms < now_ms)
            candidates = (
                conn.execute(
                    sa.select(t.c.subject, t.c.group_name)
                    .where(free, ~mine)
                    .order_by(t.c.lease_expires_ms, t.c.subject, t.c.group_name)
                    .limit(share - held)
                ).all()
                if held < share
                else []
            )
        for subject, group in candidates:
            # One transaction per row: a row another gateway took meanwhile no longer matches.
            with self._store.transaction("take a push lease") as conn:
                conn.execute(
                    sa.update(t)
                    .where(t.c.subject == subject, t.c.group_name == group, free)
                    .values(
                        owner=owner,
                        owner_url=owner_url,
                        lease_expires_ms=until,
                        lease_generation=t.c.lease_generation + 1,
                    )
                )
        with self._store.transaction("read push leases") as conn:
            rows = conn.execute(sa.select(t).where(mine).order_by(t.c.subject, t.c.group_name)).all()
        return [_row(r) for r in rows]

    def _share(self, owner: str, owner_url: str, now_ms: int, lease_ms: int, held_max: int) -> int:
        """Note that ``owner`` asked now; its share of the subscriptions among the gateways asking
        within ``lease_ms`` (``fair_share``).

        Short transactions, each row by its key: on MariaDB a range DELETE or an UPDATE matching
        nothing takes gap locks, and INSERTs of other gateways beside them deadlock."""
        g = push_gateways_table
        for attempt in range(2):
            # UPDATE and INSERT in transactions of their own: on MariaDB an UPDATE that matches no
            # row takes a gap lock, and two such followed by INSERTs in one transaction deadlock.
            with self._store.transaction("note a push gateway") as conn:
                if conn.execute(
                    sa.update(g).where(g.c.owner == owner).values(url=owner_url, last_seen_ms=now_ms, held_max=held_max)
                ).rowcount:
                    break
            try:
                with self._store.transaction("note a new push gateway") as conn:
                    conn.execute(
                        sa.insert(g).values(owner=owner, url=owner_url, last_seen_ms=now_ms, held_max=held_max)
                    )
                break
            except sa_exc.IntegrityError:
                if attempt:  # inserted meanwhile by the same gateway asking through another meta server
                    raise MetaStoreError(f"cannot note push gateway {owner!r}: its row keeps changing") from None
        forget_before_ms = now_ms - _GATEWAY_FORGET_LEASES * lease_ms
        with self._store.transaction("count push gateways") as conn:
            silent = list(conn.scalars(sa.select(g.c.owner).where(g.c.last_seen_ms < forget_before_ms).limit(100)))
            live = g.c.last_seen_ms >= now_ms - lease_ms
            capacities = [int(c) for c in conn.scalars(sa.select(g.c.held_max).where(live))]
            total = int(conn.scalar(sa.select(sa.func.count()).select_from(push_table)) or 0)
        for gone in silent:
            with self._store.transaction("forget a push gateway") as conn:
                conn.execute(sa.delete(g).where(g.c.owner == gone, g.c.last_seen_ms < forget_before_ms))
        return fair_share(capacities or [held_max], total)

    def release(self, owner: str) -> int:
        """End every lease of ``owner`` now, so another gateway takes over at once; how many."""
        t, g = push_table, push_gateways_table
        with self._store.transaction("give up push leases") as conn:
            conn.execute(sa.delete(g).where(g.c.owner == owner[:OWNER_CHARS]))
            return int(
                conn.execute(
                    sa.update(t).where(t.c.owner == owner[:OWNER_CHARS]).values(owner="", lease_expires_ms=0)
                ).rowcount
            )


def _values(sub: PushSubscription) -> dict[str, object]:
    return {
        "subject": sub.subject,
        "group_name": sub.group,
        "url": sub.url,
        "concurrency": sub.concurrency,
        "rate_per_s": sub.rate_per_s,
        "timeout_ms": sub.timeout_ms,
        "secret": sub.secret,
        "tags": json.dumps(list(sub.tags)),
        "tag_type": sub.tag_type,
        "start_from": sub.start_from,
        "max_retries": sub.max_retries,
        "retry_backoff_ms": json.dumps(list(sub.retry_backoff_ms)),
        "created_at_ms": sub.created_at_ms,
    }


def _row(r: sa.Row[Any]) -> PushRow:
    sub = PushSubscription(
        subject=r.subject,
        group=r.group_name,
        url=r.url,
        concurrency=int(r.concurrency),
        rate_per_s=int(r.rate_per_s),
        timeout_ms=int(r.timeout_ms),
        secret=r.secret,
        tags=tuple(json.loads(r.tags)),
        tag_type=r.tag_type,
        start_from=r.start_from,
        max_retries=int(r.max_retries),
        retry_backoff_ms=tuple(int(ms) for ms in json.loads(r.retry_backoff_ms)),
        created_at_ms=int(r.created_at_ms),
    )
    return PushRow(sub, r.owner, r.owner_url, int(r.lease_expires_ms), int(r.lease_generation))
