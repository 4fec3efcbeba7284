"""Hostile clients, against a live broker, delay server and meta server under the usual load:

- frames mutated at random (hypothesis draws the mutations of valid frames: bytes flipped,
  set, cut, inserted, the header swapped for another msgpack value), each on a connection of
  its own; the meta server gets mutated HTTP bodies. Only the offending connection may close:
  the server keeps running, a PING on a connection of its own is answered within a second, and
  the meta server never answers 5xx;
- 5,000 idle connections (each sent one PING) at once to the broker, from a host of their own
  (127.0.0.2; the load connects from 127.0.0.1): the broker keeps connections_per_host_max of
  them and turns the rest away, and a new connection from the load's host is let in at once;
- slow readers: connections that pipeline requests and never read the answers.

Memory (the server's RSS) and the PING latency of a well-behaved connection are measured
while each runs; the load's checker does the rest.
"""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos.cluster import ChaosCluster
from chaos.scenario import Result, Settings, drain
from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame, FrameDecoder, encode_frame
from qmq.protocol.message import encode_message

IDLE_CONNECTIONS = 5_000
HOSTILE_HOST = "127.0.0.2"  # where the idle connections come from: not the load's host
PING_SLOW_S = 1.0
RSS_GROWTH_MAX_BYTES = 256 * 1024 * 1024


def _valid_frames() -> list[bytes]:
    msg = encode_message(b"chaos.fuzz", b"fuzz-1", b"", 0, b"", b"body", 1, 0)
    later = encode_message(b"chaos.fuzz", b"fuzz-2", b"", 0, b"", b"body", 1, int(time.time() * 1000) + 3_600_000)
    frames = [
        Frame(RequestCode.PING, 1),
        Frame(RequestCode.SEND_MESSAGES, 2, {}, msg),
        Frame(RequestCode.SEND_MESSAGES, 3, {}, later),
        Frame(RequestCode.PULL, 4, {"subject": "chaos.fuzz", "group": "fz", "consumer_id": "c", "session": "s",
                                    "max": 10, "timeout_ms": 0}),
        Frame(RequestCode.ACK, 5, {"subject": "chaos.fuzz", "group": "fz", "consumer_id": "c", "ranges": [[0, 1]]}),
        Frame(RequestCode.REPLICATE, 6, {"from": 0, "action_from": 0, "epoch": 1, "max_bytes": 1024,
                                         "timeout_ms": 0, "slave": "x:1"}),
        Frame(RequestCode.DELAY_STATS, 7, {}),
        Frame(RequestCode.SUBJECTS, 8, {}),
        Frame(RequestCode.LAG, 9, {"subject": "chaos.fuzz"}),
        Frame(RequestCode.READ, 10, {"subject": "chaos.fuzz", "from": 0, "max": 5}),
    ]
    return [encode_frame(f) for f in frames]


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


class Control:
    """A well-behaved connection: how long a PING takes."""

    def __init__(self, address: str) -> None:
        self.sock = socket.create_connection(_host_port(address), timeout=10)
        self.decoder = FrameDecoder()
        self.rid = 0

    def ping_s(self) -> float:
        self.rid += 1
        t0 = time.monotonic()
        self.sock.sendall(encode_frame(Frame(RequestCode.PING, self.rid)))
        while True:
            frame = self.decoder.next_frame()
            if frame is not None and frame.request_id == self.rid:
                return time.monotonic() - t0
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the control connection was closed")
            self.decoder.receive_data(data)

    def close(self) -> None:
        self.sock.close()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _send_once(address: str, data: bytes) -> str:
    """Send ``data`` on a new connection; what became of it: answered, closed, or silent."""
    with socket.create_connection(_host_port(address), timeout=2) as s:
        s.settimeout(0.3)
        with contextlib.suppress(OSError):
            s.sendall(data)
        try:
            got = s.recv(65536)
        except TimeoutError:
            return "silent"
        except OSError:
            return "closed"
        return "answered" if got else "closed"


