"""Shared fixtures for kvo-transport's tests.

- ``needs_loopback_netns`` marker: Mooncake binds every interface, so tests that start it only
  run inside a private network namespace with nothing but loopback (nox sets KVO_IN_NETNS=1).
- A session check that no kvo shared-memory segment is left in /dev/shm after the suite.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHM_DIR = Path("/dev/shm")
KVO_SHM_PREFIX = "kvo-"
NETNS_SKIP_REASON = (
    "starts listeners that bind all interfaces (Mooncake, MemFabric): run inside a "
    "loopback-only network namespace "
    "(nox -s transport does; by hand: unshare -n sh -c 'ip link set lo up; KVO_IN_NETNS=1 "
    "python -m pytest ...')"
)


def non_loopback_interfaces_up() -> list[str]:
    """Network interfaces other than lo whose IFF_UP flag is set."""
    up = []
    for iface in sorted(Path("/sys/class/net").glob("*")):
        if iface.name == "lo":
            continue
        try:
            flags = int((iface / "flags").read_text().strip(), 16)
        except (OSError, ValueError):
            continue
        if flags & 0x1:
            up.append(iface.name)
    return up


def in_loopback_namespace() -> bool:
    return os.environ.get("KVO_IN_NETNS") == "1" or not non_loopback_interfaces_up()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "needs_loopback_netns: starts Mooncake/MemFabric; skipped outside a loopback-only netns",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if in_loopback_namespace():
        return
    skip = pytest.mark.skip(reason=NETNS_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("needs_loopback_netns") is not None:
            item.add_marker(skip)


def kvo_shm_segments() -> set[str]:
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(KVO_SHM_PREFIX)}


def _owned_by_another_live_process(name: str) -> bool:
    """A segment whose name carries the pid of a live process other than this one (a same-host
    registry ``kvo-samehost-<pid>-...``, a DSA pool ``kvo-hostpool-dsa-<pid>-<n>``) belongs to
    a concurrent run (another test session on this machine), not to a leak here."""
    digits = [part for part in name.split("-")[2:] if part.isdigit()]
    if not digits:
        return False
    pid = int(digits[0])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory() -> object:
    """Fail the session if the tests leave kvo segments in /dev/shm."""
    before = kvo_shm_segments()
    yield
    leaked = sorted(name for name in kvo_shm_segments() - before
                    if not _owned_by_another_live_process(name))
    assert not leaked, f"kvo shared-memory segments leaked in {SHM_DIR}: {leaked}"
