"""Network namespaces for the network scenario: each server in a namespace of its own, joined
to the root namespace by a veth pair whose root end sits on one bridge (``qcbr0``,
10.77.0.1/24; the campaign's workers and proxy live in the root namespace). A partition is
the root end of a server's veth set down; healing sets it up again. (``tc netem`` is not
available on this kernel: loss and delay come from chaos/proxy.py instead.)"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

BRIDGE = "qcbr0"
SUBNET = "10.77.0"
PREFIX = "qc-"


def _ip(*args: str, ns: str | None = None, check: bool = True) -> None:
    argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    subprocess.run(argv, check=check, capture_output=True)


@dataclass(frozen=True)
class Host:
    name: str
    ns: str
    ip: str
    veth_root: str

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


def clean() -> None:
    """Remove whatever a run (this one or an interrupted one) left: namespaces, veths, bridge."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for ns in listed:
        if ns.startswith(PREFIX):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith("qv") or name == BRIDGE:
            subprocess.run(["ip", "link", "del", name], capture_output=True)


def setup(names: Sequence[str]) -> dict[str, Host]:
    clean()
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    hosts: dict[str, Host] = {}
    for i, name in enumerate(names):
        ns, root_end, ns_end, ip = f"{PREFIX}{name}", f"qv{i}h", f"qv{i}n", f"{SUBNET}.{10 + i}"
        _ip("netns", "add", ns)
        _ip("link", "add", root_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", ns)
        _ip("link", "set", root_end, "master", BRIDGE)
        _ip("link", "set", root_end, "up")
        _ip("addr", "add", f"{ip}/24", "dev", ns_end, ns=ns)
        _ip("link", "set", ns_end, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        hosts[name] = Host(name, ns, ip, root_end)
    return hosts


def cut(host: Host) -> None:
    """Isolate ``host``: nothing reaches it, nothing leaves it."""
    _ip("link", "set", host.veth_root, "down")


def heal(host: Host) -> None:
    _ip("link", "set", host.veth_root, "up")
