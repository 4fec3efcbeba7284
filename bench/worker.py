"""One worker process: one role of one system in one cell.

Roles: `setup` (fresh destinations, or why delay cannot be measured), `prepare` (several
cells' destinations and untimed backlogs), `producer` and `consumer` (which may set their
cell up first), `grow` (W10: subjects made and sent their first message chunk by chunk, until
all or the deadline; where and why it stopped is its result). Run by the driver as
`python -m bench.worker SPEC_JSON`. It connects
(bounded retries), prints `READY` on stdout, waits for `GO` on stdin when the spec asks it
to, runs, and prints its result, one JSON line. A spec with `rounds` repeats that for each
round in one process (W6's consumer pool). Progress goes to stderr."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import sys
import time
from typing import Any

from bench.adapters import make_adapter
from bench.adapters.base import Adapter
from bench.consumers import consume
from bench.producers import produce_bulk, produce_delayed, produce_paced, warm_up_delayed
from bench.settings import PAYLOAD_BYTES, Settings
from bench.tally import Tally

CONNECT_ATTEMPTS_MAX = 20
CONNECT_RETRY_S = 0.5
GO_WAIT_S = 120.0
CLOSE_LIMIT_S = 5.0


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


async def connect(adapter: Adapter) -> None:
    for attempt in range(CONNECT_ATTEMPTS_MAX):
        try:
            await adapter.connect()
            return
        except Exception as exc:
            if attempt == CONNECT_ATTEMPTS_MAX - 1:
                raise
            log(f"connect attempt {attempt + 1} failed: {exc!r}; retrying")
            await asyncio.sleep(CONNECT_RETRY_S)


async def wait_go(limit_s: float) -> None:
    line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline), limit_s)
    if line.strip() != "GO":
        raise RuntimeError(f"expected GO from the driver, got {line!r}")


async def setup(adapter: Adapter, spec: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Fresh destinations for the cell (or why delayed delivery cannot be measured)."""
    delayed = spec.get("delayed", False)
    if delayed:
        reason = await adapter.delay_unsupported()
        if reason is not None:
            return {"skipped": reason}
    started = time.monotonic()
    await adapter.setup(
        spec["family"], spec["subjects"], delayed=delayed, members=spec.get("members", 1),
        prefetch=spec.get("prefetch", settings.prefetch_messages),
    )
    return {"setup_s": round(time.monotonic() - started, 3)}


async def run_role(adapter: Adapter, spec: dict[str, Any], settings: Settings) -> dict[str, Any]:
    role = spec["role"]
    family: str = spec["family"]
    # W10's 40,000 names would not fit in one argument: they are made here from a count
    subjects: list[str] = spec["subjects"] or many_subject_names(family, spec.get("subject_count", 0))
    deadline = time.monotonic() + spec["limit_s"]
    if role == "setup":
        return await setup(adapter, spec, settings)
    if role == "grow":
        return await grow(adapter, spec, settings, subjects, deadline)
    if role in ("producer", "consumer") and spec.get("setup"):
        # A producer or consumer that sets its cell up first saves the driver a process.
        prepared = await setup(adapter, spec, settings)
        if "skipped" in prepared:
            print("READY", flush=True)
            return prepared
        return {**prepared, **await run_role(adapter, {**spec, "setup": False}, settings)}
    if role == "prepare":
        # Several cells' destinations and backlogs in one process: saves a spawn per cell.
        filled = []
        for item in spec["cells"]:
            await adapter.setup(
                item["family"], item["subjects"], delayed=False, members=item["members"], prefetch=item["prefetch"]
            )
            await adapter.prepare_producer()
            result = await produce_bulk(
                adapter, item["subjects"], item["messages"], settings.batch_messages, settings.window_messages,
                deadline,
            )
            filled.append({"family": item["family"], "msgs_per_s": result["msgs_per_s"]})
        return {"filled": filled}
    if role == "producer":
        await adapter.prepare_producer()
        if spec["kind"] == "delayed" and not spec.get("first_due_epoch_s"):
            # W4 measures the server's memory per pending message from here: connections,
            # buffers and code paths a first delayed send sets up are not per message.
            await warm_up_delayed(adapter, subjects[0], settings.batch_messages, deadline)
        print("READY", flush=True)
        if spec.get("wait_go"):
            await wait_go(spec.get("go_wait_s", GO_WAIT_S))
            deadline = time.monotonic() + spec["limit_s"]
        kind = spec["kind"]
        batch, window = spec.get("batch", settings.batch_messages), spec.get("window", settings.window_messages)
        if kind == "bulk":
            return await produce_bulk(
                adapter, subjects, spec["messages"], batch, window, deadline, spec.get("body_bytes", PAYLOAD_BYTES)
            )
        if kind == "paced":
            return await produce_paced(
                adapter, subjects[0], spec["rate_per_s"], spec["duration_s"], batch, window, deadline
            )
        if kind == "delayed":
            return await produce_delayed(
                adapter, subjects[0], spec["messages"], spec.get("first_due_epoch_s"), spec["spread_s"],
                batch, window, deadline,
            )
        raise ValueError(f"unknown producer kind {kind!r}")
    if role == "consumer":
        members = spec.get("members", 1)
        tally = Tally(spec["messages"], members, spec.get("index", 0), spec.get("tally_path"))
        subscribe_first = not spec.get("subscribe_after_go", False)
        start = {
            "consumer_index": spec.get("index", 0),
            "members": members,
            "prefetch": spec.get("prefetch", settings.prefetch_messages),
            "delayed": spec.get("delayed", False),
        }
        if subscribe_first:
            await adapter.start_consumer(family, subjects, **start)
        print("READY", flush=True)
        if spec.get("wait_go"):
            await wait_go(spec.get("go_wait_s", GO_WAIT_S))
            deadline = time.monotonic() + spec["limit_s"]
        if not subscribe_first:
            await adapter.start_consumer(family, subjects, **start)
        try:
            result = await consume(
                adapter, tally, spec["mode"], spec.get("recv_max", settings.recv_max_messages), deadline,
                spec.get("handler_sleep_ms", 0.0) / 1000.0, adapter.groups,
            )
        finally:
            tally.close()
        poller = getattr(adapter, "poller_stats", None)
        if spec.get("delayed") and poller is not None:
            result["poller"] = dict(poller)
        return result
    raise ValueError(f"unknown role {role!r}")


