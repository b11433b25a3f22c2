"""Fake "hosts" on one machine: Linux network namespaces joined by a bridge (needs root + iproute2).

Each host is a network namespace ``/run/netns/<prefix>-<name>`` with one veth interface, renamed
``eth0`` inside the namespace so every host has the same interface name (``GLOO_SOCKET_IFNAME=eth0``
then works on all of them). The host ends of the veths hang off a bridge in the root namespace,
which gets ``10.200.<subnet>.1``; host ``i`` (0-based) gets ``10.200.<subnet>.<i + 2>``. All traffic
stays inside 10.200.<subnet>.0/24 and loopback: nothing is routed anywhere else (no default route,
no forwarding, no NAT).

Only the network is separate; processes still share the file system, PIDs and /etc/hosts (so host
names resolve to 127.0.0.1 everywhere: use the addresses, not the names). Run a program "on" a host
with ``nsenter --net=/run/netns/NAME prog`` (``ip netns exec`` remounts /sys and fails for slurmd).

    with NetnsHosts(["node1", "node2"]) as hosts:
        hosts.addr("node1")                 # '10.200.7.2'
        subprocess.run(hosts.nsenter("node2") + ["python", "server.py", "--bind", hosts.addr("node2")])
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

NETNS_DIR = Path("/run/netns")
IFNAME = "eth0"  # the interface name inside every namespace


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def _subnets_in_use() -> set[int]:
    """Third octets of 10.200.x.y addresses already configured in the root namespace."""
    out = _ip("-o", "-4", "addr", "show", check=False).stdout
    used = set()
    for word in out.split():
        if word.startswith("10.200."):
            try:
                used.add(int(word.split(".")[2]))
            except (IndexError, ValueError):
                pass
    return used


def netns_available() -> str | None:
    """None if namespaces + veth + bridge can be created here, else the reason why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        _ip("-V")
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    probe = f"sdtprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` failed: {e.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class NetnsHosts:
    """Create namespaces + veths + a bridge on enter; delete them (and kill what runs inside) on exit."""

    def __init__(self, names: list[str], subnet: int | None = None):
        if not names:
            raise ValueError("need at least one host name")
        self.names = list(names)
        self.subnet = subnet if subnet is not None else self._free_subnet()
        # Interface names are limited to 15 characters; the pid keeps concurrent sessions apart.
        self.tag = f"sdt{self.subnet}"
        self.bridge = f"{self.tag}br"
        self.prefix = f"sdt{os.getpid()}-{self.subnet}"
        self._created_ns: list[str] = []
        self._created_bridge = False

    @staticmethod
    def _free_subnet() -> int:
        used = _subnets_in_use()
        # Start from a pid-dependent offset so two sessions starting together rarely pick the same one.
        start = 10 + os.getpid() % 200
        for k in range(240):
            cand = 10 + (start - 10 + k) % 240
            if cand not in used:
                return cand
        raise RuntimeError("no free 10.200.x.0/24 subnet")

    # --- addresses and commands ----------------------------------------------------------------
    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge (where daemons outside the hosts listen)."""
        return f"10.200.{self.subnet}.1"

    def addr(self, name: str) -> str:
        return f"10.200.{self.subnet}.{self.names.index(name) + 2}"

    def netns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def netns_path(self, name: str) -> str:
        return str(NETNS_DIR / self.netns(name))

    def nsenter(self, name: str) -> list[str]:
        """Command prefix that runs a program in host ``name``'s network namespace."""
        return ["nsenter", f"--net={self.netns_path(name)}"]

    # --- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> NetnsHosts:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created_bridge = True
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns = self.netns(name)
            _ip("netns", "add", ns)
            self._created_ns.append(ns)
            host_end, ns_end = f"{self.tag}h{i}", f"{self.tag}n{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end, "netns", ns)
            _ip("link", "set", host_end, "master", self.bridge)
            _ip("link", "set", host_end, "up")
            _ip("-n", ns, "link", "set", ns_end, "name", IFNAME)
            _ip("-n", ns, "addr", "add", f"{self.addr(name)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def pids(self, name: str) -> list[int]:
        r = _ip("netns", "pids", self.netns(name), check=False)
        return [int(p) for p in r.stdout.split() if p.isdigit()]

    def destroy(self) -> None:
        for ns in list(self._created_ns):
            name = ns[len(self.prefix) + 1 :]
            # Anything still running in a namespace we created was started by us (a daemon or a job
            # it launched): stop it by pid, then drop the namespace.
            pids = self.pids(name)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                deadline = time.monotonic() + 3
                while pids and time.monotonic() < deadline:
                    pids = [p for p in pids if Path(f"/proc/{p}").exists()]
                    time.sleep(0.05)
                if not pids:
                    break
            _ip("netns", "del", ns, check=False)  # also deletes the veth pair
            self._created_ns.remove(ns)
        if self._created_bridge:
            _ip("link", "del", self.bridge, check=False)
            self._created_bridge = False
