"""Hostile clients against a cluster with an auth file, under the usual load (whose producers,
consumers and watchdog authenticate as apps of the file):

- unauthenticated: every kind of request sent as raw frames before any handshake, to the
  broker and the delay server; the SDK without a secret; the meta server's HTTP without an
  Authorization header;
- wrong secrets and unknown apps, and a guesser hammering the handshake from one address;
- the wrong permission: an app of the file with the right secret that may only use other
  subjects tries to send to the load's subject, pull its groups (it would steal their
  messages), read it, reset a group's offset, register a broker group of its own and promote.

Each must be refused and reveal nothing: a raw frame is answered UNAUTHENTICATED with no body
and no other header than the error; an `AuthError` names the app, the action and the subject
only (a wrong secret and an unknown app get the same words); HTTP answers 401/403 with no
addresses. Others are unaffected: an authenticated PING is answered within a second while the
guesser runs, a client with the right secret still gets in, the servers keep running, the
denials are counted on /metrics, and the load's checker finds nothing lost or repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from chaos.cluster import GROUPS, ChaosCluster
from chaos.scenario import Result, Settings, drain
from chaos.worker import SUBJECT
from qmq.aio import Consumer, Producer
from qmq.auth.handshake import ClientCredentials
from qmq.auth.http import basic_authorization
from qmq.auth.secrets import hash_secret
from qmq.common.errors import AuthError
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame, FrameDecoder, encode_frame
from qmq.protocol.message import encode_message

# One secret for every app of the cluster's own processes: servers, load workers and watchdog
# read the same $QMQ_SECRET (each as its own app).
CLUSTER_SECRET = "chaos-cluster-secret"
INTRUDER_SECRET = "intruder-secret"
PING_SLOW_S = 1.0
# failed handshakes from one address answered at once; later ones wait 0.1 s more each (docs/security.md)
GUESSES_FREE = 10
GUESS_DELAY_MIN_S = 0.1
ANSWER_WAIT_S = 5.0
# what a refusal may carry in its header: the words, and the app, action and subject refused
REFUSAL_KEYS = {"error", "action", "app", "subject"}


def auth_file_text() -> str:
    cluster_hash = hash_secret(CLUSTER_SECRET, log2_n=10)
    return f"""
