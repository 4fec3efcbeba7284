"""The producer's routing step alone: delay groups or brokers by due time, messages held while
a subject's route is looked up, and the cached routes dropped when the meta server's answer
changes. A fake meta client and a fake sender stand on either side of a real send buffer."""

from __future__ import annotations

import asyncio
import time

import pytest

from qmq import SendError
from qmq.client.accumulator import Accumulator, Entry, RouteKey
from qmq.client.message import Message
from qmq.client.routing import Router, pick_group
from qmq.common.limits import HOLD_UNTIL_DUE_MS

_URL = "http://meta.example:8080/meta/address"


class _Meta:
    def __init__(self) -> None:
        self.url = _URL
        self.routes: dict[str, RouteKey] = {}  # the groups of each route that take sends now
        self.full_routes: dict[str, RouteKey] = {}  # every group of the route, when it differs
        self.unknown: set[str] = set()  # subjects whose route could not be looked up (routes: every group)
        self.delay_groups: RouteKey = ()
        self.refreshes_asked = 0
        self.lookups: dict[str, asyncio.Future[RouteKey]] = {}

    def route(self, subject: str) -> RouteKey | None:
        return self.full_routes.get(subject) or self.routes.get(subject)

    def routed(self, subject: str) -> RouteKey | None:
        return None if subject in self.unknown else self.route(subject)

    def send_route(self, subject: str) -> RouteKey | None:
        return self.routes.get(subject)

    def delay_route(self) -> RouteKey:
        return self.delay_groups

    def targets(self) -> list[str]:
        return sorted({g for key in self.routes.values() for g in key} | set(self.delay_groups))

    async def resolve(self, subject: str) -> RouteKey:
        if subject in self.routes:
            return self.routes[subject]
        fut = self.lookups.setdefault(subject, asyncio.get_running_loop().create_future())
        key = await fut
        self.routes[subject] = key
        return key

    def refresh_soon(self) -> None:
        self.refreshes_asked += 1


class _Sender:
    def __init__(self, acc: Accumulator) -> None:
        self.acc = acc
        self.woken: list[RouteKey] = []
        self.reconciled = 0
        self.failed: list[tuple[Entry, str]] = []

    def submit(self, key: RouteKey, entry: Entry) -> None:
        if self.acc.append(key, entry):
            self.wake(key)

    def wake(self, key: RouteKey) -> None:
        self.woken.append(key)

    def reconcile(self) -> None:
        self.reconciled += 1

    def fail(self, entries: list[Entry], reason: str, *, retriable: bool) -> None:
        for e in entries:
            e[1].set_exception(SendError(reason, e[2], retriable=retriable))
            self.failed.append((e, reason))


def _parts() -> tuple[Router, _Meta, Accumulator, _Sender]:
    meta = _Meta()
    acc = Accumulator(messages_max=100, bytes_max=1 << 20)
    sender = _Sender(acc)
    return Router(meta, acc, sender), meta, acc, sender


def _entry(mid: str) -> Entry:
    return (b"x" * 10, asyncio.get_running_loop().create_future(), mid, 0.0, 0, False)


def _message_entry(key: str | None, resend: bool = False) -> Entry:
    """A real encoded message of subject "s", with order key ``key`` (None: without one)."""
    m = Message("s", body="x")
    if key is not None:
        m.set_order_key(key)
    return (m.encode(), asyncio.get_running_loop().create_future(), m.message_id, 0.0, 0, resend)


def _picking(group: str, route: RouteKey, resend: bool) -> Entry:
    """An entry of a real message to "s" whose id picks ``group`` of ``route``."""
    for _ in range(1_000):
        entry = _message_entry(None, resend)
        if pick_group(route, entry[2]) == group:
            return entry
    raise AssertionError(f"no message id picked {group} of {route} in 1,000 tries")


def _queued(acc: Accumulator, group: str) -> list[str]:
    batch = acc.drain(group, 100, 1 << 20)
    return [] if batch is None else [e[2] for e in batch[1]]


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


