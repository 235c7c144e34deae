"""Each offloaded layer's residency table and the buffers one update reads and writes.

The tables write their results into caller-owned tensors (no allocation per step); a layer's
results are read before its next update. The inputs are refilled per call through NumPy views
of the same memory (a PyTorch op's dispatch costs more than its work on a few hundred
indices)."""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import torch

from kvo_core.residency import RESULT_DTYPE, RequestState, ResidencyResult, ResidencyTableLike

_Ints: TypeAlias = torch.Tensor | np.ndarray


class LayerResidency:
    """Residency tables of ``layers`` layers for ``max_rows`` batch rows of ``capacity`` slots,
    each selecting at most ``row_width`` entries per row and call."""

    def __init__(self, tables: list[ResidencyTableLike], *, max_rows: int, row_width: int,
                 block_size: int, capacity: int) -> None:
        self.tables = tables
        self.block_size = block_size
        self.capacity = capacity
        self.results = [ResidencyResult(*(
            torch.empty(shape, dtype=RESULT_DTYPE) for shape in (
                (max_rows, row_width), (max_rows,), (max_rows, row_width),
                (max_rows, row_width)))) for _ in tables]
        self._inputs = (torch.empty(max_rows, row_width, dtype=torch.int64),
                        *(torch.empty(max_rows, dtype=torch.int64) for _ in range(3)))
        self._inputs_np = tuple(t.numpy() for t in self._inputs)
        self._columns = np.arange(row_width, dtype=np.int64)

    def update(self, layer: int, row_topk: _Ints, serials: _Ints, stable: _Ints, requests: int,
               steady: torch.Tensor | None = None, first: torch.Tensor | None = None
               ) -> ResidencyResult:
        """One update of the first ``requests`` rows (the rest: no request); rows outside
        ``steady`` (bool [requests], default all) are left NOT_OFFLOADED, rows in ``first``
        (a subset of ``steady``) go FIRST_OFFLOAD. The integer inputs may be CPU tensors or
        NumPy arrays."""
        padded, request_ids, stable_lens, states = self._inputs_np
        padded.fill(-1)
        padded[:requests, :row_topk.shape[1]] = np.asarray(row_topk)
        request_ids.fill(-1)
        request_ids[:requests] = np.asarray(serials)
        stable_lens.fill(0)
        stable_lens[:requests] = np.asarray(stable)
        states.fill(int(RequestState.NOT_OFFLOADED))
        if steady is None:
            states[:requests] = int(RequestState.STEADY)
        else:
            states[:requests][steady.numpy()] = int(RequestState.STEADY)
        if first is not None:
            states[:requests][first.numpy()] = int(RequestState.FIRST_OFFLOAD)
        return self.tables[layer].update(*self._inputs, out=self.results[layer])

    def miss_rows(self, result: ResidencyResult, blocks: torch.Tensor, requests: int
                  ) -> tuple[np.ndarray, np.ndarray]:
        """(pool rows, hot-buffer rows) of the misses the update listed, in its order."""
        bs = self.block_size
        counts = result.miss_counts[:requests].numpy()
        listed = self._columns[None, :] < counts[:, None]
        row_of = np.nonzero(listed)[0]
        miss_pos = result.miss_tokens[:requests].numpy()[listed].astype(np.int64)
        src = blocks.numpy()[row_of, miss_pos // bs] * bs + miss_pos % bs
        dst = result.miss_slots[:requests].numpy()[listed] + row_of * self.capacity
        return src, dst
