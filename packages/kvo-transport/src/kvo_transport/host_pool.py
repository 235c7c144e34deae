"""Page-aligned POSIX shared host memory for one decode DP rank.

TP rank 0 creates the pool under a name; the other TP ranks of the same DP rank attach to it by
that name, so they all see (and the transfer engine fills) one copy of the main-KV history.
The segment lives in /dev/shm as ``kvo-hostpool-<name>``. The creator unlinks it on close, when
the pool object is collected, and at process exit; attachers only unmap.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import threading
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
_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")


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


def _map_shared(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _unlink_if_creator(path: Path, creator_pid: int) -> None:
    # A forked child inherits the object; only the creating process may remove the name.
    if os.getpid() == creator_pid:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


class HostPool:
    """One mapping of a named shared-memory segment; use create() or attach()."""

    def __init__(
        self, name: str, path: Path, mapping: mmap.mmap, nbytes: int, creator: bool
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
        self._finalizer = weakref.finalize(self, _unlink_if_creator, path, pid if creator else -1)

    @classmethod
    def create(cls, name: str, nbytes: int) -> HostPool:
        """Create ``name`` with at least ``nbytes`` (rounded up to whole pages), zero-filled."""
        path = shm_path(name)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise HostPoolError(
                f"host pool {name!r}: nbytes must be a positive int, got {nbytes!r}"
            )
        size = round_to_pages(nbytes)
        if not SHM_DIR.is_dir():
            raise HostPoolError(f"host pools need POSIX shared memory at {SHM_DIR}; it is missing")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise HostPoolError(
                f"host pool {name!r} already exists ({path}); another process owns it or a "
                "crashed run leaked it (remove the file if no process uses it)"
            ) from None
        try:
            os.ftruncate(fd, size)
            mapping = _map_shared(fd, size)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise HostPoolError(f"cannot create host pool {name!r} of {size} bytes: {exc}") from exc
        os.close(fd)
        return cls(name, path, mapping, size, creator=True)

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
            size = os.fstat(fd).st_size
            if nbytes is not None and round_to_pages(nbytes) != size:
                raise HostPoolError(
                    f"host pool {name!r} has {size} bytes, expected {round_to_pages(nbytes)} "
                    f"({nbytes} rounded up to {PAGE_SIZE}-byte pages)"
                )
            if size == 0:
                raise HostPoolError(f"host pool {name!r} is empty (its creator did not size it)")
            mapping = _map_shared(fd, size)
        finally:
            os.close(fd)
        return cls(name, path, mapping, size, creator=False)

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