def many_subject_names(family: str, count: int) -> list[str]:
    return [f"{family}-{i:05d}" for i in range(count)]


def _stop_asked(path: str | None) -> str | None:
    """Why the driver asks the grower to stop (the file it wrote), or None."""
    if not path:
        return None
    try:
        with open(path) as f:
            return f.read().strip() or "asked to stop"
    except FileNotFoundError:
        return None


async def grow(
    adapter: Adapter, spec: dict[str, Any], settings: Settings, subjects: list[str], deadline: float
) -> dict[str, Any]:
    """W10: set the family up, then chunk by chunk make the subjects (where the system needs it)
    and send each its first message (sequence = its index). Stops at the deadline or at the first
    error, and says where: a system that cannot hold them all is a figure, not a crash."""
    chunk = spec["chunk"]
    await adapter.setup(spec["family"], [], delayed=False, members=1, prefetch=settings.prefetch_messages)
    await adapter.prepare_producer()
    print("READY", flush=True)
    await wait_go(spec.get("go_wait_s", GO_WAIT_S))
    deadline = time.monotonic() + spec["limit_s"]
    started = time.perf_counter()
    made_s = sent_s = 0.0
    reached = 0
    stopped = None
    steps: list[dict[str, Any]] = []
    for at in range(0, len(subjects), chunk):
        part = subjects[at : at + chunk]
        try:
            t0 = time.perf_counter()
            await asyncio.wait_for(adapter.add_subjects(spec["family"], part), max(0.1, deadline - time.monotonic()))
            t1 = time.perf_counter()
            await produce_bulk(adapter, part, len(part), 1, settings.window_messages, deadline, seq_base=at)
            t2 = time.perf_counter()
        except Exception as exc:
            stopped = f"at {at:,} subjects: {type(exc).__name__}: {str(exc)[:200] or 'time limit'}"
            break
        made_s += t1 - t0
        sent_s += t2 - t1
        reached += len(part)
        steps.append({"subjects": reached, "seconds": round(t2 - started, 3)})
        why = _stop_asked(spec.get("stop_path"))
        if why is not None and reached < len(subjects):
            stopped = f"at {reached:,} subjects: {why}"
            break
        if time.monotonic() > deadline and reached < len(subjects):
            stopped = f"at {reached:,} subjects: the cell's time limit ({spec['limit_s']:.0f} s)"
            break
    seconds = time.perf_counter() - started
    return {
        "asked": len(subjects),
        "reached": reached,
        "stopped": stopped,
        "seconds": round(seconds, 3),
        "make_s": round(made_s, 3),
        "first_send_s": round(sent_s, 3),
        "new_subjects_per_s": round(reached / seconds, 1) if seconds > 0 and reached else None,
        "steps": steps,
    }


async def run_once(spec: dict[str, Any], settings: Settings) -> dict[str, Any]:
    out: dict[str, Any] = {"system": spec["system"], "role": spec["role"]}
    adapter: Adapter | None = None
    try:
        adapter = make_adapter(spec["system"], spec["endpoint"], settings)
        adapter.groups = spec.get("groups", 1)
        out["client"] = adapter.client
        await connect(adapter)
        # Every system's client alike: what start-up made (modules, the client library, the
        # connection) leaves the collector's full passes, which otherwise walk it every half
        # second or so under a fan-out's allocation rate and stall this process for 13-30 ms
        # (the servers of qmq do the same: qmq.serving.runner).
        gc.freeze()
        out["server_version"] = adapter.server_version
        out.update(await run_role(adapter, spec, settings))
        out["ok"] = "error" not in out
    except Exception as exc:
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"
        log("ERROR", out["error"])
    finally:
        if adapter is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(adapter.close(), CLOSE_LIMIT_S)
    return out


async def main_async(spec: dict[str, Any]) -> None:
    """One result line per round; a spec without `rounds` is one round.

    Rounds let one process serve several cells in turn (W6's consumer pool), each with a
    fresh connection, so the driver does not pay a process start per cell."""
    settings = Settings.from_json(spec["settings"])
    for extra in spec.get("rounds") or [{}]:
        print(json.dumps(await run_once({**spec, **extra}, settings)), flush=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    settings = Settings.from_json(spec["settings"])
    if settings.event_loop == "uvloop":
        import uvloop

        uvloop.run(main_async(spec))
    else:
        asyncio.run(main_async(spec))


if __name__ == "__main__":
    main()
