"""Host staging for layer saves: the save leaves the forward's critical path.

Without staging a layer's save puts straight from its device buffer, so the buffer's slot stays
closed until the store has the bytes (a store put is far slower than a memory copy, one RPC
pair per layer, all while the forward runs on the same CPUs). With staging, the forward's
thread copies the layer's new blocks into a registered host area right after its attention
(memmove speed, no other thread involved) and releases the slot at once; the step's staged
blocks are then put in one batch after the forward (``savers.StagedSaver``), and the
next step waits for that batch before it loads anything.

The area is a bump allocator reset between steps (only once the previous batch is in the
store). A layer that does not fit is saved directly from its buffer, as without staging.

The last layer of each buffer in the forward is not copied: nothing in the step overwrites it,
so the batched put reads it from the buffer, whose slot stays closed until the put ends
(``savers.HeldSlot``). The next step writes the buffer only after waiting for that put.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvo_core.errors import ConfigError


def block_rows(tensor: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """A uint8 [blocks, block_bytes] view of a block-major cache (as the store addresses it)."""
    storage = tensor.untyped_storage()
    offset = tensor.storage_offset() * tensor.element_size()
    blocks = (storage.nbytes() - offset) // block_bytes
    rows = torch.empty(0, dtype=torch.uint8)
    rows.set_(storage, offset, (blocks, block_bytes))
    return rows


PARALLEL_COPY_BYTES = 512 << 10
"""Runs at least this long are copied by torch (the forward's OpenMP threads share the work),
shorter ones by one ``memmove``: the crossover where torch's threads beat one memmove
(measurements: docs/benchmarks.md, "Measurements behind code choices")."""


class SaveStaging:
    """A registered host area that layer saves are copied into (module docstring)."""

    def __init__(self, capacity: int, *, min_bytes: int) -> None:
        if capacity < min_bytes:
            raise ConfigError(
                f"save_staging_bytes={capacity} cannot hold one block of the largest layer "
                f"({min_bytes} bytes); allowed: 0 (no staging) or >= {min_bytes}")
        self.capacity = capacity
        self.area = torch.empty(capacity, dtype=torch.uint8)
        self.pointer: int = self.area.data_ptr()
        self._used = 0

    def reserve(self, nbytes: int) -> int | None:
        """Offset of ``nbytes`` free bytes, or None when the area is full for this step."""
        if self._used + nbytes > self.capacity:
            return None
        offset, self._used = self._used, self._used + nbytes
        return offset

    def reset(self) -> None:
        """Free the whole area: only once nothing staged is still being put."""
        self._used = 0

    def gather(self, rows: torch.Tensor, runs: Sequence[tuple[int, int]], offset: int) -> int:
        """Copy the blocks of ``runs`` (``block_runs``) of ``rows`` to ``offset``, in order;
        the address of the first copied block. A step's saves are the same blocks in every
        layer, so their runs are found once per step.

        One copy per run of consecutive blocks: a ``memmove`` (it releases the GIL), or for a
        long run (``PARALLEL_COPY_BYTES``) a torch copy, which the forward's OpenMP threads
        share. Only ever on the forward's thread: a torch copy on another thread during the
        forward starts an OpenMP team of that thread's own that spins against the forward's
        (it cost more TTFT than the copy itself: docs/benchmarks.md).
        """
        width = int(rows.shape[1])
        limit = int(rows.shape[0])
        end = offset + sum(length for _, length in runs) * width
        if not 0 <= offset <= end <= self.capacity:
            raise ValueError(f"staging gather of {(end - offset) // width} x {width} bytes at "
                             f"offset {offset} does not fit the {self.capacity}-byte area")
        source, target = rows.data_ptr(), offset
        for first, length in runs:
            if first < 0 or first + length > limit:
                raise IndexError(f"staging gather: blocks {first}..{first + length - 1} are "
                                 f"outside the cache's {limit} blocks")
            nbytes = length * width
            if nbytes >= PARALLEL_COPY_BYTES and torch.get_num_threads() > 1:
                self.area[target:target + nbytes].view(length, width).copy_(
                    rows[first:first + length])
            else:
                ctypes.memmove(self.pointer + target, source + first * width, nbytes)
            target += nbytes
        return self.pointer + offset


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``block_ids`` as (first id, count) runs of consecutive ids, in order."""
    if block_ids and block_ids[-1] - block_ids[0] == len(block_ids) - 1 and list(
            block_ids) == list(range(block_ids[0], block_ids[-1] + 1)):
        return [(block_ids[0], len(block_ids))]  # one run (compared in C, not id by id)
    runs: list[tuple[int, int]] = []
    for block in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block, 1))
    return runs


class PendingPuts:
    """Staged batches not yet in one store client, for readers in this process.

    Owned with the client it counts for (``store_client.SharedStore``): the scheduler half
    shares the worker's store client when both run in one process, and its prefix lookup waits
    for these first, so a prompt that just ran is found in the store (without the wait it would
    be a miss: correct, only slower). Workers in other processes are not waited for.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._futures: list[Future[Any]] = []

    def add(self, future: Future[Any]) -> None:
        with self._lock:
            self._futures.append(future)
        future.add_done_callback(self._drop)

    def wait(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the pending batches; errors are the saver's to
        handle (it poisons the keys)."""
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            try:
                future.result(timeout=timeout_s)
            except Exception:  # failed or late: the lookup then sees the store as it is
                return

    def _drop(self, future: Future[Any]) -> None:
        with self._lock:
            if future in self._futures:
                self._futures.remove(future)
