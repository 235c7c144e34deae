"""Same-host transfers: a TransferEngine wrapper that copies straight between two processes.

When prefill and decode run on one machine, Mooncake's tcp path over loopback moves several
times less than a memory copy (docs/benchmarks.md). Linux's ``process_vm_readv`` /
``process_vm_writev`` copy between two address spaces in one system call: no socket, no
intermediate buffer. ``SameHostEngine`` keeps an inner engine (Mooncake) for every peer it
cannot reach that way and picks the direct path per peer, automatically:

- its session id is the inner engine's plus ``" samehost=<host>/<pid>/<start>/<registry>"``,
  where ``<host>`` names the kernel (boot id), pid and network namespace, ``<start>`` the
  process's start time (a reused pid does not pass) and ``<registry>`` a 0600 file under
  /dev/shm in which this process lists the regions it registered;
- a read or write goes direct only if the peer's ``<host>`` equals ours, its pid still has the
  recorded start time and its registry file is visible here; every remote range must lie in a
  region the peer registered (else TransferArgumentError, nothing copied): the contract of the
  other backends. Otherwise the inner engine serves the call with the inner session id. If the
  kernel refuses the call (EPERM: ptrace access needs the same uid or CAP_SYS_PTRACE), that peer
  goes to the inner engine from then on, logged once.

Failure: the system call is synchronous; when it returns or raises, no byte of the batch is
still in flight (unlike a failed Mooncake batch), so a failed batch's local ranges may be reused
at once. A short copy (the peer unmapped a range) raises TransferError naming the descriptor.
Reuse of the source while the copy runs is the fence's business (a per-slot epoch read after the
data), exactly as for the other engines.
"""

from __future__ import annotations

import array
import ctypes
import errno
import json
import logging
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kvo_transport.engine import SAME_HOST_MARK as MARK
from kvo_transport.engine import DelegatingEngine, TransferEngine
from kvo_transport.errors import TransferArgumentError, TransferError
from kvo_transport.regions import MemoryRegion, RegionRegistry, TransferBatch

log = logging.getLogger("kvo.transport.samehost")

REGISTRY_DIR = Path("/dev/shm")
IOV_MAX = 1024
"""Linux's limit of iovec entries per process_vm_* call; longer batches take several calls."""


def host_key() -> str:
    """Same value in two processes iff they share a kernel boot, a pid and a network namespace.

    The pid namespace makes the peer's pid meaningful here; the network namespace keeps
    processes that were given separate network stacks (containers, or the separate "hosts" of
    the multi-host e2e test) on the network path, as separate hosts would be.
    """
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")
    pid_ns, net_ns = (os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("pid", "net"))
    return f"{boot}.{pid_ns}.{net_ns}"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


@attrs.frozen
class PeerAddress:
    """A peer's same-host coordinates, parsed from its session id."""

    host: str
    pid: int
    start: int
    registry: Path

    def render(self) -> str:
        return f"{MARK}{self.host}/{self.pid}/{self.start}/{self.registry.name}"


def split_session_id(session_id: str) -> tuple[str, PeerAddress | None]:
    """(the inner engine's session id, the same-host address if the id carries one)."""
    inner, mark, tail = session_id.partition(MARK)
    if not mark:
        return session_id, None
    parts = tail.split("/")
    if (len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit()
            or not parts[3].startswith("kvo-samehost-") or "\0" in parts[3]):
        raise TransferArgumentError(
            f"peer {session_id!r}: malformed same-host part {tail!r}; expected "
            "<host>/<pid>/<start>/kvo-samehost-<name>")
    return inner, PeerAddress(parts[0], int(parts[1]), int(parts[2]), REGISTRY_DIR / parts[3])


_libc = ctypes.CDLL(None, use_errno=True)
# pid, local iovec array (iov_base, iov_len pairs of u64), count, remote array, count, flags
_SYSCALL_ARGS = (ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                 ctypes.c_ulong)
_process_vm_readv = _libc.process_vm_readv
_process_vm_readv.argtypes = _SYSCALL_ARGS
_process_vm_readv.restype = ctypes.c_ssize_t
_process_vm_writev = _libc.process_vm_writev
_process_vm_writev.argtypes = _SYSCALL_ARGS
_process_vm_writev.restype = ctypes.c_ssize_t


class DirectCopyRefused(TransferError):
    """The kernel refused the direct copy for lack of permission (the peer goes to the inner
    engine)."""


