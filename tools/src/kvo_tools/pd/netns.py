"""Separate "hosts" for the P/D deployment: network namespaces joined by veth pairs to a bridge.

Used by the beyond-loopback end-to-end test: prefill, decode, the Mooncake master and the proxy
each run in a network namespace of their own with one address on 10.77.0.0/24, so every hop
between them crosses a real (virtual) network link instead of loopback. The bridge lives in the
CALLER's network namespace, which must be a private one (nox's loopback-only namespace,
``KVO_IN_NETNS=1``): nothing is created in the machine's own namespace, and only addresses of
these hosts are used. Needs root and iproute2. ``VirtualHosts`` removes everything it created on
exit, also after a failure; names carry the creator's pid, so leftovers of a killed run are
recognisable (``remove_stale`` deletes those whose creator is gone).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import Sequence

import attrs

SUBNET = "10.77.0"
BRIDGE_ADDRESS = f"{SUBNET}.254"
PREFIX = "kvo77-"


class NetnsError(RuntimeError):
    """The namespaces cannot be set up here; the message says why."""


def why_unavailable() -> str | None:
    """Why virtual hosts cannot be made in this process, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns add, veth pairs)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip command"
    if os.environ.get("KVO_IN_NETNS") != "1":
        return ("must run inside a private network namespace (KVO_IN_NETNS=1, as nox -s e2e "
                "does), so that the bridge is not created in the machine's own namespace")
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


def remove_stale() -> list[str]:
    """Delete kvo77 namespaces whose creating process is gone; their names."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             timeout=30).stdout
    removed = []
    for name in re.findall(rf"^({PREFIX}(\d+)-\S+)", listing, flags=re.M):
        namespace, pid = name[0], int(name[1])
        if not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(NetnsError):
                _ip("netns", "del", namespace)
                removed.append(namespace)
    return removed


@attrs.define
class VirtualHosts:
    """Namespaces named ``kvo77-<pid>-<host>`` with ``10.77.0.<n>``; use as a context manager."""

    hosts: Sequence[str]
    bridge: str = "kvo77br"
    addresses: dict[str, str] = attrs.Factory(dict)
    namespaces: dict[str, str] = attrs.Factory(dict)
    _created_bridge: bool = False

    def __enter__(self) -> VirtualHosts:
        problem = why_unavailable()
        if problem is not None:
            raise NetnsError(problem)
        remove_stale()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self) -> None:
        pid = os.getpid()
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created_bridge = True
        _ip("addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for number, host in enumerate(self.hosts, start=1):
            namespace = f"{PREFIX}{pid}-{host}"
            inside, outside = f"k{pid % 100000}i{number}", f"k{pid % 100000}o{number}"
            _ip("netns", "add", namespace)
            self.namespaces[host] = namespace
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("-n", namespace, "link", "set", inside, "name", "eth0")
            address = f"{SUBNET}.{number}"
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            self.addresses[host] = address

    def exec_prefix(self, host: str) -> list[str]:
        """Prepend to a command to run it on ``host``."""
        return ["ip", "netns", "exec", self.namespaces[host]]

    def close(self) -> None:
        """Delete every namespace (its veth end goes with it, and the peer) and the bridge."""
        for namespace in self.namespaces.values():
            with contextlib.suppress(NetnsError):
                _ip("netns", "del", namespace)
        self.namespaces.clear()
        if self._created_bridge:
            with contextlib.suppress(NetnsError):
                _ip("link", "del", self.bridge)
            self._created_bridge = False