@st.composite
def _mutated(draw: Any, valid: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(valid)))
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "set", "cut", "insert", "header", "length"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "header" and len(data) >= 20:
            leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20)
            value = draw(st.recursive(leaves | st.binary(max_size=20),
                                      lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                          max_size=4),
                                      max_leaves=8))
            header = msgpack.packb(value)
            data = data[:20] + header + data[20:]
            data[0:4] = (len(data) - 4).to_bytes(4, "little")
        elif kind == "length" and len(data) >= 4:
            data[0:4] = draw(st.integers(0, 2**32 - 1)).to_bytes(4, "little")
    return bytes(data)


def _fuzz_frames(address: str, alive: Callable[[], None], examples: int) -> dict[str, int]:
    outcomes: dict[str, int] = {}
    valid = _valid_frames()
    control = Control(address)
    slowest = [0.0]

    @settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_mutated(valid))
    def one(data: bytes) -> None:
        what = _send_once(address, data)
        outcomes[what] = outcomes.get(what, 0) + 1
        slowest[0] = max(slowest[0], control.ping_s())
        if slowest[0] > PING_SLOW_S:
            raise AssertionError(f"a PING took {slowest[0]:.2f} s while fuzzing")
        alive()

    try:
        one()
    finally:
        control.close()
    outcomes["slowest_ping_ms"] = int(slowest[0] * 1000)
    return outcomes


def _fuzz_meta(base_url: str, examples: int) -> dict[str, int]:
    """Mutated bodies to POST /meta/register and /meta/promote: 4xx, never 5xx."""
    outcomes: dict[str, int] = {}
    good = {"role": "broker", "group": "fz", "address": "127.0.0.1:1", "http": "http://127.0.0.1:2", "pid": 1,
            "role_in_group": "slave", "epoch": 0, "log_end": 0, "action_end": 0}

    @settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(["/meta/register", "/meta/promote"]),
           st.one_of(
               st.binary(max_size=200),
               st.dictionaries(st.sampled_from(sorted(good)), st.none() | st.integers() | st.text(max_size=30)
                               | st.booleans() | st.lists(st.integers(), max_size=3), max_size=9)
               .map(lambda d: json.dumps({**good, **d}).encode()),
           ))
    def one(path: str, body: bytes) -> None:
        req = urllib.request.Request(base_url + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                status = resp.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        key = f"{status // 100}xx"
        outcomes[key] = outcomes.get(key, 0) + 1
        if status >= 500:
            raise AssertionError(f"POST {path} {body[:80]!r} answered {status}")

    one()
    return outcomes


def _idle(address: str, pid: int, control: Control, n: int) -> str:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 1024
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(want, soft), max(want, hard)))
    rss0 = _rss_bytes(pid)
    socks: list[socket.socket] = []
    ping = encode_frame(Frame(RequestCode.PING, 1))
    refused = 0
    try:
        for _ in range(n):
            try:
                # from a host of its own (any 127.x address is this machine): the load's clients
                # connect from 127.0.0.1, and the broker's connections_per_host_max counts by host
                s = socket.create_connection(_host_port(address), timeout=5, source_address=(HOSTILE_HOST, 0))
                s.sendall(ping)
                socks.append(s)
            except OSError:
                refused += 1
        time.sleep(2)
        open_now = turned_away = 0
        for s in socks:
            what = _first_answer(s)
            open_now += what == "answered"
            turned_away += what == "turned away"
        slowest = max(control.ping_s() for _ in range(20))
        # a client connecting now, from the load's host, is let in and answered at once
        t0 = time.monotonic()
        newcomer = Control(address)
        try:
            newcomer_s = time.monotonic() - t0 + newcomer.ping_s()
        finally:
            newcomer.close()
        growth = _rss_bytes(pid) - rss0
    finally:
        for s in socks:
            s.close()
    if growth > RSS_GROWTH_MAX_BYTES:
        raise AssertionError(f"{n} idle connections grew the broker by {growth >> 20} MiB")
    if max(slowest, newcomer_s) > PING_SLOW_S:
        raise AssertionError(f"with {n} idle connections a PING took {max(slowest, newcomer_s):.2f} s")
    return (f"{n} idle connections from {HOSTILE_HOST}: {open_now} kept open (their PING answered), {turned_away} "
            f"turned away with an error frame (connections_per_host_max), {n - open_now - turned_away - refused} "
            f"closed or silent, {refused} refused by the kernel; RSS +{growth >> 20} MiB; slowest PING "
            f"{slowest * 1000:.0f} ms; a new connection from 127.0.0.1 connected and answered in "
            f"{newcomer_s * 1000:.0f} ms")