[apps.qmq-cluster]
secret_hash = "{cluster_hash}"
cluster = true
[apps.chaos]
secret_hash = "{hash_secret(CLUSTER_SECRET, log2_n=10)}"
produce = ["chaos.*"]
consume = ["chaos.*"]
[apps.qmq-watchdog]
secret_hash = "{hash_secret(CLUSTER_SECRET, log2_n=10)}"
produce = ["chaos.*"]
[apps.intruder]
secret_hash = "{hash_secret(INTRUDER_SECRET, log2_n=10)}"
produce = ["other.*"]
consume = ["other.*"]
"""


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _request_frames() -> list[Frame]:
    """One of every kind of request a client could try without authenticating."""
    msg = encode_message(SUBJECT.encode(), b"intruder-1", b"", 0, b"", b"intruder body", 1, 0)
    pull = {"subject": SUBJECT, "group": GROUPS[0], "consumer_id": "x", "session": "s", "max": 100, "timeout_ms": 0}
    return [
        Frame(RequestCode.PING, 1),
        Frame(RequestCode.SEND_MESSAGES, 2, {}, msg),
        Frame(RequestCode.PULL, 3, pull),
        Frame(RequestCode.ACK, 4, {"subject": SUBJECT, "group": GROUPS[0], "consumer_id": "x", "ranges": [[0, 10]]}),
        Frame(RequestCode.READ, 5, {"subject": SUBJECT, "from": 0, "max": 100}),
        Frame(RequestCode.SUBJECTS, 6, {}),
        Frame(RequestCode.LAG, 7, {"subject": SUBJECT}),
        Frame(RequestCode.DELAY_STATS, 8, {}),
        Frame(RequestCode.RESET_OFFSET, 9, {"subject": SUBJECT, "group": GROUPS[0], "to": "latest"}),
        Frame(RequestCode.REPLICATE, 10, {"from": 0, "action_from": 0, "epoch": 1, "max_bytes": 1 << 20,
                                          "timeout_ms": 0, "slave": "127.0.0.1:1"}),
    ]


def _answers(address: str, frame: Frame) -> list[Frame]:
    """Send one frame on a connection of its own; its answer (none if the connection was closed
    or stayed quiet)."""
    decoder = FrameDecoder()
    with socket.create_connection(_host_port(address), timeout=ANSWER_WAIT_S) as s:
        s.sendall(encode_frame(frame))
        deadline = time.monotonic() + ANSWER_WAIT_S
        while time.monotonic() < deadline:  # bounded: a quiet connection ends the wait
            got = decoder.next_frame()
            if got is not None:
                return [got]
            try:
                data = s.recv(65536)
            except (TimeoutError, OSError):
                break
            if not data:
                break
            decoder.receive_data(data)
    return []


def unauthenticated_frames(address: str, role: str, secrets_seen: list[str]) -> str:
    """Every request before a handshake: answered UNAUTHENTICATED, with nothing but an error."""
    outcomes: dict[str, int] = {}
    for frame in _request_frames():
        name = RequestCode(frame.code).name
        answers = _answers(address, frame)
        if not answers:
            outcomes["closed unanswered"] = outcomes.get("closed unanswered", 0) + 1
            continue
        for a in answers:
            if a.status != Status.UNAUTHENTICATED:
                raise AssertionError(f"{role}: {name} before any handshake was answered {Status(a.status).name}: "
                                     f"{a.header}")  # fmt: skip
            extra = set(a.header) - REFUSAL_KEYS
            if extra or len(a.body):
                raise AssertionError(f"{role}: the refusal of {name} told more: header {a.header}, "
                                     f"{len(a.body)} body bytes")  # fmt: skip
            secrets_seen.append(json.dumps(a.header))
        outcomes["UNAUTHENTICATED"] = outcomes.get("UNAUTHENTICATED", 0) + 1
    return f"{role}: {len(_request_frames())} kinds of request without a handshake: {outcomes}"


async def _refusal(make: Callable[[], Any]) -> AuthError:
    try:
        await make()
    except AuthError as exc:
        return exc
    raise AssertionError("a hostile client was let in")


async def sdk_clients(meta_server: str, secrets_seen: list[str]) -> list[str]:
    """The SDK as an intruder: no secret, a wrong one, an unknown app, and the wrong permission."""
    notes = []

    async def send_as(app: str, secret: str, subject: str = SUBJECT) -> None:
        async with Producer(app_code=app, meta_server=meta_server, secret=secret, send_timeout_ms=5_000) as p:
            m = p.generate_message(subject)
            m.body = b"intruder body"
            await p.send(m)

    async def pull_as(app: str, secret: str, group: str) -> None:
        async with Consumer(app_code=app, meta_server=meta_server, secret=secret, consumer_id="intruder") as c:
            await c.pull_consumer(SUBJECT, group, start_from="earliest").pull(100, 1000)

    no_secret = await _refusal(lambda: send_as("chaos", ""))
    wrong = await _refusal(lambda: send_as("chaos", "not-the-secret"))
    unknown = await _refusal(lambda: send_as("nobody", "not-the-secret"))
    if str(wrong).replace("chaos", "APP") != str(unknown).replace("nobody", "APP"):
        raise AssertionError(f"a wrong secret and an unknown app were told apart: {wrong!s} / {unknown!s}")
    notes.append(f"no secret: {no_secret}; wrong secret: {wrong}; unknown app: same words")
    produce = await _refusal(lambda: send_as("intruder", INTRUDER_SECRET))
    if (produce.action, produce.subject) != ("produce", SUBJECT):
        raise AssertionError(f"the intruder's send was refused as {produce.action!r} on {produce.subject!r}")
    for group in GROUPS:
        consume = await _refusal(lambda g=group: pull_as("intruder", INTRUDER_SECRET, g))  # type: ignore[misc]
        if consume.action != "consume":
            raise AssertionError(f"the intruder's pull of group {group} was refused as {consume.action!r}")
    notes.append(f"wrong permission: send {produce}; pull of groups {', '.join(GROUPS)} refused (consume)")
    # the intruder's own subjects work: it was refused for what it may not do, not shut out
    await send_as("intruder", INTRUDER_SECRET, "other.allowed")
    for exc in (no_secret, wrong, unknown, produce):
        secrets_seen.append(str(exc))
    return notes


def forbidden_frames_as_intruder(address: str) -> str:
    """An authenticated intruder's raw READ, RESET_OFFSET and REPLICATE: FORBIDDEN, nothing else."""
    credentials = ClientCredentials("intruder", INTRUDER_SECRET)
    decoder = FrameDecoder()
    refused = []
    with socket.create_connection(_host_port(address), timeout=ANSWER_WAIT_S) as s:

        def ask(frame: Frame) -> Frame:
            s.sendall(encode_frame(frame))
            while True:  # bounded by the socket's timeout
                got = decoder.next_frame()
                if got is not None:
                    return got
                data = s.recv(65536)
                if not data:
                    raise ConnectionError(f"the broker closed the intruder's connection at {frame.code}")
                decoder.receive_data(data)

        hello_header, nonce = credentials.hello()
        hello = ask(Frame(RequestCode.AUTH_HELLO, 1, hello_header))
        proof = ask(Frame(RequestCode.AUTH_PROOF, 2, credentials.proof(hello.header, nonce)))
        if proof.status != Status.OK:
            raise AssertionError(f"the intruder's right secret was refused: {proof.header}")
        for rid, frame in enumerate(_request_frames()[4:], start=3):
            if frame.code in (RequestCode.SUBJECTS, RequestCode.LAG, RequestCode.DELAY_STATS):
                continue  # any authenticated app may ask these
            frame.request_id = rid
            answer = ask(frame)
            name = RequestCode(frame.code).name
            if answer.status != Status.FORBIDDEN or len(answer.body) or set(answer.header) - REFUSAL_KEYS:
                raise AssertionError(f"the intruder's {name} was answered {Status(answer.status).name}: "
                                     f"{answer.header}, {len(answer.body)} body bytes")  # fmt: skip
            refused.append(name)
    return f"intruder (right secret, other subjects): {', '.join(refused)} refused FORBIDDEN"


