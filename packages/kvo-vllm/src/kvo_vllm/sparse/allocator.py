"""Contiguous row ranges of the host pool, one per request, allocated first fit in blocks.

A request's rows are one contiguous range (its indexer keys too, at the same rows on the
device), so a request's history is a plain slice: no gather before the indexer, and a transfer
engine fills it with one region per layer. The range is reserved for the request's whole
budget at admission, so a request that does not fit is refused then, never overwritten later.
"""

from __future__ import annotations

import bisect

import attrs

from kvo_core.errors import ConfigError


@attrs.frozen
class RowRange:
    """Rows ``[start, start + rows)`` of every layer's region of the pool."""

    start: int
    rows: int

    @property
    def end(self) -> int:
        return self.start + self.rows


class RowRangeAllocator:
    """First-fit allocation of whole blocks; freed ranges merge with free neighbours.

    Deterministic: the same sequence of calls gives the same ranges, which is what lets every TP
    rank of a DP rank compute the placement rank 0 writes to without asking it.
    """

    def __init__(self, total_blocks: int, block_size: int) -> None:
        for name, value in (("total_blocks", total_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        self.block_size = block_size
        self.total_blocks = total_blocks
        self._free_starts: list[int] = [0]           # sorted block starts of free extents
        self._free_sizes: dict[int, int] = {0: total_blocks}

    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.block_size)

    @property
    def free_rows(self) -> int:
        return sum(self._free_sizes.values()) * self.block_size

    @property
    def largest_free_rows(self) -> int:
        return max(self._free_sizes.values(), default=0) * self.block_size

    def allocate(self, rows: int) -> RowRange | None:
        """The first free range of ``ceil(rows / block_size)`` blocks, or None if none fits."""
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise ConfigError(f"rows must be an integer >= 1, got {rows!r}")
        need = self.blocks_for(rows)
        for start in self._free_starts:
            size = self._free_sizes[start]
            if size < need:
                continue
            self._free_starts.remove(start)
            del self._free_sizes[start]
            if size > need:
                self._insert(start + need, size - need)
            return RowRange(start * self.block_size, need * self.block_size)
        return None

    def free(self, taken: RowRange) -> None:
        """Give a range back (it must be one this allocator handed out and not yet freed)."""
        start, size = taken.start // self.block_size, taken.rows // self.block_size
        i = bisect.bisect_left(self._free_starts, start)
        before = self._free_starts[i - 1] if i > 0 else None
        after = self._free_starts[i] if i < len(self._free_starts) else None
        if ((before is not None and before + self._free_sizes[before] > start)
                or (after is not None and start + size > after)
                or start + size > self.total_blocks):
            raise ConfigError(f"range {taken} overlaps free space: freed twice or never taken")
        if after is not None and start + size == after:
            size += self._free_sizes.pop(after)
            self._free_starts.remove(after)
        if before is not None and before + self._free_sizes[before] == start:
            self._free_sizes[before] += size
            return
        self._insert(start, size)

    def _insert(self, start: int, size: int) -> None:
        bisect.insort(self._free_starts, start)
        self._free_sizes[start] = size