def _first_answer(sock: socket.socket) -> str:
    """What came back on a connection that sent one PING: "answered", "turned away" (an error
    frame: the broker refused the connection), "closed" or "silent"."""
    sock.setblocking(False)
    decoder = FrameDecoder()
    try:
        while (frame := decoder.next_frame()) is None:
            data = sock.recv(65536)
            if not data:
                return "closed"
            decoder.receive_data(data)
    except BlockingIOError:
        return "silent"
    except OSError:
        return "closed"
    return "answered" if frame.code == RequestCode.PING and frame.status == 0 else "turned away"


def _slow_readers(address: str, pid: int, control: Control, n: int) -> str:
    rss0 = _rss_bytes(pid)
    socks = []
    frames = b"".join(
        encode_frame(Frame(RequestCode.READ, i, {"subject": "chaos.orders", "from": 0, "max": 1000}))
        for i in range(1, 2001)
    )
    for _ in range(n):
        s = socket.create_connection(_host_port(address), timeout=5)
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError, OSError):
            s.send(frames)  # as much as the socket takes; never read an answer
        socks.append(s)
    try:
        time.sleep(3)
        slowest = max(control.ping_s() for _ in range(20))
        growth = _rss_bytes(pid) - rss0
    finally:
        for s in socks:
            s.close()
    if growth > RSS_GROWTH_MAX_BYTES:
        raise AssertionError(f"{n} slow readers grew the broker by {growth >> 20} MiB")
    if slowest > PING_SLOW_S:
        raise AssertionError(f"with {n} slow readers a PING took {slowest:.2f} s")
    return f"{n} slow readers (2,000 pipelined READs each, never read): RSS +{growth >> 20} MiB; slowest PING " \
           f"{slowest * 1000:.0f} ms"


def run(settings_: Settings) -> list[Result]:
    result = Result(
        "hostile clients",
        "mutated frames (hypothesis) to a broker and a delay server, mutated bodies to the meta server, "
        f"{IDLE_CONNECTIONS:,} idle connections, slow readers, under load",
    )
    cluster = ChaosCluster(settings_.work_dir / "hostile", broker_groups=1, slaves=0)
    examples = 150 if settings_.quick else 800
    t0 = time.monotonic()
    try:
        cluster.start()
        cluster.start_load(rate=100)

        def alive() -> None:
            for name in ("b1-m", "d1", "meta"):
                if not cluster.running(name):
                    raise AssertionError(f"{name} stopped while being fuzzed")

        for name in ("b1-m", "d1"):
            outcomes = _fuzz_frames(cluster.member(name).ready["address"], alive, examples)
            result.fault_count += examples
            result.notes.append(f"{name}: {examples} mutated frames: {outcomes}")
        base = cluster.meta_server.removesuffix("/meta/address")
        outcomes = _fuzz_meta(base, examples)
        result.fault_count += examples
        result.notes.append(f"meta: {examples} mutated bodies: {outcomes}")
        broker = cluster.member("b1-m")
        control = Control(broker.ready["address"])
        try:
            result.notes.append(_idle(broker.ready["address"], broker.pid, control, IDLE_CONNECTIONS))
            result.fault_count += IDLE_CONNECTIONS
            readers = 20 if settings_.quick else 100
            result.notes.append(_slow_readers(broker.ready["address"], broker.pid, control, readers))
            result.fault_count += readers
        finally:
            control.close()
        alive()
        result.figures = drain(cluster, settings_.log)
    except Exception as exc:
        inner = getattr(exc, "exceptions", None) or [exc]  # hypothesis groups what it found
        result.error = "; ".join(f"{type(e).__name__}: {str(e)[:300]}" for e in inner)
    finally:
        cluster.close()
    result.duration_s = time.monotonic() - t0
    return [result]
