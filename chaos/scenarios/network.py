"""Network faults, Jepsen-style: the meta server, two broker groups (master and slave each) and
the delay server each run in a network namespace of its own (chaos/netns.py); the load runs
in the root namespace. Partitions isolate one server at a time (a master, a slave, the meta
server, the delay server) and heal. While a master is cut off, a send made to it from inside
its own namespace must not be acknowledged (it cannot replicate it: fenced), and what it
acknowledged before must survive its slave's promotion. Loss and delay (``tc netem`` is not
available on this kernel) come from a userspace TCP proxy (chaos/proxy.py) on the path every
server and client takes to the meta server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from chaos import netns
from chaos.cluster import ChaosCluster
from chaos.netns import Host
from chaos.proxy import Proxy
from chaos.scenario import Result, Settings, drain

NAMES = ("meta", "b1-m", "b1-s1", "b2-m", "b2-s1", "d1", "d1-s1")
CUT_S = 6.0
HEAL_TIMEOUT_S = 60.0


def _view(base: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"{base}/meta/cluster", timeout=3) as resp:
            doc: dict[str, Any] = json.load(resp)
            return doc
    except (OSError, ValueError):
        return None


def _wait(what: str, base: str, ok: Any, timeout_s: float = HEAL_TIMEOUT_S) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        view = _view(base)
        if view is not None and ok(view):
            return time.monotonic() - t0
        time.sleep(0.2)  # the meta server's view is polled, bounded by the deadline
    raise AssertionError(f"{what}: not so within {timeout_s:.0f} s")


def _member_at(cluster: ChaosCluster, address: str | None) -> str | None:
    for name in NAMES:
        if name != "meta" and cluster.member(name).ready.get("address") == address:
            return name
    return None


def _heartbeats_since(cluster: ChaosCluster, name: str, since_ms: int) -> Any:
    address = cluster.member(name).ready.get("address")

    def ok(view: dict[str, Any]) -> bool:
        servers = [s for s in view["servers"] if s["address"] == address]
        masters = all(g["master"] for g in view["groups"])
        return bool(servers) and servers[0]["last_heartbeat_ms"] > since_ms and masters

    return ok


def run(settings: Settings) -> list[Result]:
    result = Result(
        "network",
        "partitions (network namespaces, a veth set down): isolate a master, a slave, the meta server, the delay "
        "server, heal; delay, jitter and cut connections on the meta path (a userspace proxy)",
    )
    t0 = time.monotonic()
    proxies: list[Proxy] = []
    cluster: ChaosCluster | None = None
    try:
        hosts = netns.setup(NAMES)

        def through_proxy(url: str) -> str:
            parts = urlsplit(url)
            proxy = Proxy(f"{netns.SUBNET}.1", parts.hostname or "", parts.port or 80)
            proxies.append(proxy)
            return f"http://{netns.SUBNET}.1:{proxy.port}{parts.path}"

        placed = {name: (h.prefix(), h.ip) for name, h in hosts.items()}
        # the servers listen on their namespaces' addresses, without an auth file: --insecure
        open_to_all = {section: {"insecure": True} for section in ("meta", "broker", "delay")}
        cluster = ChaosCluster(
            settings.work_dir / "network", placed=placed, meta_url=through_proxy, extra_config=open_to_all
        )
        cluster.start()
        cluster.start_load()
        base = cluster.meta_server.removesuffix("/meta/address")
        rounds = 1 if settings.quick else 2
        fenced: list[str] = []
        for r in range(rounds):
            time.sleep(3)
            # a master cut off: fenced, then replaced by its slave
            view = _view(base) or {}
            group = "b1" if r % 2 == 0 else "b2"
            master = _member_at(cluster, next(g["master"] for g in view.get("groups", []) if g["group"] == group))
            if master is None:
                raise AssertionError(f"no master of {group} in the meta server's view: {view}")
            fenced.append(_isolate_master(cluster, hosts[master], base, f"{r}", result))
            # a slave cut off
            view = _view(base) or {}
            slave = next(
                (s for s in ("b1-m", "b1-s1", "b2-m", "b2-s1")
                 if _member_at(cluster, next(g["master"] for g in view["groups"] if g["group"] == s[:2])) != s),
                "b2-s1",
            )
            _isolate(cluster, hosts[slave], base, result)
            _isolate(cluster, hosts["d1"], base, result)
            _isolate(cluster, hosts["meta"], base, result)
            # loss and delay on the meta path
            proxy = proxies[0]
            proxy.faults.delay_ms, proxy.faults.jitter_ms, proxy.faults.reset_ratio = 100, 200, 0.05
            time.sleep(CUT_S)
            proxy.faults.delay_ms, proxy.faults.jitter_ms, proxy.faults.reset_ratio = 0, 0, 0.0
            result.fault_count += 1
        result.notes.append("sends to a master while it was cut off: " + ", ".join(fenced))
        result.notes.append(f"connections cut by the proxy: {proxies[0].resets}")
        result.figures = drain(cluster, settings.log)
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {str(exc)[:400]}"
    finally:
        if cluster is not None:
            cluster.close()
        for p in proxies:
            p.close()
        netns.clean()
    result.duration_s = time.monotonic() - t0
    return [result]


def _isolate(cluster: ChaosCluster, host: Host, base: str, result: Result) -> None:
    netns.cut(host)
    time.sleep(CUT_S)
    healed_ms = time.time_ns() // 1_000_000
    netns.heal(host)
    result.fault_count += 1
    check = _heartbeats_since(cluster, host.name, healed_ms) if host.name != "meta" else lambda v: True
    result.recovery_s = max(result.recovery_s, _wait(f"{host.name} back after healing", base, check))


def _isolate_master(cluster: ChaosCluster, host: Host, base: str, tag: str, result: Result) -> str:
    """Cut the master off; a send to it from inside its namespace must not be acknowledged."""
    group = cluster.member(host.name).group
    epoch = next(g["epoch"] for g in (_view(base) or {"groups": []})["groups"] if g["group"] == group)
    netns.cut(host)
    address = cluster.member(host.name).ready["address"]
    probe = subprocess.run(
        [*host.prefix(), sys.executable, "-m", "chaos.probe", address, f"fenced-{tag}", "8"],
        capture_output=True, text=True, timeout=60,
    )
    answer = probe.stdout.strip() or f"probe failed: {probe.stderr.strip()[-200:]}"
    promoted = _wait(f"{group} promoting its slave", base,
                     lambda v: any(g["group"] == group and g["epoch"] > epoch for g in v["groups"]))
    if answer == "OK":
        raise AssertionError(f"{host.name}, cut off from its slave and the meta server, acknowledged a send")
    time.sleep(max(0.0, CUT_S - 8))
    healed_ms = time.time_ns() // 1_000_000
    netns.heal(host)
    result.fault_count += 1
    took = _wait(f"{host.name} back after healing", base, _heartbeats_since(cluster, host.name, healed_ms))
    result.recovery_s = max(result.recovery_s, took)
    return f"{host.name}: {answer}, its slave promoted {promoted:.1f} s after the cut"
