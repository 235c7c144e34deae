"""Sparse decode offload for one decode DP rank (docs/design.md section 6), usable without vLLM.

The full main-KV history of every running request lives in a shared host pool; the device
keeps only the indexer cache (full) and, per layer, a hot buffer of ``hot_capacity`` rows per
decode row. Each decode step and layer:

1. the new token's main-KV row goes to the host pool (TP rank 0 writes; every rank keeps the
   indexer key in its own device cache) — never to a full device cache;
2. the indexer selects the top-k past positions of each request;
3. the layer's residency table maps them to hot-buffer slots (hits keep theirs, misses take
   free or least-recently-used slots; a request's first step lays its selection out fresh);
4. only the misses are copied host -> device (``kvo_kernels.ops.sparse_copy``);
5. sparse MLA attention reads the hot buffer through the remapped slots.

Every request owns one contiguous range of pool rows (reserved for its whole budget at
admission) and one decode row (its residency row and hot-buffer row). TP ranks sharing a pool
make the same calls in the same order; the allocator is deterministic, so each computes the
placement rank 0 writes to, and the pool header lets them check that they agree.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import attrs
import torch

from kvo_core.config import SparseDecodeOffloadConfig
from kvo_core.errors import ConfigError
from kvo_core.residency import RESULT_DTYPE, RequestState, ResidencyResult
from kvo_kernels import ops
from kvo_kernels.dispatch import triton_available
from kvo_kernels.primitive_set import REFERENCE, Primitives, triton_primitives
from kvo_vllm.sparse.allocator import RowRange, RowRangeAllocator
from kvo_vllm.sparse.errors import (
    AdmissionError,
    DecodeInputError,
    RequestCapacityError,
    UnknownRequestError,
)
from kvo_vllm.sparse.host_store import HostKVStore, pool_bytes_for
from kvo_vllm.sparse.layout import SparseModelLayout
from kvo_vllm.sparse.residency_backend import make_residency_table
from kvo_vllm.sparse.stats import DeviceBytes, LayerStepStats, StepStats, Totals

RequestId = Hashable
Barrier = Callable[[], None]


class NewRows(Protocol):
    """One layer's rows of the batch's new tokens (one token per request)."""

    kv: torch.Tensor         # [R, latent]
    k_rope: torch.Tensor     # [R, rope]
    index_key: torch.Tensor  # [R, index_dim]


class DecodeQueries(Protocol):
    """One layer's queries of the batch's new tokens."""

    query: torch.Tensor          # [R, N, latent]
    query_rope: torch.Tensor     # [R, N, rope]
    index_query: torch.Tensor    # [R, Hi, index_dim]
    index_weights: torch.Tensor  # [R, Hi]


@attrs.define
class _Request:
    request_id: RequestId
    serial: int          # admission number: residency identity and pool owner tag
    decode_row: int      # residency row and hot-buffer row
    rows: RowRange       # host-pool rows (and indexer-cache rows)
    length: int          # tokens in the pool
    admitted: bool = False
    steps: int = 0       # decode steps done; 0 means the next step is the first offload
    next_layer: int = 0


@attrs.frozen
class RequestPlacement:
    """Where a reserved request's history goes: pool rows ``[start, start + reserved)``."""

    request_id: RequestId
    decode_row: int
    start: int
    reserved: int


def _no_barrier() -> None:
    return None


