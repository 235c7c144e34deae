"""The offloaded main-KV cache of one vLLM worker: host pool, hot buffers, residency per layer.

Pure torch + kvo (no vLLM import), so its rules are unit-tested with plain tensors; the vLLM
glue (``offload_main_kv``) feeds it vLLM's slot mapping, top-k buffer, query start locations,
sequence lengths and block tables.

Layout. The host pool (``kvo_vllm.sparse.host_store.HostKVStore`` over a
``kvo_transport.HostPool``) holds every offloaded layer's main-KV rows laid out like vLLM's
paged cache: pool row ``block_id * block_size + offset`` *is* vLLM's slot id, so vLLM's slot
mapping writes and its block tables address the pool directly (prefix-cache block sharing and
preemption need nothing extra). The device keeps, per layer, a hot buffer of ``max_rows x
capacity`` rows (one residency row per batch row) and the residency table
(:mod:`kvo_vllm.dsa.gather.layers`).

Per layer call: ``write`` puts the new tokens' rows into the pool at their slots (prefill and
decode alike); ``select_rows`` answers which rows each query token attends to, through the
gather implementations chosen at start (:mod:`kvo_vllm.dsa.gather`: the reference and its
faster forms for plain decode steps), and records the call's counters. Either way a token
gets bit-identical rows in top-k order, so attention over them equals the resident path's.
Row identity between calls: ``offload_identity.RowIdentity``.

With ``fused=True`` (``kernel_backend="fused"``) :meth:`OffloadManager.attend` serves the
layer instead (:mod:`kvo_vllm.dsa.offload_fused`); the pool then keeps latent and rope apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import torch

from kvo_core.errors import ConfigError
from kvo_kernels.host_identity import pool_write_rows_host
from kvo_vllm.dsa.gather.choose import choose_row_sources
from kvo_vllm.dsa.gather.contract import GatherCounts, LayerCall, StepInputs
from kvo_vllm.dsa.gather.layers import OffloadLayers
from kvo_vllm.dsa.main_kv import SelectedRows
from kvo_vllm.dsa.offload_fused import FusedDecode, IndexerInputs
from kvo_vllm.dsa.offload_stats import OffloadLayerStats, OffloadStats
from kvo_vllm.dsa.offload_tp import TPGroup, WriteNotices, open_shared_store
from kvo_vllm.sparse.host_store import HostKVStore, pool_bytes_for
from kvo_vllm.sparse.layout import SparseModelLayout

_I64 = torch.int64


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


class OffloadManager:
    """Main-KV offload state of one worker for all its offloaded layers (module docstring).

    ``num_blocks`` is vLLM's KV block count (the pool holds that many blocks per layer),
    ``max_rows`` its ``max_num_seqs``, ``top_k`` the width of the top-k buffer; ``capacity``
    the hot rows per batch row, which must hold ``decode_query_rows x top_k`` (the most one
    residency row can select in one call).
    """

    def __init__(self, layout: SparseModelLayout, *, num_blocks: int, block_size: int,
                 max_rows: int, max_blocks_per_row: int, top_k: int, capacity: int,
                 decode_query_rows: int, pool_name: str, residency_backend: str = "torch",
                 copy_implementation: str | None = None, device: torch.device | str = "cpu",
                 stats: OffloadStats | None = None, fused: bool = False,
                 tp_group: TPGroup | None = None) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("max_rows", max_rows), ("max_blocks_per_row", max_blocks_per_row),
                            ("top_k", top_k), ("capacity", capacity),
                            ("decode_query_rows", decode_query_rows)):
            _positive(name, value)
        if capacity < decode_query_rows * top_k:
            raise ConfigError(
                f"hot_capacity {capacity} cannot hold one residency row's selection: "
                f"{decode_query_rows} query rows x top-k {top_k} = {decode_query_rows * top_k}; "
                f"raise hot_capacity or lower max_query_rows")
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.capacity = capacity
        self.stats = stats or OffloadStats()
        device = torch.device(device)
        nbytes = pool_bytes_for(num_blocks * block_size, layout, block_size)
        # Rows are written by this rank (TP 1, or TP rank 0) or by TP rank 0 of this DP rank
        # into the pool this rank attached to (``offload_tp``: the write order).
        self.notices: WriteNotices | None = None
        self.fused: FusedDecode | None = None
        if tp_group is None:
            self.store = HostKVStore.create(pool_name, nbytes, layout, block_size,
                                            rope_apart=fused)
        else:
            self.store, self.notices = open_shared_store(
                tp_group,
                create=lambda name: HostKVStore.create(name, nbytes, layout, block_size,
                                                       rope_apart=fused),
                attach=lambda name: HostKVStore.attach(name, layout, block_size,
                                                       rope_apart=fused))
        try:
            # Each layer's pool rows, sliced once (a slice per call costs a dispatch).
            pools = [] if fused else [self.store.layer(layer)[:num_blocks * block_size]
                                      for layer in range(layout.num_layers)]
            self.layers = OffloadLayers(
                pools, num_layers=layout.num_layers, num_blocks=num_blocks,
                block_size=block_size, max_rows=max_rows, max_blocks_per_row=max_blocks_per_row,
                top_k=top_k, capacity=capacity, decode_query_rows=decode_query_rows,
                dtype=layout.kv_dtype, device=device, residency_backend=residency_backend,
                copy_implementation=copy_implementation)
            if fused:
                self.fused = FusedDecode(
                    self.layers.identity, num_layers=layout.num_layers, max_rows=max_rows,
                    capacity=capacity, block_size=block_size, top_k=top_k,
                    decode_query_rows=decode_query_rows, latent_dim=layout.latent_dim,
                    rope_dim=layout.rope_dim, dtype=layout.kv_dtype, device=device)
            self.sources = () if fused else choose_row_sources(self.layers)
        except BaseException:
            self.close()
            raise

    # -- what the device and the host hold ---------------------------------------------------

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    @property
    def hot_buffer_bytes(self) -> int:
        """Device bytes of all layers' hot buffers."""
        fused = 0 if self.fused is None else self.fused.hot_buffer_bytes
        return fused + self.layers.hot_buffer_bytes

    @property
    def pool_region(self) -> tuple[int, int]:
        """(address, bytes) of the whole host pool, for registering with a transfer engine."""
        return self.store.pool.ptr, self.store.pool.nbytes

    def pool_layer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s pool rows ``[num_blocks * block_size, row_dim]`` (slot-indexed;
        not in fused mode, whose pool keeps latent and rope apart: :meth:`pool_parts`)."""
        if self.fused is not None:
            self.store.layer(layer)   # raises: the fused pool has no interleaved rows
        return self.layers.pools[layer]

    def pool_parts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s pool as (latent, rope) ``[num_blocks, block_size, D]`` views."""
        blocks, bs = self.num_blocks, self.block_size
        latent = self.store.latent(layer)[:blocks * bs]
        rope = self.store.rope(layer)[:blocks * bs]
        return latent.view(blocks, bs, -1), rope.view(blocks, bs, -1)

    def pool_layer_base(self, layer: int) -> int:
        """Address of layer ``layer``'s first pool row (block ``b`` starts
        ``b * block_size * row_bytes`` later). Not in fused mode: its pool keeps latent and
        rope apart, so a pull lands there through ``remote_d2h.fused_pool_split``."""
        if self.fused is not None:
            raise ConfigError("the fused pool (kernel_backend 'fused') keeps latent and rope "
                              "apart: address its layers through "
                              "kvo_vllm.remote_d2h.fused_pool_split")
        return int(self.pool_layer(layer).data_ptr())

    def note_blocks_written(self, block_ids: Iterable[int]) -> None:
        """Whole blocks of every layer were written behind ``write``'s back (a P/D decode
        pulled a prompt into the pool): renew their versions, so no batch row keeps hot slots
        copied from the blocks' previous contents (``offload_identity``)."""
        blocks = torch.tensor([b for b in block_ids if b >= 0], dtype=_I64)
        if not blocks.numel():
            return
        if int(blocks.max()) >= self.num_blocks:
            raise ValueError(f"block {int(blocks.max())} is outside the pool's "
                             f"{self.num_blocks} blocks")
        for identity in self.layers.identity:
            identity.note_writes(blocks * self.block_size)

    # -- the per-call pipeline ---------------------------------------------------------------

    def write(self, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Write main-KV rows ``[N, row_dim]`` at vLLM slots ``[>= N]`` (-1 = skip).

        With a pool shared by TP ranks only TP rank 0 writes, then tells the others; another
        rank records the writes (block versions) and returns once rank 0 has told it, so its
        reads of the pool later in this layer call see the rows (``offload_tp``)."""
        notices = self.notices
        if notices is None:
            self._write_rows(layer, rows, slots)
        elif notices.writer:
            self._write_rows(layer, rows, slots)
            notices.published()
        else:
            wanted = slots.reshape(-1)[:rows.shape[0]].cpu().numpy().astype(np.int64,
                                                                            copy=False)
            self.layers.identity[layer].note_written_rows(wanted)
            notices.wait_published()

    def _write_rows(self, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        identity = self.layers.identity[layer]
        if self.layers.native and self.fused is None:
            # One C++ call: the copies and the block versions of note_writes.
            pool_write_rows_host(
                self.layers.pools[layer],
                rows.to(device="cpu", dtype=self.layout.kv_dtype).contiguous(),
                slots if slots.dim() == 1 else slots.reshape(-1), identity.state.versions,
                identity.write_counter, block_size=self.block_size)
            return
        # Index arithmetic in NumPy (one dispatch per PyTorch op costs more than the work).
        wanted = slots.reshape(-1)[:rows.shape[0]].cpu().numpy().astype(np.int64, copy=False)
        keep = wanted >= 0
        if not keep.all():
            rows, wanted = rows[torch.from_numpy(keep).to(rows.device)], wanted[keep]
        rows = rows.to(device="cpu", dtype=self.layout.kv_dtype)
        index = torch.from_numpy(wanted)
        if self.fused is None:
            self.layers.pools[layer].index_copy_(0, index, rows)
        else:
            latent, rope = (part.flatten(0, 1) for part in self.pool_parts(layer))
            latent.index_copy_(0, index, rows[:, :self.layout.latent_dim])
            rope.index_copy_(0, index, rows[:, self.layout.latent_dim:])
        identity.note_written_rows(wanted)

    def select_rows(self, layer: int, topk: torch.Tensor, step: StepInputs) -> SelectedRows:
        """Rows to attend to per query token of ``step`` (:meth:`step_inputs`; the caller keeps
        it for the step's layers). ``topk`` [>= T, K]: request-local positions, -1 = none, one
        row per query token, then any padding rows (answered for no row: the answer has T).
        An answer by slot into the layer's hot buffer or pool is valid until the layer's next
        call."""
        if self.fused is not None:
            raise RuntimeError("a fused-mode manager serves attention through attend()")
        call = LayerCall(layer=layer, padded_topk=topk if topk.is_cpu else topk.cpu(),
                         step=step)
        started = time.perf_counter()
        for source in self.sources:
            answer = source.select_rows(call)
            if answer is not None:
                self._record(layer, answer.counts, time.perf_counter() - started)
                return answer.rows
        raise RuntimeError(f"no gather implementation of {[s.name for s in self.sources]} "
                           f"answered layer {layer}'s call")

    def gather(self, layer: int, topk: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, block_table: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`select_rows` materialised: ``([T, K, row_dim], valid [T, K])``;
        ``query_start_loc`` [R + 1], ``seq_lens`` [R] (tokens including this call's),
        ``block_table`` [>= R, blocks]."""
        step = self.step_inputs(query_start_loc, seq_lens, block_table)
        return self.select_rows(layer, topk, step).materialized()

    def step_inputs(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, requests: int | None = None) -> StepInputs:
        """What every layer of a step reads from vLLM's metadata (the first ``requests`` rows
        of its tensors, default ``len(seq_lens)``), kept by the caller for the step's layers."""
        return StepInputs(vllm_query_start_loc=query_start_loc, vllm_seq_lens=seq_lens,
                          vllm_block_table=block_table,
                          requests=int(seq_lens.shape[0]) if requests is None else requests)

    def attend(self, layer: int, query: torch.Tensor, query_rope: torch.Tensor,
               topk: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, indexer: IndexerInputs, scale: float) -> torch.Tensor:
        """Fused mode: the attention output ``[T, N, latent]`` of every query token.

        Decode rows go through the fused ops (their top-k comes from ``indexer``, the
        lightning-indexer operands of all T tokens); the other tokens attend to their ``topk``
        rows [T, K] (request-local, -1 pad; decode tokens' entries are not read) read straight
        from the pool. Other arguments as for :meth:`gather`.
        """
        if self.fused is None:
            raise RuntimeError("attend() needs a manager built with fused=True")
        step = self.step_inputs(query_start_loc, seq_lens, block_table)
        out, counts, seconds = self.fused.attend(layer, query, query_rope, topk, step,
                                                 self.pool_parts(layer), indexer, scale)
        self._record(layer, counts, seconds)
        return out

    def _record(self, layer: int, counts: GatherCounts, seconds: float) -> None:
        """The one place a layer call's counters are recorded (``offload_stats``)."""
        row_bytes = self.layout.row_bytes
        self.stats.record(OffloadLayerStats(
            layer=layer, decode_rows=counts.decode_rows, decode_tokens=counts.decode_tokens,
            pool_rows=counts.pool_rows, selected=counts.selected,
            hits=counts.selected - counts.misses, misses=counts.misses,
            h2d_bytes=counts.misses * row_bytes,
            full_reload_bytes=counts.reload_tokens * row_bytes,
            pool_rows_used=counts.pool_rows_used, residency_seconds=seconds,
            identity_rows=counts.identity_rows, identity_fills=counts.identity_fills,
            first_offloads=counts.first_offloads))

    def close(self) -> None:
        """Release the host pool (its creator unlinks the shared-memory segment)."""
        if self.notices is not None:
            self.notices.close()
        self.store.close()