def _http(url: str, app: str | None, secret: str = "", body: object | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if app is not None:
        headers["Authorization"] = basic_authorization(app, secret)
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as resp:
            return int(resp.status), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def meta_http(base: str, addresses: list[str]) -> str:
    """The meta server's HTTP: 401 without (or with a wrong) secret, 403 for the intruder's
    registration and promotion; no answer names a server's address."""
    register = {"group": "evil", "address": "127.0.0.1:9", "role": "master", "http": "http://127.0.0.1:9"}
    tries = [
        ("GET /meta/address, no secret", f"{base}/meta/address", None, "", None, 401),
        ("GET /meta/cluster, wrong secret", f"{base}/meta/cluster", "chaos", "wrong", None, 401),
        ("GET /metrics, no secret", f"{base}/metrics", None, "", None, 401),
        ("POST /meta/register, no secret", f"{base}/meta/register", None, "", register, 401),
        ("POST /meta/register, intruder", f"{base}/meta/register", "intruder", INTRUDER_SECRET, register, 403),
        ("POST /meta/promote, intruder", f"{base}/meta/promote", "intruder", INTRUDER_SECRET, {"group": "broker-1"},
         403),
    ]  # fmt: skip
    seen = []
    for what, url, app, secret, body, want in tries:
        status, text = _http(url, app, secret, body)
        if status != want:
            raise AssertionError(f"meta server: {what} answered {status} (want {want}): {text[:300]}")
        leaked = [a for a in addresses if a in text]
        if leaked or INTRUDER_SECRET in text:
            raise AssertionError(f"meta server: the refusal of {what} revealed {leaked or 'a secret'}: {text[:300]}")
        seen.append(f"{what} {status}")
    return "meta: " + "; ".join(seen)


class Control:
    """An authenticated connection of the load's app: how long a PING takes while intruders try."""

    def __init__(self, meta_server: str) -> None:
        self.meta_server = meta_server

    async def slowest_ping_s(self, stop: threading.Event, address: str) -> float:
        from qmq.client.connection import Connection

        conn = Connection(address, connect_timeout_ms=5_000, credentials=ClientCredentials("chaos", CLUSTER_SECRET))
        slowest = 0.0
        try:
            while not stop.is_set():  # bounded: the guesser sets stop when it is done
                t0 = time.monotonic()
                await conn.request(RequestCode.PING, {})
                slowest = max(slowest, time.monotonic() - t0)
                await asyncio.sleep(0.05)  # a PING every 50 ms, not a busy loop
        finally:
            await conn.close()
        return slowest


def guesser(address: str, tries: int, stop: threading.Event, outcome: dict[str, Any]) -> None:
    """Wrong secrets, one handshake after another from one address: each is refused, and after
    ten within a minute each is answered later (never refused outright)."""
    credentials = ClientCredentials("chaos", "guess")
    waits: list[float] = []
    try:
        for rid in range(tries):
            with socket.create_connection(_host_port(address), timeout=10) as s:
                decoder = FrameDecoder()
                frames: list[Frame] = []
                hello_header, nonce = credentials.hello()
                t0 = time.monotonic()
                s.sendall(encode_frame(Frame(RequestCode.AUTH_HELLO, rid * 2 + 1, hello_header)))
                while len(frames) < 2:  # bounded by the socket timeout
                    got = decoder.next_frame()
                    if got is not None:
                        frames.append(got)
                        if len(frames) == 1:
                            proof = credentials.proof(got.header, nonce)
                            s.sendall(encode_frame(Frame(RequestCode.AUTH_PROOF, rid * 2 + 2, proof)))
                        continue
                    data = s.recv(65536)
                    if not data:
                        break
                    decoder.receive_data(data)
                if len(frames) < 2 or frames[1].status != Status.UNAUTHENTICATED:
                    raise AssertionError(f"guess {rid}: {[(f.status, f.header) for f in frames]}")
                waits.append(time.monotonic() - t0)
        outcome["waits"] = waits
    except Exception as exc:
        outcome["error"] = exc
    finally:
        stop.set()


def _denials(http: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {m[0]: float(m[1]) for m in re.findall(r'^qmq_\w*auth_denials_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


async def guessing_while_serving(broker: str, meta_server: str, tries: int) -> str:
    stop = threading.Event()
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=guesser, args=(broker, tries, stop, outcome), daemon=True)
    thread.start()
    slowest = await Control(meta_server).slowest_ping_s(stop, broker)
    thread.join(60)
    if "error" in outcome:
        raise outcome["error"]
    if slowest > PING_SLOW_S:
        raise AssertionError(f"while a guesser tried {tries} secrets an authenticated PING took {slowest:.2f} s")
    # and a client with the right secret, from the guesser's address, still gets in
    t0 = time.monotonic()
    async with Producer(app_code="chaos", meta_server=meta_server, secret=CLUSTER_SECRET) as p:
        m = p.generate_message("chaos.after-guessing")
        m.body = b"let in"
        await p.send(m)
    let_in_s = time.monotonic() - t0
    waits = outcome["waits"]
    if len(waits) > GUESSES_FREE and max(waits[GUESSES_FREE:]) < GUESS_DELAY_MIN_S:
        raise AssertionError(f"after {GUESSES_FREE} wrong secrets the guesser was still answered at once: {waits}")
    first, later = waits[:GUESSES_FREE], waits[GUESSES_FREE:]
    return (f"guesser: {tries} wrong secrets refused, the first {len(first)} in at most {max(first) * 1000:.0f} ms, "
            f"the next in {min(later, default=0) * 1000:.0f}..{max(later, default=0) * 1000:.0f} ms; slowest "
            f"authenticated PING meanwhile {slowest * 1000:.0f} ms; the right secret then got in ({let_in_s:.2f} s)")


def run(settings_: Settings) -> list[Result]:
    result = Result(
        "hostile clients, auth on",
        "clients without credentials, with wrong secrets, unknown apps, a handshake guesser and an app with "
        "the wrong permission, against a broker, a delay server and the meta server with an auth file, under load",
    )
    work = settings_.work_dir / "hostile-auth"
    work.mkdir(parents=True, exist_ok=True)
    auth = work / "auth.toml"
    auth.write_text(auth_file_text())
    cluster = ChaosCluster(
        work / "cluster", broker_groups=1, slaves=0, env={"QMQ_SECRET": CLUSTER_SECRET},
        secure=["--auth-file", str(auth)], server_app="qmq-cluster",
    )  # fmt: skip
    rounds = 1 if settings_.quick else 5
    tries = 15 if settings_.quick else 30
    t0 = time.monotonic()
    try:
        cluster.start()
        cluster.start_load(rate=100)
        broker = cluster.member("b1-m").ready["address"]
        delay = cluster.member("d1").ready["address"]
        base = cluster.meta_server.removesuffix("/meta/address")
        addresses = [broker, delay]
        before = _denials(cluster.http("b1-m"))
        said: list[str] = []  # every refusal's words: none may hold a secret

        def alive() -> None:
            for name in ("b1-m", "d1", "meta"):
                if not cluster.running(name):
                    raise AssertionError(f"{name} stopped while hostile clients tried it")

        for r in range(rounds):
            notes = [
                unauthenticated_frames(broker, "broker", said),
                unauthenticated_frames(delay, "delay server", said),
                *asyncio.run(sdk_clients(cluster.meta_server, said)),
                forbidden_frames_as_intruder(broker),
                meta_http(base, addresses),
            ]
            result.fault_count += 2 * len(_request_frames()) + 6 + 3 + 6
            if r == 0:
                result.notes.extend(notes)
            alive()
        result.notes.append(asyncio.run(guessing_while_serving(broker, cluster.meta_server, tries)))
        result.fault_count += tries
        for text in said:
            for secret in (CLUSTER_SECRET, INTRUDER_SECRET, "not-the-secret"):
                if secret in text:
                    raise AssertionError(f"a refusal told a secret: {text[:300]}")
        after = _denials(cluster.http("b1-m"))
        counted = {k: int(after.get(k, 0) - before.get(k, 0)) for k in sorted(set(after) | set(before))}
        if not all(counted.get(k, 0) > 0 for k in ("handshake", "unauthenticated", "forbidden")):
            raise AssertionError(f"the broker did not count every kind of denial: {counted}")
        result.notes.append(f"broker denials counted on /metrics during the scenario: {counted}")
        alive()
        result.figures = drain(cluster, settings_.log)
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {str(exc)[:500]}"
    finally:
        with contextlib.suppress(Exception):
            cluster.close()
    result.duration_s = time.monotonic() - t0
    return [result]
