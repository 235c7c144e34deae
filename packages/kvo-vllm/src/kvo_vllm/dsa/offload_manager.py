"""The offloaded main-KV cache of one vLLM worker: host pool, hot buffers, residency per layer.

Pure torch + kvo (no vLLM import), so its rules are unit-tested with plain tensors; the vLLM
glue (``offload.py``) feeds it vLLM's slot mapping, top-k buffer, query start locations,
sequence lengths and block tables.

Layout. The host pool (``kvo_vllm.sparse.host_store.HostKVStore`` over a
``kvo_transport.HostPool``) holds every offloaded layer's main-KV rows laid out like vLLM's
paged cache: pool row ``block_id * block_size + offset`` *is* vLLM's slot id, so vLLM's slot
mapping writes and its block tables address the pool directly (prefix-cache block sharing and
preemption need nothing extra). The device keeps, per layer, a hot buffer of ``max_rows x
capacity`` rows (one residency row per batch row) and the residency table.

Per layer call:

1. ``write``: the new tokens' rows go to the pool at their slots (prefill and decode alike);
2. ``gather``: batch rows whose query has at most ``decode_query_rows`` tokens (decode, MTP
   drafts) go through residency: their query rows' top-k lists are concatenated into the
   request's residency row (shared by its query rows), the table returns hits/misses/slots,
   only the misses are copied pool -> hot buffer (``kvo::sparse_copy``), and each query row's
   rows come from the hot buffer through its remapped slots. A step whose rows all decode one
   token hands attention the hot buffer with each token's hot rows (``SelectedRows.slots``):
   no gathered copy of the rows; with kvo's C++ host ops loaded (CPU, native residency) its
   misses are copied straight from the update's result (``copy_residency_misses``).
   Longer queries (prefill chunks) read their rows straight from the pool: their top-k union
   would not fit a hot row, and they write most of what they read in the same call.

   A decode row whose request's sequence, this call's tokens included, fits its hot row
   (``seq_len <= capacity``) is NOT_OFFLOADED instead: its hot row holds position ``p`` at
   slot ``p``, filled from the pool once per position (``offload_hot_rows``), and its top-k
   is read as ``hot[row * capacity + p]``: no residency update, no miss copy (a step whose
   rows all stay NOT_OFFLOADED copies each row's new position and answers with slots: one
   C++ call, ``identity_decode_step``, with the native ops; in the steady state, serials
   included, ``identity_decode_lane`` from vLLM's metadata, :meth:`OffloadManager.identity_lane`).
   The call its
   sequence outgrows the row it goes FIRST_OFFLOAD (the table resets the row and copies the
   selection, ascending), then STEADY. Batches with no such row take the paths above
   unchanged (``_identity_in_play``).

Either way a token gets bit-identical rows in top-k order, so attention over them equals the
resident path's. Row identity between calls: ``offload_identity.RowIdentity``.

With ``fused=True`` (``kernel_backend="fused"``) the decode rows take the fused ops instead
(:mod:`kvo_vllm.dsa.offload_fused`): :meth:`OffloadManager.attend` runs indexer + residency +
copy + attention for them and the pool path above for the rest; the pool then keeps latent and
rope apart, and ``gather`` is not used. The fused path has no NOT_OFFLOADED rows yet: every
decode row goes through its ops.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from typing import TypeAlias

import attrs
import numpy as np
import torch

from kvo_core.errors import ConfigError
from kvo_core.residency import RESULT_DTYPE, RequestState, ResidencyResult
from kvo_kernels import ops
from kvo_kernels.host_copy import copy_residency_misses_host
from kvo_kernels.host_identity import (
    identity_decode_lane_host,
    identity_decode_step_host,
    pool_write_rows_host,
)
from kvo_vllm.dsa.main_kv import RowOverlay, SelectedRows, attend_rows
from kvo_vllm.dsa.offload_fused import FusedDecode, IndexerInputs
from kvo_vllm.dsa.offload_hot_rows import IdentityPlan, IdentityRows
from kvo_vllm.dsa.offload_identity import RowIdentity
from kvo_vllm.dsa.offload_stats import OffloadLayerStats, OffloadStats
from kvo_vllm.dsa.offload_tp import TPGroup, WriteNotices, open_shared_store
from kvo_vllm.sparse.host_store import HostKVStore, pool_bytes_for
from kvo_vllm.sparse.layout import SparseModelLayout
from kvo_vllm.sparse.residency_backend import make_residency_table, native_host_tables

_I64 = torch.int64
_Ints: TypeAlias = torch.Tensor | np.ndarray


def _host_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of one of vLLM's index tensors, on the CPU (a view there)."""
    return tensor[:rows] if tensor.device.type == "cpu" else tensor[:rows].cpu()