def copy_between(pid: int, batch: TransferBatch, read: bool) -> None:
    """Copy every descriptor of ``batch`` between us and process ``pid``, IOV_MAX at a time."""
    call = _process_vm_readv if read else _process_vm_writev
    n = len(batch.lengths)
    for first in range(0, n, IOV_MAX):
        last = min(first + IOV_MAX, n)
        local = array.array("Q")
        remote = array.array("Q")
        for i in range(first, last):
            local.extend((batch.local_addrs[i], batch.lengths[i]))
            remote.extend((batch.remote_addrs[i], batch.lengths[i]))
        count = last - first
        want = sum(batch.lengths[first:last])
        done = call(pid, local.buffer_info()[0], count, remote.buffer_info()[0], count, 0)
        if done == want:
            continue
        err = ctypes.get_errno() if done < 0 else 0
        if err == errno.EPERM:
            raise DirectCopyRefused(f"the kernel refused process_vm_{'readv' if read else 'writev'}"
                                    f" on pid {pid} (EPERM: needs the same uid or CAP_SYS_PTRACE)")
        failed_at = first + _descriptor_at(batch.lengths[first:last], max(done, 0))
        what = os.strerror(err) if err else f"short copy: {done} of {want} bytes"
        raise TransferError(
            f"same-host {'read from' if read else 'write to'} pid {pid} failed at descriptor "
            f"{failed_at} (local {batch.local_addrs[failed_at]:#x}, remote "
            f"{batch.remote_addrs[failed_at]:#x}, {batch.lengths[failed_at]} bytes): {what}; "
            f"{batch.describe()}")


def _descriptor_at(lengths: Sequence[int], copied: int) -> int:
    """Index of the descriptor in which a copy of ``copied`` bytes stopped."""
    for i, length in enumerate(lengths):
        if copied < length:
            return i
        copied -= length
    return len(lengths) - 1