async def test_a_message_due_later_goes_to_the_delay_groups_one_due_soon_to_the_brokers() -> None:
    router, meta, acc, _ = _parts()
    meta.routes["s"] = ("b1",)
    meta.delay_groups = ("%delay%d1",)
    router.enqueue("s", _now_ms() + 60_000, _entry("later"))
    router.enqueue("s", _now_ms() + HOLD_UNTIL_DUE_MS // 2, _entry("soon"))
    router.enqueue("s", 0, _entry("now"))
    assert _queued(acc, "%delay%d1") == ["later"]
    assert _queued(acc, "b1") == ["soon", "now"]


async def test_without_a_delay_group_a_message_due_later_fails_at_once() -> None:
    router, meta, acc, sender = _parts()
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    router.enqueue("s", _now_ms() + 60_000, (b"x", fut, "m1", 0.0, 0, False))
    with pytest.raises(SendError, match=f"no delay server is registered with the meta server {_URL}") as info:
        await fut
    assert info.value.message_id == "m1"
    assert info.value.retriable
    assert acc.count == 0  # never buffered
    assert meta.refreshes_asked == 1  # a delay server may have registered since the last answer
    assert len(sender.failed) == 1


async def test_a_new_subject_is_held_while_looked_up_once_then_queued_before_later_sends() -> None:
    router, meta, acc, sender = _parts()
    router.enqueue("s", 0, _entry("m1"))
    router.enqueue("s", 0, _entry("m2"))
    await asyncio.sleep(0)  # the lookup task starts
    assert list(meta.lookups) == ["s"]  # one lookup for both
    assert acc.count == 2
    assert _queued(acc, "b1") == []  # held, in no route's queue
    meta.lookups["s"].set_result(("b1",))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sender.woken == [("b1",)]
    router.enqueue("s", 0, _entry("m3"))
    assert _queued(acc, "b1") == ["m1", "m2", "m3"]
    await router.close()


async def test_held_messages_go_first_when_a_send_finds_the_route_before_the_lookup_task_ran() -> None:
    router, meta, acc, _ = _parts()
    router.enqueue("s", 0, _entry("m1"))
    meta.routes["s"] = ("b1",)  # known, but the task that queues m1 has not run
    router.enqueue("s", 0, _entry("m2"))
    assert _queued(acc, "b1") == ["m1", "m2"]
    await router.close()


async def test_a_subject_without_any_broker_group_waits_for_a_meta_change() -> None:
    router, meta, acc, sender = _parts()
    meta.routes["s"] = ()  # asked for, but no broker group is available
    router.enqueue("s", 0, _entry("m1"))
    await asyncio.sleep(0)
    assert meta.lookups == {}  # nothing more to ask
    assert acc.count == 1
    meta.routes["s"] = ("b2",)
    router.on_meta_change()
    assert sender.reconciled == 1
    assert _queued(acc, "b2") == ["m1"]


async def test_a_meta_change_drops_the_cached_routes() -> None:
    router, meta, acc, _ = _parts()
    meta.routes["s"] = ("b1",)
    meta.delay_groups = ("%delay%d1",)
    router.enqueue("s", 0, _entry("m1"))
    router.enqueue("s", _now_ms() + 60_000, _entry("d1"))
    meta.routes["s"] = ("b2",)
    meta.delay_groups = ("%delay%d2",)
    router.enqueue("s", 0, _entry("m2"))  # cached until the meta client says the answer changed
    router.enqueue("s", _now_ms() + 60_000, _entry("d2"))
    router.on_meta_change()
    router.enqueue("s", 0, _entry("m3"))
    router.enqueue("s", _now_ms() + 60_000, _entry("d3"))
    assert _queued(acc, "b1") == ["m1", "m2"]
    assert _queued(acc, "b2") == ["m3"]
    assert _queued(acc, "%delay%d1") == ["d1", "d2"]
    assert _queued(acc, "%delay%d2") == ["d3"]


async def test_resolve_caches_the_route_for_the_sends() -> None:
    router, meta, acc, _ = _parts()
    meta.routes["s"] = ("b1",)
    assert await router.resolve("s") == ("b1",)
    meta.routes["s"] = ("b2",)
    router.enqueue("s", 0, _entry("m1"))
    assert _queued(acc, "b1") == ["m1"]


async def test_close_stops_the_lookups_and_leaves_the_held_messages() -> None:
    router, meta, acc, _ = _parts()
    router.enqueue("s", 0, _entry("m1"))
    await asyncio.sleep(0)
    await router.close()
    assert meta.lookups["s"].cancelled()
    assert len(acc.take_all()) == 1


async def test_a_frame_with_an_ordered_message_never_fails_over_to_another_group() -> None:
    # a strict key's messages wait for their slot's group (a master killed, its slave promoted):
    # stored by another group, the key's later messages were consumed before its earlier ones
    router, meta, _, _ = _parts()
    meta.routes["s"] = ("b1", "b2")
    plain = [_message_entry(None) for _ in range(3)]
    assert router.widen("b1", plain) == ("b1", "b2")
    assert router.widen("b1", [*plain, _message_entry("order-7")]) == ("b1",)
    assert router.widen("b1", [_message_entry("order-7")]) == ("b1",)


async def test_ordered_messages_queued_for_a_group_gone_stay_queued_for_it() -> None:
    router, meta, acc, sender = _parts()
    meta.routes["s"] = ("b1", "b2")
    for _ in range(40):  # some message ids pick b1: queued there alone
        router.enqueue("s", 0, _message_entry(None))
    ordered = _message_entry("order-7")
    sender.submit(("b1",), ordered)  # as client/ordering.py queues a key's message for its slot's group
    meta.routes["s"] = ("b2",)  # b1's master killed: the meta server leaves it out until its slave is promoted
    router.on_meta_change()
    assert _queued(acc, "b1") == [ordered[2]]  # waits for b1
    on_b2 = _queued(acc, "b2")
    assert len(on_b2) == 40  # the plain ones, b1's among them, went to b2
    assert ordered[2] not in on_b2


async def test_a_resend_waits_for_the_group_its_id_picks_while_a_plain_send_goes_to_the_others() -> None:
    # an outbox row (resend=True): b1, the group its id picks, takes no sends now (its master cut
    # off); it may have stored the row's first send, so the row waits for it instead of b2
    router, meta, acc, _ = _parts()
    meta.full_routes["s"] = ("b1", "b2")
    meta.routes["s"] = ("b2",)
    resend = _picking("b1", ("b1", "b2"), resend=True)
    plain = _picking("b1", ("b1", "b2"), resend=False)
    router.enqueue("s", 0, resend)
    router.enqueue("s", 0, plain)
    assert _queued(acc, "b1") == [resend[2]]
    assert _queued(acc, "b2") == [plain[2]]


async def test_a_frame_with_a_resend_never_fails_over_and_a_resend_queued_for_a_group_gone_stays() -> None:
    router, meta, acc, _ = _parts()
    meta.routes["s"] = ("b1", "b2")
    plain = [_picking("b1", ("b1", "b2"), resend=False) for _ in range(3)]
    resend = _picking("b1", ("b1", "b2"), resend=True)
    assert router.widen("b1", plain) == ("b1", "b2")
    assert router.widen("b1", [*plain, resend]) == ("b1",)
    for e in [*plain, resend]:
        router.enqueue("s", 0, e)
    meta.full_routes["s"] = ("b1", "b2")
    meta.routes["s"] = ("b2",)  # b1 takes no sends now
    router.on_meta_change()
    assert _queued(acc, "b1") == [resend[2]]  # waits for b1
    assert sorted(_queued(acc, "b2")) == sorted(e[2] for e in plain)  # the plain ones went to b2


async def test_a_resend_whose_route_could_not_be_looked_up_is_held_until_it_is_known() -> None:
    # a delay server cut off from the meta server: its subject's route is "every available group"
    # (b1, b2, b3) for now; picked among them, a hand-over could go to another group than the one
    # its id picks in the real route (b1, b2), where the promoted delay slave sends its copy
    router, meta, acc, _ = _parts()
    meta.routes["s"] = ("b1", "b2", "b3")
    meta.unknown.add("s")
    resend = _picking("b3", ("b1", "b2", "b3"), resend=True)
    plain = _picking("b3", ("b1", "b2", "b3"), resend=False)
    router.enqueue("s", 0, resend)
    router.enqueue("s", 0, plain)
    assert _queued(acc, "b3") == [plain[2]]  # a first send may go anywhere
    assert acc.holds("s")
    assert meta.refreshes_asked == 1
    router.on_meta_change()  # a refresh that still could not ask for the route
    assert acc.holds("s")
    meta.unknown.clear()
    meta.routes["s"] = ("b1", "b2")
    router.on_meta_change()
    assert not acc.holds("s")
    picked = pick_group(("b1", "b2"), resend[2])
    assert resend[2] in _queued(acc, picked)


async def test_a_strict_producer_holds_every_message_of_a_subject_whose_route_is_unknown() -> None:
    meta = _Meta()
    acc = Accumulator(messages_max=100, bytes_max=1 << 20)
    router = Router(meta, acc, _Sender(acc), strict=True)
    meta.routes["s"] = ("b1", "b2")
    meta.unknown.add("s")
    entries = [_entry(f"m{i}") for i in range(10)]
    for e in entries:
        router.enqueue("s", 0, e)
    assert acc.holds("s")
    assert not _queued(acc, "b1")
    assert not _queued(acc, "b2")
    meta.unknown.clear()
    meta.full_routes["s"] = ("b1", "b2", "b3")
    router.on_meta_change()
    queued = {g: _queued(acc, g) for g in ("b1", "b2", "b3")}
    assert queued == {g: [e[2] for e in entries if pick_group(("b1", "b2", "b3"), e[2]) == g] for g in queued}
