"""Page-aligned POSIX shared host memory for one decode DP rank.

TP rank 0 creates the pool under a name; the other TP ranks of the same DP rank attach to it by
that name, so they all see (and the transfer engine fills) one copy of the main-KV history.
The segment lives in /dev/shm as ``kvo-hostpool-<name>``. The creator unlinks it on close, when
the pool object is collected, and at process exit; attachers only unmap. A creator killed
outright (SIGKILL, OOM) cannot unlink: every user holds a shared flock on the segment, which the
kernel drops when the process dies, so the next ``create`` of that name removes a segment nobody
locks, and refuses, naming the holders, one that is still in use. Pools named per process (the
DSA offload backend's) are never created again under the same name, so every ``create`` also
sweeps segments of any name that nobody locks and that are older than ``ORPHAN_MIN_AGE_S``
(a vLLM server stopped by a signal exits without running finalizers: tens of MiB per restart
would otherwise stay in /dev/shm until reboot). ``create`` reserves every page of the segment
(``posix_fallocate``), so a /dev/shm too small for the pool fails there, naming the bytes needed
and free, rather than killing the process with SIGBUS when the pages are first touched.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import mmap
import os
import re
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from kvo_core.errors import KvoError
from kvo_transport.errors import HostPoolError

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "kvo-hostpool-"
PAGE_SIZE = mmap.PAGESIZE
log = logging.getLogger("kvo.transport.host_pool")
ORPHAN_MIN_AGE_S = 60.0
"""A segment younger than this is never swept: its creator may not hold its lock yet."""
_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")


def reclaim_orphaned_pools(min_age_s: float = ORPHAN_MIN_AGE_S) -> list[str]:
    """Remove kvo host-pool segments that no process holds and that are older than
    ``min_age_s`` (their creators died without closing them); returns their file names."""
    if not SHM_DIR.is_dir():
        return []
    removed = []
    now = time.time()
    for path in sorted(SHM_DIR.glob(f"{SHM_PREFIX}*")):
        try:
            stat = path.stat()
            if now - max(stat.st_mtime, stat.st_ctime) < min_age_s:
                continue
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # in use
        try:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)
        log.warning("host pool sweep: removed %s (%d bytes), left behind by a process that "
                    "ended without closing it (no process holds it)", path, stat.st_size)
        removed.append(path.name)
    return removed


class _Registrar(Protocol):
    def register(self, ptr: int, length: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


def shm_path(name: str) -> Path:
    """The /dev/shm file backing the pool called ``name`` (validated)."""
    if not isinstance(name, str) or not _NAME_PATTERN.fullmatch(name):
        raise HostPoolError(
            f"host pool name {name!r} is not allowed: use 1-200 characters from "
            "[A-Za-z0-9_.-], starting with a letter or digit"
        )
    return SHM_DIR / f"{SHM_PREFIX}{name}"


def round_to_pages(nbytes: int) -> int:
    return math.ceil(nbytes / PAGE_SIZE) * PAGE_SIZE


def _shm_too_small(name: str, size: int, detail: str, sized_by: str) -> HostPoolError:
    """The start-up error for a pool that /dev/shm cannot hold: what is needed, what is free,
    and the two settings that change it."""
    try:
        fs = os.statvfs(SHM_DIR)
        free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
        room = f"{free} bytes ({free / 2**20:.1f} MiB) free of {total} ({total / 2**20:.1f} MiB)"
    except OSError:
        room = "an unknown number of bytes free"
    return HostPoolError(
        f"host pool {name!r} needs {size} bytes ({size / 2**20:.1f} MiB) of shared memory in "
        f"{SHM_DIR}, which has {room} ({detail}): make the pool smaller ({sized_by}) or give "
        f"{SHM_DIR} more room (Docker: --shm-size; Kubernetes: an emptyDir with medium: Memory)"
    )


def _reserve(fd: int, name: str, size: int, sized_by: str) -> None:
    """Size the segment and reserve all of its pages now.

    A tmpfs hands out pages when they are first touched: a segment merely truncated to a size
    that /dev/shm cannot hold kills the process with SIGBUS much later, when the transfer engine
    or a copy reaches the missing pages. Reserving them here fails at start-up instead.
    """
    try:
        fs = os.statvfs(SHM_DIR)
    except OSError:
        fs = None
    if fs is not None and fs.f_blocks and size > fs.f_bavail * fs.f_frsize:
        raise _shm_too_small(name, size, "checked before reserving", sized_by)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        if exc.errno == errno.ENOSPC:
            raise _shm_too_small(name, size, "reserving its pages failed: no space",
                                 sized_by) from None
        # A file system without fallocate: size it, the pages come on first touch.
        os.ftruncate(fd, size)


def _map_shared(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _release(path: Path, creator_pid: int, lock_fd: int) -> None:
    """Unlink the name (the creator only: a forked child inherits the object), drop the lock."""
    if os.getpid() == creator_pid:
        path.unlink(missing_ok=True)
    try:
        os.close(lock_fd)
    except OSError:
        pass


def _lock_holders(fd: int) -> list[int]:
    """PIDs holding a lock on the file behind ``fd`` (from /proc/locks), for error messages."""
    stat = os.fstat(fd)
    inode = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    return sorted({int(f[4]) for f in map(str.split, lines)
                   if len(f) > 5 and f[5] == inode and f[4].isdigit()})


def _reclaim_if_orphaned(name: str, path: Path) -> None:
    """A segment of the same name exists: remove it if a crashed run left it, else refuse.

    Every process using a pool holds a shared flock on it for as long as it does, and the kernel
    drops that lock when the process dies, however it dies: a segment nobody locks is orphaned.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return  # gone meanwhile
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holders = _lock_holders(fd)
            raise HostPoolError(
                f"host pool {name!r} already exists ({path}) and is in use by process(es) "
                f"{holders or '(unknown)'}; use another name or stop them") from None
        log.warning("host pool %r: removing %s, left behind by a run that ended without "
                    "closing it (no process holds it)", name, path)
        path.unlink(missing_ok=True)
    finally:
        os.close(fd)


