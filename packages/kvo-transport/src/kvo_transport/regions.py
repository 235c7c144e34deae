"""Bookkeeping of registered memory and validation of transfer batches.

Transfer engines are C++ libraries: a descriptor that points outside registered memory, a
negative length or mismatched lists end in a crash, a hang or a bare -1. Every backend checks
its batches here first, so bad input fails at the boundary with an error naming the bad value.
"""

from __future__ import annotations

import bisect
import operator
import threading
from collections.abc import Sequence

import attrs

from kvo_transport.errors import TransferArgumentError


@attrs.frozen
class MemoryRegion:
    """One registered range [ptr, ptr + length)."""

    ptr: int
    length: int

    @property
    def end(self) -> int:
        return self.ptr + self.length

    def __str__(self) -> str:
        return f"[{self.ptr:#x}, {self.end:#x})"


@attrs.frozen
class TransferBatch:
    """A validated batch: three equally long lists of plain ints, ready for the C++ call."""

    peer: str
    local_addrs: list[int]
    remote_addrs: list[int]
    lengths: list[int]

    @property
    def total_bytes(self) -> int:
        return sum(self.lengths)

    def describe(self) -> str:
        return f"peer {self.peer!r}, {len(self.lengths)} descriptors, {self.total_bytes} bytes"


def int_list(
    values: Sequence[int], what: str, error: type[Exception] = TransferArgumentError
) -> list[int]:
    """Plain ints for a pybind call; rejects floats, None and other non-integers by name."""
    try:
        return list(map(operator.index, values))
    except TypeError as exc:
        raise error(f"{what} must be a sequence of integers: {exc}") from None


class RegionRegistry:
    """Registered local regions, sorted by start address; thread-safe."""

    def __init__(self, error: type[Exception] = TransferArgumentError) -> None:
        self._error = error
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._regions: list[MemoryRegion] = []

    def add(self, ptr: int, length: int) -> MemoryRegion:
        """Record a region; reject null pointers, non-positive lengths and overlaps."""
        ptr, length = operator.index(ptr), operator.index(length)
        if ptr <= 0:
            raise self._error(f"cannot register pointer {ptr:#x}: it must be > 0")
        if length <= 0:
            raise self._error(
                f"cannot register {length} bytes at {ptr:#x}: length must be > 0"
            )
        region = MemoryRegion(ptr, length)
        with self._lock:
            i = bisect.bisect_left(self._starts, ptr)
            for neighbour in self._regions[max(i - 1, 0) : i + 1]:
                if neighbour.ptr < region.end and region.ptr < neighbour.end:
                    raise self._error(
                        f"cannot register {region}: it overlaps the registered region {neighbour}"
                    )
            self._starts.insert(i, ptr)
            self._regions.insert(i, region)
        return region

    def remove(self, ptr: int) -> MemoryRegion:
        """Forget the region that starts exactly at ``ptr``."""
        ptr = operator.index(ptr)
        with self._lock:
            i = bisect.bisect_left(self._starts, ptr)
            if i == len(self._starts) or self._starts[i] != ptr:
                known = ", ".join(str(r) for r in self._regions) or "none"
                raise self._error(
                    f"no registered region starts at {ptr:#x}; registered: {known}"
                )
            del self._starts[i]
            return self._regions.pop(i)

    def regions(self) -> tuple[MemoryRegion, ...]:
        with self._lock:
            return tuple(self._regions)

    def __len__(self) -> int:
        return len(self._regions)

    def find(self, addr: int, length: int) -> MemoryRegion | None:
        """The registered region holding all of [addr, addr + length), if any."""
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            region = self._regions[i]
        return region if addr + length <= region.end else None

    def check_batch(
        self,
        peer: str,
        local_addrs: Sequence[int],
        remote_addrs: Sequence[int],
        lengths: Sequence[int],
    ) -> TransferBatch:
        """Validate one batch against the registered local regions.

        Remote addresses can only be checked by the peer's engine; local ones are checked here.
        """
        if not isinstance(peer, str) or not peer:
            raise TransferArgumentError(f"peer must be a non-empty session id string, got {peer!r}")
        local = int_list(local_addrs, "local_addrs")
        remote = int_list(remote_addrs, "remote_addrs")
        sizes = int_list(lengths, "lengths")
        if not (len(local) == len(remote) == len(sizes)):
            raise TransferArgumentError(
                f"descriptor lists differ in length: {len(local)} local_addrs, "
                f"{len(remote)} remote_addrs, {len(sizes)} lengths (peer {peer!r})"
            )
        if not sizes:
            raise TransferArgumentError(f"empty transfer batch for peer {peer!r}")
        if min(remote) <= 0:
            i = next(i for i, raddr in enumerate(remote) if raddr <= 0)
            raise TransferArgumentError(
                f"descriptor {i}: remote address {remote[i]:#x} is not > 0 (peer {peer!r})"
            )
        self.check_ranges(local, sizes, f"peer {peer!r}")
        return TransferBatch(peer, local, remote, sizes)

    def check_ranges(
        self,
        addrs: list[int],
        sizes: list[int],
        context: str,
    ) -> None:
        """Every [addrs[i], addrs[i] + sizes[i]) must be non-empty and inside one region."""
        if sizes and min(sizes) > 0:
            # Fast path (C builtins only): the whole span of the batch lies in one region.
            low = min(addrs)
            high = max(map(operator.add, addrs, sizes))
            with self._lock:
                j = bisect.bisect_right(self._starts, low) - 1
                if j >= 0 and high <= self._regions[j].end:
                    return
        error = self._error
        with self._lock:
            starts, regions = self._starts, self._regions
            for i, (addr, size) in enumerate(zip(addrs, sizes, strict=True)):
                if size <= 0:
                    raise error(f"descriptor {i}: length {size} is not > 0 ({context})")
                j = bisect.bisect_right(starts, addr) - 1
                if j < 0 or addr + size > regions[j].end:
                    known = ", ".join(str(r) for r in regions) or "none"
                    raise error(
                        f"descriptor {i}: local range [{addr:#x}, {addr + size:#x}) is not inside "
                        f"registered memory (registered: {known}; {context})"
                    )