class SparseDecodeOffload:
    """The sparse decode KV backend of one decode DP rank (module docstring).

    ``max_rows`` is how many requests decode at once (hot buffers and residency rows are
    allocated for that many); ``max_model_len`` bounds a request's tokens and, when
    ``config.host_pool_bytes`` is None, sizes the pool to ``max_rows`` full-length requests.
    With ``tp_size > 1``, ``tp_barrier`` must synchronise the TP ranks (e.g. a barrier of the
    TP process group): it runs after rank 0 writes to the pool and before rows are freed.

    Limits of this first version: one query row per request and step (no MTP rows yet), the
    non-fused path (indexer, residency, copy and attention as separate kvo-kernels calls) and
    an indexer cache in ``layout.index_dtype`` (no int8 C8 indexer).
    """

    def __init__(self, config: SparseDecodeOffloadConfig, layout: SparseModelLayout, *,
                 max_rows: int, max_model_len: int, pool_name: str, tp_rank: int = 0,
                 tp_size: int = 1, tp_barrier: Barrier | None = None,
                 device: torch.device | str = "cpu") -> None:
        for name, value in (("max_rows", max_rows), ("max_model_len", max_model_len),
                            ("tp_size", tp_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")
        if tp_size > 1 and tp_barrier is None:
            raise ConfigError("tp_size > 1 needs tp_barrier: ranks sharing a host pool must "
                              "synchronise between rank 0's writes and the other ranks' reads")
        if config.kernel_backend == "fused":
            raise ConfigError(
                "kernel_backend 'fused' is not supported by this harness, which runs the "
                "non-fused path (the fused ops serve vLLM through kvo_vllm.dsa's offload "
                "mode); allowed here: auto, reference, triton")
        if config.indexer_kv_dtype != "bfloat16":
            raise ConfigError(
                f"indexer_kv_dtype {config.indexer_kv_dtype!r} is not supported by the "
                "non-fused decode path, which keeps the indexer cache in layout.index_dtype; "
                "allowed here: 'bfloat16' (an int8 C8 indexer needs the fused quant manage op)")
        self.config = config
        self.layout = layout
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.device = torch.device(device)
        self._barrier = tp_barrier or _no_barrier

        pool_bytes = config.host_pool_bytes or pool_bytes_for(
            max_rows * max_model_len, layout, config.block_size)
        if tp_rank == 0:
            self.store = HostKVStore.create(pool_name, pool_bytes, layout, config.block_size)
        else:
            self.store = HostKVStore.attach(pool_name, layout, config.block_size)
        try:
            geometry = self.store.geometry
            self._allocator = RowRangeAllocator(geometry.total_blocks, config.block_size)
            capacity = config.hot_capacity
            self.hot = torch.zeros(layout.num_layers, max_rows, capacity, layout.row_dim,
                                   dtype=layout.kv_dtype, device=self.device)
            self.index_cache = torch.zeros(layout.num_layers, geometry.total_rows,
                                           layout.index_dim, dtype=layout.index_dtype,
                                           device=self.device)
            self._tables = [make_residency_table(config.residency_backend, max_rows, capacity)
                            for _ in range(layout.num_layers)]
            self._results: dict[tuple[int, int], ResidencyResult] = {}
        except BaseException:
            self.store.close()  # do not leave a named pool behind a failed start
            raise
        self._primitives = self._choose_primitives()
        self._copy_impl = (config.kernel_backend
                           if config.kernel_backend in ("reference", "triton") else None)

        self._requests: dict[RequestId, _Request] = {}
        self._free_decode_rows = list(range(max_rows))
        self._serials = itertools.count()
        self._pending: list[LayerStepStats] = []
        self.last_step: StepStats | None = None
        self.totals = Totals()
        self.last_topk: dict[int, torch.Tensor] = {}  # layer -> [R, K] of the last call

    # -- set-up helpers ---------------------------------------------------------------------

    def _choose_primitives(self) -> Primitives:
        choice = self.config.kernel_backend
        if choice == "triton" or (choice == "auto" and self.device.type != "cpu"
                                  and triton_available()):
            return triton_primitives()
        return REFERENCE

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    def device_bytes(self) -> DeviceBytes:
        return DeviceBytes(hot_buffers=self.hot.numel() * self.hot.element_size(),
                           indexer_cache=self.index_cache.numel()
                           * self.index_cache.element_size())

    @property
    def host_pool_bytes(self) -> int:
        return self.store.pool.nbytes

    @property
    def free_pool_rows(self) -> int:
        return self._allocator.free_rows

    def request_ids(self) -> list[RequestId]:
        return list(self._requests)

    def length(self, request_id: RequestId) -> int:
        """Tokens of the request in the pool (its history plus the decoded tokens)."""
        return self._get(request_id).length

    # -- admission ----------------------------------------------------------------------------

    def reserve(self, request_id: RequestId, num_tokens: int, *,
                max_tokens: int | None = None) -> RequestPlacement:
        """Allocate a decode row and pool rows for a request's whole budget; write nothing.

        ``max_tokens`` (default ``max_model_len``) is the most tokens the request will reach;
        the P/D path then fills ``host_rows(request_id, layer)`` / the indexer rows and calls
        :meth:`admit_from_pool`. Raises AdmissionError if the request does not fit.
        """
        if request_id in self._requests:
            raise AdmissionError(f"request {request_id!r} is already admitted")
        budget = self.max_model_len if max_tokens is None else max_tokens
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise AdmissionError(f"request {request_id!r}: num_tokens must be an integer >= 1, "
                                 f"got {num_tokens!r}")
        if not isinstance(budget, int) or not num_tokens < budget <= self.max_model_len:
            raise AdmissionError(
                f"request {request_id!r}: max_tokens must be an integer in "
                f"({num_tokens}, {self.max_model_len}] (above its {num_tokens} history tokens, "
                f"at most max_model_len), got {budget!r}")
        if not self._free_decode_rows:
            raise AdmissionError(
                f"request {request_id!r}: all {self.max_rows} decode rows are busy; finish or "
                "pre-empt a request first (or raise max_rows)")
        taken = self._allocator.allocate(budget)
        if taken is None:
            raise AdmissionError(
                f"request {request_id!r} needs {budget} host-pool rows ({num_tokens} history "
                f"tokens, budget {budget}) but the pool has {self._allocator.free_rows} free rows "
                f"(largest contiguous run {self._allocator.largest_free_rows}) of "
                f"{self.store.geometry.total_rows}; host_pool_bytes="
                f"{self.store.pool.nbytes} holds {self.store.geometry.total_rows} tokens of "
                f"{self.layout.host_bytes_per_token} bytes: raise host_pool_bytes or wait for "
                "running requests to finish")
        serial = next(self._serials)
        record = _Request(request_id=request_id, serial=serial,
                          decode_row=self._free_decode_rows.pop(0), rows=taken,
                          length=num_tokens)
        self._requests[request_id] = record
        if self.tp_rank == 0:
            self.store.set_owner(taken, serial)
        return RequestPlacement(request_id, record.decode_row, taken.start, taken.rows)

    def placement(self, request_id: RequestId) -> RequestPlacement:
        """Where a reserved or admitted request lives (decode row, pool rows)."""
        record = self._get(request_id, admitted=None)
        return RequestPlacement(request_id, record.decode_row, record.rows.start,
                                record.rows.rows)

    def host_rows(self, request_id: RequestId, layer: int) -> torch.Tensor:
        """The request's reserved pool rows of one layer, ``[reserved, latent + rope]``."""
        record = self._get(request_id, admitted=None)
        return self.store.layer(layer)[record.rows.start:record.rows.end]

    def host_region(self, request_id: RequestId, layer: int) -> tuple[int, int]:
        """(address, bytes) of the request's rows of one layer, for a transfer engine."""
        return self.store.region(layer, self._get(request_id, admitted=None).rows)

    def indexer_rows(self, request_id: RequestId, layer: int) -> torch.Tensor:
        """The request's device indexer-cache rows of one layer, ``[reserved, index_dim]``."""
        record = self._get(request_id, admitted=None)
        return self.index_cache[layer, record.rows.start:record.rows.end]

    def admit_from_pool(self, request_id: RequestId, length: int) -> None:
        """The request's first ``length`` tokens are now in the pool and the indexer cache.

        On TP ranks > 0 this waits for rank 0 and checks that both placed the request on the
        same rows.
        """
        record = self._get(request_id, admitted=False)
        if not isinstance(length, int) or not 1 <= length < record.rows.rows:
            raise AdmissionError(f"request {request_id!r}: length must be in "
                                 f"[1, {record.rows.rows}) (its reserved rows), got {length!r}")
        self._barrier()
        if self.tp_rank != 0:
            self.store.check_owner(record.rows, record.serial, self.tp_rank)
        record.length = length
        record.admitted = True

    def admit(self, request_id: RequestId, history: Sequence[NewRows], *,
              max_tokens: int | None = None) -> None:
        """Admit a prefilled request: rank 0 writes its main rows to the pool; every rank
        writes its indexer keys to its own device cache."""
        if len(history) != self.layout.num_layers:
            raise AdmissionError(f"request {request_id!r}: history has {len(history)} layers, "
                                 f"the model has {self.layout.num_layers}")
        length = int(history[0].kv.shape[0])
        for layer, rows in enumerate(history):
            self._check_rows(rows, length, f"request {request_id!r} history layer {layer}",
                             AdmissionError)
        self.reserve(request_id, length, max_tokens=max_tokens)
        record = self._requests[request_id]
        span = slice(record.rows.start, record.rows.start + length)
        for layer, rows in enumerate(history):
            if self.tp_rank == 0:
                self.store.layer(layer)[span] = torch.cat(
                    [rows.kv, rows.k_rope], dim=-1).to(self.layout.kv_dtype)
            self.index_cache[layer, span] = rows.index_key.to(self.index_cache)
        self.admit_from_pool(request_id, length)

    def finish(self, request_id: RequestId) -> None:
        """Free a finished or pre-empted request's rows, decode row and residency state."""
        record = self._get(request_id, admitted=None)
        self._barrier()  # no rank still reads these rows when they are handed out again
        del self._requests[request_id]
        if self.tp_rank == 0:
            self.store.set_owner(record.rows, -1)
        self._allocator.free(record.rows)
        for table in self._tables:
            table.reset_row(record.decode_row)
        self._free_decode_rows.append(record.decode_row)
        self._free_decode_rows.sort()

    preempt = finish

    # -- decode -------------------------------------------------------------------------------

    def decode_layer(self, layer: int, request_ids: Sequence[RequestId], rows: NewRows,
                     queries: DecodeQueries) -> torch.Tensor:
        """One layer of one decode step for a batch (one new token per request).

        Returns the attention output ``[R, N, latent]`` in the query dtype. Layers of a step
        must come in order 0..L-1; the requests' lengths advance after the last layer.
        """
        records = self._check_decode(layer, request_ids, rows, queries)
        positions = [r.length for r in records]
        pool_rows = torch.tensor([r.rows.start + p for r, p in zip(records, positions,
                                                                  strict=True)])

        # 1. Append the new rows: main KV to the host pool (rank 0), indexer key on device.
        if self.tp_rank == 0:
            new_kv = torch.cat([rows.kv, rows.k_rope], dim=-1).to(self.layout.kv_dtype)
            self.store.layer(layer).index_copy_(0, pool_rows, new_kv.cpu())
        self.index_cache[layer].index_copy_(0, pool_rows.to(self.device),
                                            rows.index_key.to(self.index_cache))
        self._barrier()

        # 2. Indexer top-k per request over its own history (a contiguous slice).
        topk = self._select(layer, records, positions, queries)

        # 3. Residency: hits, misses and the slot of every selected position.
        result = self._residency(layer, records, positions, topk)
        decode_rows = torch.tensor([r.decode_row for r in records])
        slots = result.slots[decode_rows]
        miss_counts = result.miss_counts[decode_rows]

        # 4. Copy only the misses host -> hot buffer.
        listed = torch.arange(topk.shape[1])[None, :] < miss_counts[:, None]
        starts = torch.tensor([r.rows.start for r in records])
        src = (result.miss_tokens[decode_rows] + starts[:, None])[listed]
        dst = (result.miss_slots[decode_rows]
               + decode_rows[:, None] * self.config.hot_capacity)[listed]
        hot = self.hot[layer].view(-1, self.layout.row_dim)
        ops.sparse_copy(self.store.layer(layer), hot, src, dst.to(self.device),
                        implementation=self._copy_impl)

        # 5. Sparse attention over the hot buffer through the remapped slots.
        latent = self.layout.latent_dim
        outputs = []
        for i, record in enumerate(records):
            own = self.hot[layer, record.decode_row]
            outputs.append(self._primitives.sparse_mla_attention(
                queries.query[i:i + 1], queries.query_rope[i:i + 1], own[:, :latent],
                own[:, latent:], slots[i:i + 1].to(self.device), self.layout.softmax_scale))

        selected = int((topk >= 0).sum())
        misses = int(miss_counts.sum())
        self._record(LayerStepStats(
            layer=layer, requests=len(records), selected=selected, hits=selected - misses,
            misses=misses, h2d_bytes=int(src.numel()) * self.row_bytes,
            full_reload_bytes=sum(p + 1 for p in positions) * self.row_bytes))
        self._advance(layer, records)
        return torch.cat(outputs, dim=0)

    def _select(self, layer: int, records: Sequence[_Request], positions: Sequence[int],
                queries: DecodeQueries) -> torch.Tensor:
        picks = []
        for i, (record, position) in enumerate(zip(records, positions, strict=True)):
            visible = position + 1
            keys = self.index_cache[layer, record.rows.start:record.rows.start + visible]
            scores = self._primitives.indexer_scores(
                queries.index_query[i:i + 1], queries.index_weights[i:i + 1], keys)
            picks.append(self._primitives.topk_indices(
                scores, self.config.top_k, torch.tensor([visible], device=scores.device)))
        topk = torch.cat(picks, dim=0).cpu()
        self.last_topk[layer] = topk
        return topk

    def _residency(self, layer: int, records: Sequence[_Request], positions: Sequence[int],
                   topk: torch.Tensor) -> ResidencyResult:
        """One update of the layer's table: batch rows get their top-k, idle rows nothing."""
        width = topk.shape[1]
        all_topk = torch.full((self.max_rows, width), -1, dtype=torch.int64)
        request_ids = torch.full((self.max_rows,), -1, dtype=torch.int64)
        stable = torch.zeros(self.max_rows, dtype=torch.int64)
        states = torch.full((self.max_rows,), int(RequestState.NOT_OFFLOADED),
                            dtype=torch.int64)
        rows = torch.tensor([r.decode_row for r in records])
        all_topk[rows] = topk
        request_ids[rows] = torch.tensor([r.serial for r in records])
        stable[rows] = torch.tensor([p + 1 for p in positions])
        states[rows] = torch.tensor([int(RequestState.FIRST_OFFLOAD if r.steps == 0
                                         else RequestState.STEADY) for r in records])
        return self._tables[layer].update(all_topk, request_ids, stable, states,
                                          out=self._result_buffers(layer, width))

    def _result_buffers(self, layer: int, width: int) -> ResidencyResult:
        """The layer's residency outputs, allocated once per top-k width and reused every step
        (the step reads them before the layer's next update)."""
        buffers = self._results.get((layer, width))
        if buffers is None:
            rows = self.max_rows
            buffers = self._results[(layer, width)] = ResidencyResult(
                *(torch.empty(shape, dtype=RESULT_DTYPE)
                  for shape in ((rows, width), (rows,), (rows, width), (rows, width))))
        return buffers

    def _record(self, stats: LayerStepStats) -> None:
        self._pending.append(stats)
        if stats.layer == self.layout.num_layers - 1:
            self.last_step = StepStats(tuple(self._pending))
            self.totals.add(self.last_step)
            self._pending = []

    def _advance(self, layer: int, records: Sequence[_Request]) -> None:
        last = layer == self.layout.num_layers - 1
        for record in records:
            record.next_layer = 0 if last else layer + 1
            if last:
                record.length += 1
                record.steps += 1

    # -- validation ---------------------------------------------------------------------------

    def _get(self, request_id: RequestId, admitted: bool | None = True) -> _Request:
        record = self._requests.get(request_id)
        if record is None:
            raise UnknownRequestError(
                f"request {request_id!r} is not held by this engine (never admitted, or "
                "already finished)")
        if admitted is not None and record.admitted != admitted:
            state = "already admitted" if record.admitted else "reserved but not admitted yet"
            raise AdmissionError(f"request {request_id!r} is {state}")
        return record

    def _check_rows(self, rows: NewRows, count: int, what: str,
                    error: type[Exception]) -> None:
        lay = self.layout
        for name, width in (("kv", lay.latent_dim), ("k_rope", lay.rope_dim),
                            ("index_key", lay.index_dim)):
            value = getattr(rows, name)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (count, width):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                raise error(f"{what}: {name} must have shape ({count}, {width}), got {shape}")

    def _check_decode(self, layer: int, request_ids: Sequence[RequestId], rows: NewRows,
                      queries: DecodeQueries) -> list[_Request]:
        if not isinstance(layer, int) or not 0 <= layer < self.layout.num_layers:
            raise DecodeInputError(
                f"layer must be in [0, {self.layout.num_layers}), got {layer!r}")
        if not request_ids:
            raise DecodeInputError("request_ids is empty; a decode call needs at least one")
        if len(set(request_ids)) != len(request_ids):
            raise DecodeInputError(f"request_ids repeats a request: {list(request_ids)}")
        records = [self._get(rid) for rid in request_ids]
        for record in records:
            if record.next_layer != layer:
                raise DecodeInputError(
                    f"request {record.request_id!r} expects layer {record.next_layer} next, "
                    f"got layer {layer}; a step runs layers 0..{self.layout.num_layers - 1} "
                    "in order")
            if record.length >= record.rows.rows:
                raise RequestCapacityError(
                    f"request {record.request_id!r} reached its reserved {record.rows.rows} "
                    "host-pool rows (its max_tokens); finish it or admit it with a larger "
                    "max_tokens")
        count = len(records)
        self._check_rows(rows, count, f"layer {layer} rows", DecodeInputError)
        lay = self.layout
        query_shapes = (("query", 3, lay.latent_dim), ("query_rope", 3, lay.rope_dim),
                        ("index_query", 3, lay.index_dim), ("index_weights", 2, None))
        for name, dims, width in query_shapes:
            value = getattr(queries, name)
            if (not isinstance(value, torch.Tensor) or value.dim() != dims
                    or value.shape[0] != count or (width is not None
                                                   and value.shape[-1] != width)):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                want = f"[{count}, ..., {width}]" if width is not None else f"[{count}, Hi]"
                raise DecodeInputError(
                    f"layer {layer} queries: {name} must be a {dims}-d tensor {want}, "
                    f"got {shape}")
        return records

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the host pool (rank 0 unlinks it)."""
        self.store.close()

    def __enter__(self) -> SparseDecodeOffload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