def _int64_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU index tensor as a new int64 tensor (never a view of vLLM's buffer). Through
    NumPy: half the time of torch's ``to``."""
    return torch.from_numpy(tensor.numpy().astype(np.int64))


def _overlay(decode_tok: torch.Tensor, hot: torch.Tensor, hot_index: torch.Tensor
             ) -> RowOverlay | None:
    """The decode tokens' hot rows as a :class:`RowOverlay` (None without decode tokens)."""
    tokens = decode_tok.nonzero().squeeze(1)
    if not tokens.numel():
        return None
    return RowOverlay(tokens=tokens, rows=hot, slots=hot_index[tokens])


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@attrs.frozen(eq=False)
class StepInputs:
    """vLLM's step metadata as the manager reads it, the same for every layer of the step.

    ``raw_*`` are the first R rows of vLLM's own index tensors (int32 or int64, on the CPU),
    valid for this step only; kvo's C++ ops read either width, so a plain decode step of
    NOT_OFFLOADED rows uses them as they are. The int64 copies the other paths compute with
    are made on first use (three conversions per step are ~10 us of a ~4 ms decode step at
    a short context, where the offload path's whole budget is ~80 us)."""

    raw_query_start_loc: torch.Tensor   # [R + 1]
    raw_seq_lens: torch.Tensor          # [R]
    raw_blocks: torch.Tensor            # [R, blocks] (the block table's first R rows)
    tokens: int                         # the step's query tokens (query_start_loc[R])
    one_token_each: bool                # every row has exactly one query token (plain decode)
    shortest: int                       # min(seq_lens), 0 without rows
    longest: int                        # max(seq_lens), 0 without rows

    @property
    def requests(self) -> int:
        return int(self.raw_seq_lens.shape[0])

    @functools.cached_property
    def query_start_loc(self) -> torch.Tensor:
        """``[R + 1]`` int64, a copy."""
        return _int64_copy(self.raw_query_start_loc)

    @functools.cached_property
    def seq_lens(self) -> torch.Tensor:
        """``[R]`` int64, a copy."""
        return _int64_copy(self.raw_seq_lens)

    @functools.cached_property
    def blocks(self) -> torch.Tensor:
        """``[R, blocks]`` int64, a copy."""
        return _int64_copy(self.raw_blocks)

    @functools.cached_property
    def lens(self) -> np.ndarray:
        """:attr:`seq_lens` as NumPy (the same memory)."""
        lens: np.ndarray = self.seq_lens.numpy()
        return lens


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
        self.max_rows = max_rows
        self.top_k = top_k
        self.capacity = capacity
        self.decode_query_rows = decode_query_rows
        self.device = torch.device(device)
        self.copy_implementation = copy_implementation
        self.stats = stats or OffloadStats()
        nbytes = pool_bytes_for(num_blocks * block_size, layout, block_size)
        # Rows are written by this rank (TP 1, or TP rank 0) or by TP rank 0 of this DP rank
        # into the pool this rank attached to (``offload_tp``: the write order).
        self.notices: WriteNotices | None = None
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
            rows = max_rows * capacity
            self.fused: FusedDecode | None = None
            if fused:
                self.fused = FusedDecode(
                    num_layers=layout.num_layers, max_rows=max_rows, capacity=capacity,
                    block_size=block_size, top_k=top_k, decode_query_rows=decode_query_rows,
                    latent_dim=layout.latent_dim, rope_dim=layout.rope_dim,
                    dtype=layout.kv_dtype, device=self.device)
            layers = 0 if fused else layout.num_layers
            self.hot = [torch.zeros(rows, layout.row_dim, dtype=layout.kv_dtype,
                                    device=self.device) for _ in range(layers)]
            self.tables = [make_residency_table(residency_backend, max_rows, capacity)
                           for _ in range(layers)]
            # Each layer's pool rows, sliced once (a slice per call costs a dispatch).
            self._pool_layers = [] if fused else [
                self.store.layer(layer)[:num_blocks * block_size]
                for layer in range(layout.num_layers)]
            if copy_implementation is None and native_host_tables(self.tables, self.device):
                # The residency runs kvo's native library, so its C++ host copy is there too.
                self.copy_implementation = "native"
            row_width = decode_query_rows * top_k
            # The tables write their results here (caller-owned, no allocation per step); a
            # layer's results are read before its next update.
            self.results = [ResidencyResult(*(
                torch.empty(shape, dtype=RESULT_DTYPE) for shape in (
                    (max_rows, row_width), (max_rows,), (max_rows, row_width),
                    (max_rows, row_width)))) for _ in range(layers)]
            # The update's inputs, refilled per call (the table reads them during the call),
            # and NumPy views of them and of the index constants for the decode path.
            self._update_inputs = (torch.empty(max_rows, row_width, dtype=_I64),
                                   *(torch.empty(max_rows, dtype=_I64) for _ in range(3)))
            self._update_inputs_np = tuple(t.numpy() for t in self._update_inputs)
            self._row_base = np.arange(max_rows, dtype=np.int64)[:, None] * capacity
            self._columns_np = np.arange(row_width, dtype=np.int64)
            self._one_token = torch.ones(max_rows, dtype=_I64)   # query lens of a decode step
            # Such a step's answer with the native ops: each token's hot rows and validity,
            # caller-owned (read by the layer's attention before the next layer call).
            self._hot_slots = torch.empty(max_rows * top_k, dtype=_I64)
            self._valid = torch.empty(max_rows * top_k, dtype=torch.bool)
            self._answer_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
            # With kvo's C++ host ops loaded, the serials come from its row_serials too.
            self.identity = [RowIdentity(max_rows=max_rows, num_blocks=num_blocks,
                                         block_size=block_size,
                                         max_blocks_per_row=max_blocks_per_row,
                                         native=self.copy_implementation == "native")
                             for _ in range(layout.num_layers)]
            self.identity_rows = [IdentityRows(max_rows=max_rows, capacity=capacity)
                                  for _ in range(layers)]
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
        return fused + int(sum(h.numel() * h.element_size() for h in self.hot))

    @property
    def pool_region(self) -> tuple[int, int]:
        """(address, bytes) of the whole host pool, for registering with a transfer engine."""
        return self.store.pool.ptr, self.store.pool.nbytes

    def pool_layer(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s pool rows ``[num_blocks * block_size, row_dim]`` (slot-indexed;
        not in fused mode, whose pool keeps latent and rope apart: :meth:`pool_parts`)."""
        if self.fused is not None:
            self.store.layer(layer)   # raises: the fused pool has no interleaved rows
        return self._pool_layers[layer]

    def pool_parts(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s pool as (latent, rope) ``[num_blocks, block_size, D]`` views."""
        blocks, bs = self.num_blocks, self.block_size
        latent = self.store.latent(layer)[:blocks * bs]
        rope = self.store.rope(layer)[:blocks * bs]
        return latent.view(blocks, bs, -1), rope.view(blocks, bs, -1)

    def read_pool(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Pool rows ``rows`` (slot ids, any shape) as ``[..., row_dim]`` (a copy)."""
        if self.fused is None:
            return self.pool_layer(layer)[rows]
        latent, rope = (part.flatten(0, 1) for part in self.pool_parts(layer))
        return torch.cat([latent[rows], rope[rows]], dim=-1)


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
        for identity in self.identity:
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
            self.identity[layer].note_written_rows(wanted)
            notices.wait_published()

    def _write_rows(self, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        if self.copy_implementation == "native" and self.fused is None:
            # One C++ call: the copies and the block versions of note_writes.
            identity = self.identity[layer]
            pool_write_rows_host(
                self._pool_layers[layer],
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
            self._pool_layers[layer].index_copy_(0, index, rows)
        else:
            latent, rope = (part.flatten(0, 1) for part in self.pool_parts(layer))
            latent.index_copy_(0, index, rows[:, :self.layout.latent_dim])
            rope.index_copy_(0, index, rows[:, self.layout.latent_dim:])
        self.identity[layer].note_written_rows(wanted)

    def gather(self, layer: int, topk: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, block_table: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows to attend to per query token, ``([T, K, row_dim], valid [T, K])``.

        ``topk`` [T, K]: request-local positions, -1 = none; ``query_start_loc`` [R + 1],
        ``seq_lens`` [R] (tokens including this call's), ``block_table`` [>= R, blocks].
        (:meth:`identity_lane`, else :meth:`gather_selected`, materialised.)
        """
        lane = self.identity_lane(layer, topk, query_start_loc, seq_lens, block_table,
                                  int(seq_lens.shape[0]))
        if lane is not None:
            return lane.materialized()
        step = self.step_inputs(query_start_loc, seq_lens, block_table)
        return self.gather_selected(layer, topk, step).materialized()

    def gather_selected(self, layer: int, topk: torch.Tensor, step: StepInputs
                        ) -> SelectedRows:
        """As :meth:`gather`, for the step :meth:`step_inputs` described (the caller keeps it
        for the step's layers). A decode step whose rows all take one path (every row
        residency-managed, or every row NOT_OFFLOADED) answers with the layer's hot buffer
        and each token's hot rows (``SelectedRows.slots``): attention reads them there, valid
        until the layer's next call."""
        if self.fused is not None:
            raise RuntimeError("a fused-mode manager serves attention through attend()")
        topk = topk.cpu()
        requests = step.requests
        serials: torch.Tensor | None = None
        if step.one_token_each and requests and topk.shape[0] == requests:
            if step.shortest > self.capacity and not self.identity_rows[layer].any_held:
                return self._gather_decode_step(layer, topk, step.lens, step.blocks)
            if step.longest <= self.capacity:
                serials = self.identity[layer].serials(step.raw_blocks, step.raw_seq_lens,
                                                       self._one_token[:requests])
                fast = self._gather_identity_step(layer, topk, step, serials)
                if fast is not None:
                    return fast
        topk = topk.to(_I64)
        qsl, seq_lens, blocks = step.query_start_loc, step.seq_lens, step.blocks
        count, width = topk.shape
        bs = self.block_size
        query_lens = qsl[1:requests + 1] - qsl[:requests]
        if self._identity_in_play(layer, seq_lens):
            return self._gather_with_identity(layer, topk, qsl, seq_lens, query_lens, blocks,
                                              serials)
        req = torch.repeat_interleave(torch.arange(requests, dtype=_I64), query_lens)
        if req.numel() != count:
            raise ValueError(f"top-k has {count} rows, the query start locations name "
                             f"{req.numel()} tokens")
        valid = topk >= 0
        pos = topk.clamp(min=0)
        pool_rows = blocks[req].gather(1, pos // bs) * bs + pos % bs        # [T, K]

        serials = self.identity[layer].serials(blocks, seq_lens, query_lens)
        decode = (query_lens >= 1) & (query_lens <= self.decode_query_rows)
        decode_tok = decode[req]
        self.identity[layer].forget(~decode)
        hot = self.hot[layer]
        pool = self.pool_layer(layer)
        same_device = pool.device == self.device
        any_decode = bool(decode.any())
        if not any_decode and same_device:
            # No decode row: attention reads the pool by slot, no gathered copy.
            self._record_step(layer, decode, decode_tok, seq_lens)
            slots = torch.where(valid, pool_rows, torch.full_like(pool_rows, -1))
            return SelectedRows(rows=pool, valid=valid, slots=slots)
        if same_device:
            # A mixed step (mostly prefill tokens): the attention reads the prefill tokens'
            # rows in the pool and the decode tokens' in the hot buffer, each by slot
            # (SelectedRows.overlay), with no gathered copy in between (it was the largest
            # cost of such a step: the attention gathers the rows again). Padding reads the
            # row of the request's position 0: finite, and masked.
            started = time.perf_counter()
            hot_index, misses = self._residency(layer, topk, req, qsl, decode, decode_tok,
                                                serials, seq_lens, query_lens, blocks)
            selected = int(valid[decode_tok].sum())
            self._record_step(layer, decode, decode_tok, seq_lens, selected, selected - misses,
                              misses, time.perf_counter() - started)
            return SelectedRows(rows=pool, valid=valid,
                                slots=torch.where(valid, pool_rows, torch.full_like(pool_rows, -1)),
                                overlay=_overlay(decode_tok, hot, hot_index))

        out = torch.empty(count, width, self.layout.row_dim, dtype=pool.dtype,
                          device=self.device)
        selected = hits = misses = 0
        residency_seconds = 0.0
        if any_decode:
            started = time.perf_counter()
            hot_index, misses = self._residency(layer, topk, req, qsl, decode, decode_tok,
                                                serials, seq_lens, query_lens, blocks)
            out[decode_tok] = hot[hot_index[decode_tok].to(self.device)]
            residency_seconds = time.perf_counter() - started
            selected = int(valid[decode_tok].sum())
            hits = selected - misses
        direct = ~decode_tok
        if bool(direct.any()):
            out[direct.to(self.device)] = pool[pool_rows[direct]].to(self.device)
        out[~valid.to(self.device)] = 0

        self._record_step(layer, decode, decode_tok, seq_lens, selected, hits, misses,
                          residency_seconds)
        return SelectedRows(rows=out, valid=valid.to(self.device))

    def _record_step(self, layer: int, decode: torch.Tensor, decode_tok: torch.Tensor,
                     seq_lens: torch.Tensor, selected: int = 0, hits: int = 0, misses: int = 0,
                     residency_seconds: float = 0.0) -> None:
        """The general path's per-layer stats (``decode``: which requests decode)."""
        self.stats.record(OffloadLayerStats(
            layer=layer, decode_rows=int(decode.sum()), decode_tokens=int(decode_tok.sum()),
            pool_rows=int((~decode).sum()),
            selected=selected, hits=hits, misses=misses, h2d_bytes=misses * self.row_bytes,
            full_reload_bytes=int(seq_lens[decode].sum()) * self.row_bytes,
            pool_rows_used=int(seq_lens.sum()), residency_seconds=residency_seconds))

    def step_inputs(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_table: torch.Tensor, requests: int | None = None) -> StepInputs:
        """What every layer of a step reads from vLLM's metadata, computed once (a small op
        here costs tens of microseconds: it ran once per layer). ``requests``: the batch's
        rows when the tensors are vLLM's whole buffers (default: ``len(seq_lens)``).

        The scalars come from Python lists: at a step's start (cold caches) a NumPy reduction
        on a few elements costs several microseconds, a list's ``min`` well under one."""
        rows = int(seq_lens.shape[0]) if requests is None else requests
        qsl = _host_rows(query_start_loc, rows + 1)
        lens = _host_rows(seq_lens, rows)
        starts: list[int] = qsl.numpy().tolist()
        lengths: list[int] = lens.numpy().tolist()
        return StepInputs(
            raw_query_start_loc=qsl, raw_seq_lens=lens, raw_blocks=_host_rows(block_table, rows),
            tokens=starts[rows] if len(starts) > rows else 0,
            # Every row one query token: the starts count up by one from the first.
            one_token_each=bool(starts) and starts == list(range(starts[0],
                                                                 starts[0] + rows + 1)),
            shortest=min(lengths, default=0), longest=max(lengths, default=0))

    def _gather_decode_step(self, layer: int, topk: torch.Tensor, lens: np.ndarray,
                            blocks: torch.Tensor) -> SelectedRows:
        """``gather`` of a plain decode step (:meth:`step_inputs`): the same residency
        update, copies and rows as the general path, with the index arithmetic in NumPy on
        views of the same memory (a PyTorch op's dispatch costs several microseconds here,
        more than its arithmetic on a few hundred indices; it added up to a millisecond per
        layer and step). With kvo's C++ host ops the misses are copied straight from the
        update's result (``copy_residency_misses``); either way the answer names hot rows
        (``SelectedRows.slots``) instead of gathering them."""
        requests, width = topk.shape
        started = time.perf_counter()
        serials = self.identity[layer].serials(blocks, torch.from_numpy(lens),
                                               self._one_token[:requests])
        picks = topk.numpy()
        result = self._update_residency(layer, picks, serials.numpy(), lens - 1, requests)
        slots = result.slots[:requests, :width].numpy()
        valid = picks >= 0
        if self.copy_implementation == "native":   # (a CPU manager: native_host_tables)
            misses = copy_residency_misses_host(
                self._pool_layers[layer], self.hot[layer], blocks, result.miss_counts,
                result.miss_tokens, result.miss_slots, rows=requests,
                block_size=self.block_size, capacity=self.capacity)
        else:
            misses = self._copy_misses(layer, result, blocks, requests)
        hot_slots = np.where(valid, slots + self._row_base[:requests], -1)
        residency_seconds = time.perf_counter() - started
        selected = int(valid.sum())
        context = int(lens.sum())
        self.stats.record(OffloadLayerStats(
            layer=layer, decode_rows=requests, decode_tokens=requests, pool_rows=0,
            selected=selected, hits=selected - misses, misses=misses,
            h2d_bytes=misses * self.row_bytes, full_reload_bytes=context * self.row_bytes,
            pool_rows_used=context, residency_seconds=residency_seconds))
        return SelectedRows(rows=self.hot[layer], valid=torch.from_numpy(valid).to(self.device),
                            slots=torch.from_numpy(hot_slots).to(self.device))

    def _update_residency(self, layer: int, row_topk: _Ints, serials: _Ints, stable: _Ints,
                          requests: int, steady: torch.Tensor | None = None,
                          first: torch.Tensor | None = None) -> ResidencyResult:
        """One residency update of the first ``requests`` rows (the rest: no request); rows
        outside ``steady`` (bool [requests], default all) are left NOT_OFFLOADED, rows in
        ``first`` (a subset of ``steady``) go FIRST_OFFLOAD. The integer inputs may be CPU
        tensors or NumPy arrays (copied into the table's input buffers either way)."""
        padded, request_ids, stable_lens, states = self._update_inputs_np
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
        return self.tables[layer].update(*self._update_inputs, out=self.results[layer])

    def _miss_rows(self, result: ResidencyResult, blocks: torch.Tensor, requests: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(pool rows, hot-buffer rows) of the misses the update listed, in its order."""
        bs = self.block_size
        counts = result.miss_counts[:requests].numpy()
        listed = self._columns_np[None, :] < counts[:, None]
        row_of = np.nonzero(listed)[0]
        miss_pos = result.miss_tokens[:requests].numpy()[listed].astype(np.int64)
        src = blocks.numpy()[row_of, miss_pos // bs] * bs + miss_pos % bs
        dst = result.miss_slots[:requests].numpy()[listed] + row_of * self.capacity
        return src, dst

    def _copy_misses(self, layer: int, result: ResidencyResult, blocks: torch.Tensor,
                     requests: int) -> int:
        """Copy the misses the update listed (pool -> hot buffer); returns how many."""
        src, dst = self._miss_rows(result, blocks, requests)
        ops.sparse_copy(self.pool_layer(layer), self.hot[layer], torch.from_numpy(src),
                        torch.from_numpy(dst).to(self.device),
                        implementation=self.copy_implementation)
        return int(src.size)

    def _residency(self, layer: int, topk: torch.Tensor, req: torch.Tensor, qsl: torch.Tensor,
                   decode: torch.Tensor, decode_tok: torch.Tensor, serials: torch.Tensor,
                   seq_lens: torch.Tensor, query_lens: torch.Tensor, blocks: torch.Tensor,
                   first: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """Residency update, miss copies; returns each token's hot-buffer rows and the misses
        (rows in ``decode`` go STEADY, or FIRST_OFFLOAD if in ``first``)."""
        count, width = topk.shape
        requests = int(seq_lens.shape[0])
        cap = self.capacity
        row_width = self.decode_query_rows * width
        query_row = torch.arange(count, dtype=_I64) - qsl[req]             # row within request
        cols = query_row[:, None] * width + torch.arange(width, dtype=_I64)[None, :]
        cols = cols.clamp(max=row_width - 1)  # non-decode tokens: masked out below anyway
        row_topk = torch.full((requests, row_width), -1, dtype=_I64)
        tok = decode_tok.nonzero().squeeze(1)
        row_topk[req[tok][:, None].expand(-1, width), cols[tok]] = topk[tok]
        result = self._update_residency(layer, row_topk, serials, seq_lens - query_lens,
                                        requests, steady=decode, first=first)
        misses = self._copy_misses(layer, result, blocks, requests)
        slots = result.slots[req[:, None], cols].to(_I64)                 # [T, K]
        return (req[:, None] * cap + slots.clamp(min=0)), misses

    # -- NOT_OFFLOADED rows (identity mapping; rules: offload_hot_rows) ----------------------

    def _identity_in_play(self, layer: int, seq_lens: torch.Tensor) -> bool:
        """Whether this call may have a NOT_OFFLOADED row, or a row leaving that state."""
        return self.identity_rows[layer].any_held or (
            bool(seq_lens.numel()) and int(seq_lens.min()) <= self.capacity)

    def _fill_identity_rows(self, layer: int, plan: IdentityPlan, blocks: torch.Tensor) -> int:
        """Copy the pool rows the plan lists into their identity slots; returns how many."""
        rows, pos = plan.fill_rows.numpy(), plan.fill_pos.numpy()
        if not rows.size:
            return 0
        bs = self.block_size
        src = torch.from_numpy(blocks.numpy()[rows, pos // bs] * bs + pos % bs)
        dst = torch.from_numpy(rows * self.capacity + pos).to(self.device)
        self.hot[layer].index_copy_(0, dst, self.pool_layer(layer)[src].to(self.device))
        return int(rows.size)

    def _gather_identity_step(self, layer: int, topk: torch.Tensor, step: StepInputs,
                              serials: torch.Tensor) -> SelectedRows | None:
        """``gather`` of a step whose every row decodes one token and fits its hot row, in the
        steady state of short requests (every row holds the request it held last call, filled
        up to its new position): copy each row's new position into its identity slot, answer
        with the hot buffer at slots ``row * capacity + position``. None when some row is not
        in that state (a join, a move, a first step): the caller takes the general path.
        ``serials``: the rows' :class:`RowIdentity` serials for this call."""
        requests = int(step.lens.shape[0])
        started = time.perf_counter()
        if self.copy_implementation == "native" and topk.shape[1] <= self.top_k:
            return self._native_identity_step(layer, topk, step, serials, started)
        if not self.identity_rows[layer].advance_decode_step(serials.numpy(), step.lens):
            return None
        filled = self._fill_identity_rows(layer, IdentityPlan(   # each row's new position
            identity=torch.ones(requests, dtype=torch.bool),
            first=torch.zeros(requests, dtype=torch.bool),
            fill_rows=torch.arange(requests, dtype=_I64),
            fill_pos=torch.from_numpy(step.lens - 1)), step.blocks)
        picks = topk.numpy()
        valid = picks >= 0
        hot_slots = np.where(valid, picks + self._row_base[:requests], -1)
        self._record_identity_step(layer, requests, int(np.count_nonzero(valid)),
                                   int(step.lens.sum()), filled, started)
        return SelectedRows(rows=self.hot[layer], valid=torch.from_numpy(valid).to(self.device),
                            slots=torch.from_numpy(hot_slots).to(self.device))

    def identity_lane(self, layer: int, topk: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_table: torch.Tensor, requests: int
                      ) -> SelectedRows | None:
        """``gather`` of a step in the steady state of short requests (every row decodes one
        token, stays NOT_OFFLOADED and holds the request it held last call), from vLLM's own
        metadata tensors (their first ``requests`` rows) in one C++ call
        (``identity_decode_lane``: the serials and the identity step together, the same
        state and answer as :meth:`gather_selected`). None, with nothing changed, for any
        other step, and without the native ops: the caller then takes
        :meth:`step_inputs` and :meth:`gather_selected`.

        Why: at a short context the offload path's cost over resident mode's was its Python
        at a step's first layer (caches cold after sampling and scheduling): the step's
        inputs, the serials, the identity step, ~80 us of a ~4 ms decode step."""
        if (self.copy_implementation != "native" or self.fused is not None
                or not self.identity_rows[layer].any_held or requests < 1
                or requests > self.max_rows or topk.dim() != 2 or topk.shape[0] != requests
                or topk.shape[1] > self.top_k
                or not (topk.is_cpu and query_start_loc.is_cpu and seq_lens.is_cpu
                        and block_table.is_cpu)):
            return None
        started = time.perf_counter()
        slots, valid = self._answer(requests, int(topk.shape[1]))
        held = self.identity_rows[layer]
        answer = identity_decode_lane_host(
            self._pool_layers[layer], self.hot[layer], query_start_loc, seq_lens, block_table,
            self.identity[layer].state, held.held_serials, held.filled, topk, slots, valid,
            rows=requests, block_size=self.block_size, capacity=self.capacity)
        if answer is None:
            return None
        selected, context = answer
        self._record_identity_step(layer, requests, selected, context, requests, started)
        return SelectedRows(rows=self.hot[layer], valid=valid, slots=slots)

    def _answer(self, requests: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The caller-owned ``[requests, width]`` views a native identity step answers in
        (made once per shape: two views per call cost ~5 us at a step's start)."""
        views = self._answer_views.get((requests, width))
        if views is None:
            views = self._answer_views[(requests, width)] = (
                self._hot_slots[:requests * width].view(requests, width),
                self._valid[:requests * width].view(requests, width))
        return views

    def _native_identity_step(self, layer: int, topk: torch.Tensor, step: StepInputs,
                              serials: torch.Tensor, started: float) -> SelectedRows | None:
        """:meth:`_gather_identity_step` in one C++ call (kvo-kernels'
        ``identity_decode_step``: the same copies, state and answer)."""
        requests, width = topk.shape
        held = self.identity_rows[layer]
        slots, valid = self._answer(requests, width)
        answer = identity_decode_step_host(
            self._pool_layers[layer], self.hot[layer], step.raw_blocks, step.raw_seq_lens, serials,
            held.held_serials, held.filled, topk, slots, valid, rows=requests,
            block_size=self.block_size, capacity=self.capacity)
        if answer is None:
            return None
        selected, context = answer
        self._record_identity_step(layer, requests, selected, context, requests, started)
        return SelectedRows(rows=self.hot[layer], valid=valid, slots=slots)

    def _record_identity_step(self, layer: int, requests: int, selected: int, context: int,
                              filled: int, started: float) -> None:
        """The counters of a step whose rows all stayed NOT_OFFLOADED (every entry a hit)."""
        self.stats.record(OffloadLayerStats(
            layer=layer, decode_rows=requests, decode_tokens=requests, pool_rows=0,
            selected=selected, hits=selected, misses=0, h2d_bytes=0,
            full_reload_bytes=context * self.row_bytes, pool_rows_used=context,
            residency_seconds=time.perf_counter() - started, identity_rows=requests,
            identity_fills=filled))

    def _gather_with_identity(self, layer: int, topk: torch.Tensor, qsl: torch.Tensor,
                              seq_lens: torch.Tensor, query_lens: torch.Tensor,
                              blocks: torch.Tensor, serials: torch.Tensor | None = None
                              ) -> SelectedRows:
        """``gather`` of a batch with NOT_OFFLOADED rows (or rows leaving that state): those
        read ``hot[row * capacity + position]``, with no residency update and no miss copy;
        other decode rows go through residency (FIRST_OFFLOAD on the call they outgrow
        their hot row), prefill rows read the pool, as in the general path. ``serials``: the
        rows' serials when this call already asked :class:`RowIdentity` for them.

        With the pool on the attention's device the answer names rows by slot (the hot
        buffer's, and the pool's for prefill tokens through ``SelectedRows.overlay``): no
        gathered copy, which the attention would gather again."""
        count = int(topk.shape[0])
        requests = int(seq_lens.shape[0])
        req = torch.repeat_interleave(torch.arange(requests, dtype=_I64), query_lens)
        if req.numel() != count:
            raise ValueError(f"top-k has {count} rows, the query start locations name "
                             f"{req.numel()} tokens")
        started = time.perf_counter()
        if serials is None:
            serials = self.identity[layer].serials(blocks, seq_lens, query_lens)
        decode = (query_lens >= 1) & (query_lens <= self.decode_query_rows)
        self.identity[layer].forget(~decode)
        plan = self.identity_rows[layer].plan(serials, seq_lens, query_lens, decode)
        filled = self._fill_identity_rows(layer, plan, blocks)
        valid = topk >= 0
        pos = topk.clamp(min=0)
        hot = self.hot[layer]
        hot_index = req[:, None] * self.capacity + pos      # identity tokens' hot rows
        offloaded = decode & ~plan.identity
        offloaded_tok = offloaded[req]
        misses = 0
        if bool(offloaded.any()):
            residency_index, misses = self._residency(
                layer, topk, req, qsl, offloaded, offloaded_tok, serials, seq_lens,
                query_lens, blocks, first=plan.first)
            hot_index[offloaded_tok] = residency_index[offloaded_tok]
        decode_tok = decode[req]
        direct = ~decode_tok
        any_direct = bool(direct.any())
        selected = int(valid[decode_tok].sum())
        self.stats.record(OffloadLayerStats(
            layer=layer, decode_rows=int(decode.sum()), decode_tokens=int(decode_tok.sum()),
            pool_rows=int((~decode).sum()), selected=selected, hits=selected - misses,
            misses=misses, h2d_bytes=misses * self.row_bytes,
            full_reload_bytes=int(seq_lens[decode].sum()) * self.row_bytes,
            pool_rows_used=int(seq_lens.sum()),
            residency_seconds=time.perf_counter() - started,
            identity_rows=int(plan.identity.sum()), identity_fills=filled,
            first_offloads=int(plan.first.sum())))
        pool = self.pool_layer(layer)
        bs = self.block_size
        if pool.device == self.device:
            none = torch.full_like(hot_index, -1)
            if not any_direct:
                return SelectedRows(rows=hot, valid=valid,
                                    slots=torch.where(valid, hot_index, none))
            pool_rows = blocks[req].gather(1, pos // bs) * bs + pos % bs        # [T, K]
            return SelectedRows(rows=pool, valid=valid, slots=torch.where(valid, pool_rows, none),
                                overlay=_overlay(decode_tok, hot, hot_index))
        out = torch.empty(count, topk.shape[1], self.layout.row_dim, dtype=hot.dtype,
                          device=self.device)
        out[decode_tok.to(self.device)] = hot[hot_index[decode_tok].to(self.device)]
        if any_direct:
            pool_rows = blocks[req[direct]].gather(1, pos[direct] // bs) * bs + (
                pos[direct] % bs)
            out[direct.to(self.device)] = pool[pool_rows].to(self.device)
        out.masked_fill_(~valid.unsqueeze(-1).to(self.device), 0)
        return SelectedRows(rows=out, valid=valid.to(self.device))

    def attend(self, layer: int, query: torch.Tensor, query_rope: torch.Tensor,
               topk: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, indexer: IndexerInputs, scale: float) -> torch.Tensor:
        """Fused mode: the attention output ``[T, N, latent]`` of every query token.

        Decode rows go through the fused ops (their top-k comes from ``indexer``, the
        lightning-indexer operands of all T tokens); the other tokens attend to their ``topk``
        rows [T, K] (request-local, -1 pad; decode tokens' entries are not read) read straight
        from the pool, as in :meth:`gather`. Other arguments as for :meth:`gather`.
        """
        if self.fused is None:
            raise RuntimeError("attend() needs a manager built with fused=True")
        qsl = query_start_loc.cpu().to(_I64)
        seq_lens = seq_lens.cpu().to(_I64)
        count = int(query.shape[0])
        requests = int(seq_lens.shape[0])
        bs = self.block_size
        query_lens = qsl[1:requests + 1] - qsl[:requests]
        blocks = block_table[:requests].cpu().to(_I64)
        req = torch.repeat_interleave(torch.arange(requests, dtype=_I64), query_lens)
        if req.numel() != count:
            raise ValueError(f"query has {count} rows, the query start locations name "
                             f"{req.numel()} tokens")
        serials = self.identity[layer].serials(blocks, seq_lens, query_lens)
        decode = (query_lens >= 1) & (query_lens <= self.decode_query_rows)
        decode_tok = decode[req]
        self.identity[layer].forget(~decode)
        out = torch.empty(query.shape, dtype=query.dtype, device=self.device)

        direct = (~decode_tok).nonzero().squeeze(1)
        if direct.numel():
            picks = topk[:count].cpu().to(_I64)[direct]
            valid = picks >= 0
            pos = picks.clamp(min=0)
            pool_rows = blocks[req[direct]].gather(1, pos // bs) * bs + pos % bs
            rows = self.read_pool(layer, pool_rows).to(self.device)
            rows[~valid.to(self.device)] = 0
            where = direct.to(self.device)
            out[where] = attend_rows(query[where], query_rope[where], rows,
                                     valid.to(self.device), self.layout.latent_dim, scale)
        selected = misses = 0
        fused_seconds = 0.0
        if bool(decode.any()):
            started = time.perf_counter()
            rows_b = decode.nonzero().squeeze(1)
            tokens = decode_tok.nonzero().squeeze(1)
            latent, rope = self.pool_parts(layer)
            result = self.fused.run(
                layer, query=query, query_rope=query_rope, indexer=indexer, tokens=tokens,
                rows=rows_b, query_lens=query_lens[rows_b], seq_lens=seq_lens[rows_b],
                blocks=blocks[rows_b], serials=serials[rows_b], pool_latent=latent,
                pool_rope=rope, scale=scale)
            out[tokens.to(self.device)] = result.output
            selected, misses = result.selected, result.misses
            fused_seconds = time.perf_counter() - started

        self.stats.record(OffloadLayerStats(
            layer=layer, decode_rows=int(decode.sum()), decode_tokens=int(decode_tok.sum()),
            pool_rows=int((~decode).sum()), selected=selected, hits=selected - misses,
            misses=misses, h2d_bytes=misses * self.row_bytes,
            full_reload_bytes=int(seq_lens[decode].sum()) * self.row_bytes,
            pool_rows_used=int(seq_lens.sum()), residency_seconds=fused_seconds))
        return out

    def close(self) -> None:
        """Release the host pool (its creator unlinks the shared-memory segment)."""
        if self.notices is not None:
            self.notices.close()
        self.store.close()