class HostPool:
    """One mapping of a named shared-memory segment; use create() or attach()."""

    def __init__(
        self, name: str, path: Path, mapping: mmap.mmap, nbytes: int, creator: bool,
        lock_fd: int,
    ) -> None:
        self._name = name
        self._path = path
        self._nbytes = nbytes
        self._creator = creator
        self._lock = threading.Lock()
        self._base: torch.Tensor | None = torch.frombuffer(mapping, dtype=torch.uint8)
        self._ptr: int = int(self._base.data_ptr())
        self._registered_with: list[_Registrar] = []
        # Dropping the last reference to the mmap object unmaps it; tensors viewing the pool keep
        # that reference, so memory is never unmapped under a live view.
        del mapping
        pid = os.getpid()
        self._finalizer = weakref.finalize(self, _release, path, pid if creator else -1, lock_fd)

    @classmethod
    def create(cls, name: str, nbytes: int, *, sized_by: str | None = None) -> HostPool:
        """Create ``name`` with at least ``nbytes`` (rounded up to whole pages), zero-filled.

        ``sized_by`` names the user's setting that decides ``nbytes``, for the error raised when
        /dev/shm cannot hold the pool.
        """
        path = shm_path(name)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise HostPoolError(
                f"host pool {name!r}: nbytes must be a positive int, got {nbytes!r}"
            )
        size = round_to_pages(nbytes)
        if not SHM_DIR.is_dir():
            raise HostPoolError(f"host pools need POSIX shared memory at {SHM_DIR}; it is missing")
        reclaim_orphaned_pools()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            _reclaim_if_orphaned(name, path)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # "in use" for as long as this process lives
            _reserve(fd, name, size, sized_by or f"the {nbytes} bytes asked of HostPool.create")
            mapping = _map_shared(fd, size)
        except HostPoolError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise HostPoolError(f"cannot create host pool {name!r} of {size} bytes: {exc}") from exc
        return cls(name, path, mapping, size, creator=True, lock_fd=fd)

    @classmethod
    def attach(cls, name: str, nbytes: int | None = None) -> HostPool:
        """Map an existing pool; if ``nbytes`` is given, its page-rounded size must match."""
        path = shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise HostPoolError(
                f"host pool {name!r} does not exist ({path}); TP rank 0 must create it first"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            size = os.fstat(fd).st_size
            if nbytes is not None and round_to_pages(nbytes) != size:
                raise HostPoolError(
                    f"host pool {name!r} has {size} bytes, expected {round_to_pages(nbytes)} "
                    f"({nbytes} rounded up to {PAGE_SIZE}-byte pages)"
                )
            if size == 0:
                raise HostPoolError(f"host pool {name!r} is empty (its creator did not size it)")
            mapping = _map_shared(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, path, mapping, size, creator=False, lock_fd=fd)

    @property
    def name(self) -> str:
        return self._name

    @property
    def path(self) -> Path:
        return self._path

    @property
    def ptr(self) -> int:
        """Start address of this process's mapping (page aligned; differs between processes)."""
        return self._ptr

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def is_creator(self) -> bool:
        return self._creator

    @property
    def closed(self) -> bool:
        return self._base is None

    def _require_base(self) -> torch.Tensor:
        base = self._base
        if base is None:
            raise HostPoolError(f"host pool {self._name!r} is closed")
        return base

    def view(
        self, dtype: torch.dtype, shape: Sequence[int], offset_bytes: int = 0
    ) -> torch.Tensor:
        """A tensor over [offset_bytes, offset_bytes + numel * itemsize) of the pool."""
        base = self._require_base()
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise HostPoolError(f"host pool {self._name!r}: negative dimension in shape {shape}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset_bytes < 0 or offset_bytes % itemsize:
            raise HostPoolError(
                f"host pool {self._name!r}: offset_bytes={offset_bytes} must be >= 0 and a "
                f"multiple of the {dtype} item size {itemsize}"
            )
        length = math.prod(shape) * itemsize
        if offset_bytes + length > self._nbytes:
            raise HostPoolError(
                f"host pool {self._name!r}: view of {length} bytes at offset {offset_bytes} "
                f"exceeds the pool's {self._nbytes} bytes"
            )
        return base[offset_bytes : offset_bytes + length].view(dtype).view(shape)

    def register_with(self, engine: _Registrar) -> None:
        """Register the whole pool with a transfer engine; close() unregisters it again."""
        self._require_base()
        engine.register(self._ptr, self._nbytes)
        with self._lock:
            self._registered_with.append(engine)

    def close(self) -> None:
        """Unregister from engines, unlink the name (creator) and drop this mapping.

        The mapping is unmapped as soon as no tensor views it any more; views made earlier keep
        their memory valid rather than dangling.
        """
        with self._lock:
            if self._base is None:
                return
            engines, self._registered_with = self._registered_with, []
            self._base = None
        for engine in engines:
            try:
                engine.unregister(self._ptr)
            except KvoError:
                pass  # the engine was closed first; its registrations are gone with it
        self._finalizer()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "creator" if self._creator else "attached"
        state = "closed" if self.closed else f"ptr={self._ptr:#x}"
        return f"HostPool({self._name!r}, {self._nbytes} bytes, {role}, {state})"


def leaked_segments() -> list[str]:
    """Names of kvo host-pool segments currently present in /dev/shm."""
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIX))
