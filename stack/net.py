"""Several hosts on one machine: network namespaces on a bridge, each a host with an address of its own.

The bridge ``<prefix>br`` in the machine's own namespace holds ``<net>.1``; each host is a namespace
``<prefix>-<name>`` joined to the bridge by a veth pair, with one address: the servers at ``<net>.2``, workers at
``<net>.11``..., training nodes at ``<net>.21``....  Traffic between hosts crosses the bridge, never loopback.
Needs root (``ip netns``, ``ip link``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass


class NetError(RuntimeError):
    """An ``ip`` command failed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


@dataclass(frozen=True)
class Net:
    """One stack's network.

    Attributes:
        prefix: Short name (at most 5 characters) that every namespace and link of this stack starts with.
        net: The first three octets of the stack's /24 (``10.231.7``).
    """

    prefix: str
    net: str

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def gateway(self) -> str:
        """The machine's own address on the bridge (a receiver on the host listens here)."""
        return f"{self.net}.1"

    @staticmethod
    def index(host: str) -> int:
        """The last octet of a host's address: ``srv`` 2, ``w<i>`` 10+i, ``n<i>`` 21+i."""
        if host == "srv":
            return 2
        kind, num = host[:1], host[1:]
        if kind == "w" and num.isdigit() and 1 <= int(num) <= 9:
            return 10 + int(num)
        if kind == "n" and num.isdigit() and 0 <= int(num) <= 8:
            return 21 + int(num)
        raise ValueError(f"unknown host {host!r}: srv, w1..w9 or n0..n8")

    def address(self, host: str) -> str:
        return f"{self.net}.{self.index(host)}"

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def hosts(self) -> list[str]:
        """This stack's hosts that exist now."""
        names = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]
        return sorted(n[len(self.prefix) + 1:] for n in names if n.startswith(f"{self.prefix}-"))

    def ensure_bridge(self) -> None:
        if _ip("link", "show", self.bridge, check=False).returncode == 0:
            return
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host(self, host: str) -> str:
        """Make ``host`` (idempotent); its address."""
        self.ensure_bridge()
        ns, addr = self.namespace(host), self.address(host)
        if host in self.hosts():
            return addr
        outer, inner = f"{self.prefix}{host}h", f"{self.prefix}{host}n"
        _ip("netns", "add", ns)
        try:
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", outer, "master", self.bridge, "up")
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        except NetError:
            self.remove_host(host)
            raise
        return addr

    def pids(self, host: str) -> list[int]:
        proc = _ip("netns", "pids", self.namespace(host), check=False)
        return [int(p) for p in proc.stdout.split() if p.isdigit()]

    def kill(self, host: str, grace: float = 10.0) -> None:
        """End every process in ``host``: SIGTERM, then SIGKILL after ``grace`` seconds (0: SIGKILL at once, as a
        host that loses power)."""
        steps = ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)) if grace else ((signal.SIGKILL, 5.0),)
        for sig, wait in steps:
            for pid in self.pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while self.pids(host) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.pids(host):
                return

    def remove_host(self, host: str) -> None:
        self.kill(host)
        _ip("netns", "del", self.namespace(host), check=False)  # its end of the veth pair goes with it
        _ip("link", "del", f"{self.prefix}{host}h", check=False)

    def remove_all(self) -> None:
        for host in self.hosts():
            self.remove_host(host)
        _ip("link", "del", self.bridge, check=False)

    def command(self, host: str, args: list[str]) -> list[str]:
        """``args`` run in ``host``."""
        return ["ip", "netns", "exec", self.namespace(host), *args]
