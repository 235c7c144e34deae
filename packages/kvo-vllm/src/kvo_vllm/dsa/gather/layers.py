"""The state every gather implementation works on, one owner for all of it: per offloaded
layer the pool rows (slot-indexed views of the host pool), the device hot buffer of
``max_rows x capacity`` rows, the row identity (``offload_identity``), which hot rows are
NOT_OFFLOADED (``offload_hot_rows``) and the residency table; plus the copies all paths
share."""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import torch

from kvo_core.residency import RESULT_DTYPE, RequestState, ResidencyResult, ResidencyTableLike
from kvo_kernels import ops
from kvo_vllm.dsa.gather.contract import LayerCall
from kvo_vllm.dsa.main_kv import SelectedRows
from kvo_vllm.dsa.offload_hot_rows import IdentityPlan, IdentityRows
from kvo_vllm.dsa.offload_identity import RowIdentity
from kvo_vllm.sparse.residency_backend import make_residency_table, native_host_tables

_Ints: TypeAlias = torch.Tensor | np.ndarray


class LayerResidency:
    """One residency table per layer (``max_rows`` rows of ``capacity`` slots, at most
    ``row_width`` entries selected per row and call) and the buffers an update reads and
    writes: caller-owned results (no allocation per step; a layer's are read before its next
    update) and inputs refilled through NumPy views of the same memory."""

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


class OffloadLayers:
    """Hot buffers, residency and row identity of every offloaded layer (module docstring).

    ``pools`` holds each layer's pool rows ``[num_blocks * block_size, row_dim]``; empty in
    fused mode, whose pool keeps latent and rope apart and whose hot buffers are the fused
    ops' own (``offload_fused``): then only the row identity is kept here. ``copy_implementation``
    None picks ``"native"`` (kvo's C++ host ops) where the residency tables run the native op
    on host memory, else kvo-kernels' dispatch."""

    def __init__(self, pools: list[torch.Tensor], *, num_layers: int, num_blocks: int,
                 block_size: int, max_rows: int, max_blocks_per_row: int, top_k: int,
                 capacity: int, decode_query_rows: int, dtype: torch.dtype,
                 device: torch.device, residency_backend: str,
                 copy_implementation: str | None) -> None:
        self.pools = pools
        self.block_size = block_size
        self.max_rows = max_rows
        self.top_k = top_k
        self.capacity = capacity
        self.decode_query_rows = decode_query_rows
        self.device = device
        self.row_dim = int(pools[0].shape[1]) if pools else 0
        self.hot = [torch.zeros(max_rows * capacity, self.row_dim, dtype=dtype, device=device)
                    for _ in pools]
        self.residency = LayerResidency(
            [make_residency_table(residency_backend, max_rows, capacity) for _ in pools],
            max_rows=max_rows, row_width=decode_query_rows * top_k, block_size=block_size,
            capacity=capacity)
        if copy_implementation is None and native_host_tables(self.residency.tables, device):
            copy_implementation = "native"   # the native library is loaded: its host copy too
        self.copy_implementation = copy_implementation
        self.identity = [RowIdentity(max_rows=max_rows, num_blocks=num_blocks,
                                     block_size=block_size, max_blocks_per_row=max_blocks_per_row,
                                     native=self.native) for _ in range(num_layers)]
        self.held = [IdentityRows(max_rows=max_rows, capacity=capacity) for _ in pools]
        self.row_base = np.arange(max_rows, dtype=np.int64)[:, None] * capacity

    @property
    def native(self) -> bool:
        """Whether kvo's C++ host ops serve the copies (chosen once, at start)."""
        return self.copy_implementation == "native"

    @property
    def hot_buffer_bytes(self) -> int:
        return int(sum(h.numel() * h.element_size() for h in self.hot))

    def serials(self, call: LayerCall) -> torch.Tensor:
        """The call's row serials, computed on its first use (:class:`LayerCall`)."""
        if call.serials is None:
            step = call.step
            call.serials = self.identity[call.layer].serials(step.raw_blocks, step.raw_seq_lens,
                                                             step.query_lens)
        return call.serials

    def pool_rows(self, blocks: torch.Tensor, owner: torch.Tensor, pos: torch.Tensor
                  ) -> torch.Tensor:
        """Pool rows of request-local positions ``pos`` of the rows ``owner`` (block table
        ``blocks``), same shape as ``pos``."""
        bs = self.block_size
        return blocks[owner].gather(1, pos // bs) * bs + pos % bs

    def hot_answer(self, layer: int, slots: np.ndarray, valid: np.ndarray) -> SelectedRows:
        """Token ``t`` (of batch row ``t``) reads hot row ``slots[t, k]`` of its row, where
        ``valid``: the answer of a plain decode step, by slot into the hot buffer."""
        rows = np.where(valid, slots + self.row_base[:valid.shape[0]], -1)
        return SelectedRows(rows=self.hot[layer], valid=torch.from_numpy(valid).to(self.device),
                            slots=torch.from_numpy(rows).to(self.device))

    def fill_identity_rows(self, layer: int, plan: IdentityPlan, blocks: torch.Tensor) -> int:
        """Copy the pool rows the plan lists into their identity slots; returns how many."""
        rows, pos = plan.fill_rows.numpy(), plan.fill_pos.numpy()
        if not rows.size:
            return 0
        bs = self.block_size
        src = torch.from_numpy(blocks.numpy()[rows, pos // bs] * bs + pos % bs)
        dst = torch.from_numpy(rows * self.capacity + pos).to(self.device)
        self.hot[layer].index_copy_(0, dst, self.pools[layer][src].to(self.device))
        return int(rows.size)

    def copy_misses(self, layer: int, src: np.ndarray, dst: np.ndarray) -> int:
        """Copy pool rows ``src`` to hot rows ``dst`` (kvo-kernels' ``sparse_copy``)."""
        ops.sparse_copy(self.pools[layer], self.hot[layer], torch.from_numpy(src),
                        torch.from_numpy(dst).to(self.device),
                        implementation=self.copy_implementation)
        return int(src.size)