def _remove_registries_of_dead_processes() -> None:
    """A killed process cannot remove its registry file; the next engine on the host does."""
    for path in REGISTRY_DIR.glob("kvo-samehost-*"):
        pid = path.name.split("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, another user's


def _free_bytes(directory: Path) -> int | str:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return "unknown"
    return stat.f_bavail * stat.f_frsize


class _Registry:
    """This process's registered regions, published in a 0600 file for same-host peers."""

    def __init__(self) -> None:
        _remove_registries_of_dead_processes()
        self.path = REGISTRY_DIR / f"kvo-samehost-{os.getpid()}-{secrets.token_hex(6)}"
        self.regions: dict[int, int] = {}
        self._publish()

    def _publish(self) -> None:
        """Replace the file with the regions now; when that fails (e.g. /dev/shm full), the
        file keeps its previous list and the half-written copy is removed."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump(sorted(self.regions.items()), out)
            os.replace(tmp, self.path)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise TransferError(
                f"same-host engine: cannot write its region list {self.path} "
                f"({error.strerror or error}; {_free_bytes(REGISTRY_DIR)} bytes free in "
                f"{REGISTRY_DIR}): give {REGISTRY_DIR} room (Docker: --shm-size) or free some"
            ) from error

    def add(self, ptr: int, length: int) -> None:
        previous = self.regions.get(ptr)
        self.regions[ptr] = length
        try:
            self._publish()
        except TransferError:
            if previous is None:
                del self.regions[ptr]
            else:
                self.regions[ptr] = previous
            raise

    def remove(self, ptr: int) -> None:
        length = self.regions.pop(ptr, None)
        try:
            self._publish()
        except TransferError:
            # The file still lists the region: keep it registered, so both views agree.
            if length is not None:
                self.regions[ptr] = length
            raise

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


class _PeerRegions:
    """A peer's published regions, re-read when its registry file changes."""

    def __init__(self) -> None:
        self._cache: dict[Path, tuple[tuple[int, int], RegionRegistry]] = {}

    def of(self, address: PeerAddress) -> RegionRegistry | None:
        try:
            stat = address.registry.stat()
            key = (stat.st_ino, stat.st_mtime_ns)
            cached = self._cache.get(address.registry)
            if cached is not None and cached[0] == key:
                return cached[1]
            pairs = json.loads(address.registry.read_text())
        except (OSError, ValueError):
            return None
        registry = RegionRegistry()
        for ptr, length in pairs:
            registry.add(ptr, length)
        self._cache[address.registry] = (key, registry)
        return registry


def check_remote_ranges(remote: RegionRegistry, batch: TransferBatch, pid: int) -> None:
    """Every remote range must lie in one region the peer registered; else nothing is copied."""
    low = min(batch.remote_addrs)
    high = max(a + n for a, n in zip(batch.remote_addrs, batch.lengths, strict=True))
    if remote.find(low, high - low) is not None:  # the whole batch in one region: done
        return
    for i, (addr, length) in enumerate(zip(batch.remote_addrs, batch.lengths, strict=True)):
        if remote.find(addr, length) is None:
            known = ", ".join(str(r) for r in remote.regions()) or "none"
            raise TransferArgumentError(
                f"descriptor {i}: remote range {MemoryRegion(addr, length)} is not inside memory "
                f"that peer pid {pid} registered (registered: {known})")


class SameHostEngine(DelegatingEngine):
    """A TransferEngine that copies directly to/from same-host peers (see the module docstring).

    ``backend`` and ``protocol`` are the inner engine's (DelegatingEngine), so handshakes
    compare as before.
    """

    def __init__(self, inner: TransferEngine) -> None:
        if ctypes.sizeof(ctypes.c_void_p) != 8 or ctypes.sizeof(ctypes.c_size_t) != 8:
            raise TransferError("the same-host engine builds 64-bit iovecs: a 64-bit host only")
        super().__init__(inner)
        self._host = host_key()
        self._pid = os.getpid()
        start = start_time(self._pid)
        if start is None:
            raise TransferError("cannot read this process's start time from /proc")
        self._registry = _Registry()
        self._local = RegionRegistry()
        self._peers = _PeerRegions()
        self._refused: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._address = PeerAddress(self._host, self._pid, start, self._registry.path)
        self.direct_bytes = 0
        """Bytes copied directly (read or written) so far; the rest went through ``inner``."""

    @property
    def session_id(self) -> str:
        return self._engine.session_id + self._address.render()

    def register(self, ptr: int, length: int) -> None:
        self._check_open()
        with self._lock:
            self._engine.register(ptr, length)
            self._local.add(ptr, length)
            try:
                self._registry.add(ptr, length)
            except TransferError:  # peers would not see it: register nothing
                self._local.remove(ptr)
                self._engine.unregister(ptr)
                raise

    def unregister(self, ptr: int) -> None:
        self._check_open()
        with self._lock:
            self._registry.remove(ptr)
            self._local.remove(ptr)
            self._engine.unregister(ptr)

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        self._transfer(True, peer, local_addrs, remote_addrs, lengths)

    def write(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        self._transfer(False, peer, local_addrs, remote_addrs, lengths)

    def direct_to(self, peer: str) -> bool:
        """Whether calls to ``peer`` take the direct path now (for logs and tests)."""
        _, address = split_session_id(peer)
        return address is not None and self._reachable(address) is not None

    def _reachable(self, address: PeerAddress) -> RegionRegistry | None:
        if (address.host != self._host or address.pid in self._refused
                or start_time(address.pid) != address.start):
            return None
        return self._peers.of(address)

    def _transfer(self, read: bool, peer: str, local_addrs: Sequence[int],
                  remote_addrs: Sequence[int], lengths: Sequence[int]) -> None:
        self._check_open()
        inner_peer, address = split_session_id(peer)
        remote = self._reachable(address) if address is not None else None
        if address is None or remote is None:
            call = self._engine.read if read else self._engine.write
            call(inner_peer, local_addrs, remote_addrs, lengths)
            return
        batch = self._local.check_batch(peer, local_addrs, remote_addrs, lengths)
        check_remote_ranges(remote, batch, address.pid)
        try:
            copy_between(address.pid, batch, read)
            self.direct_bytes += batch.total_bytes
        except DirectCopyRefused as refused:
            log.warning("%s; using the %s engine for pid %d from now on", refused,
                        self._engine.backend, address.pid)
            self._refused.add(address.pid)
            call = self._engine.read if read else self._engine.write
            call(inner_peer, local_addrs, remote_addrs, lengths)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"same-host engine {self.session_id} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._registry.close()
        self._engine.close()

    def __enter__(self) -> SameHostEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SameHostEngine({self.session_id}, {len(self._local)} regions)"
