"""The 19-argument "manage" ABI shared by ``lightning_indexer_manage`` and its C8 variant.

``ManageArgs`` names the arguments in ABI order; ``check_manage_args`` validates every shape,
dtype, device, limit and metadata value before anything is read through an index, and returns
the per-request layout as plain ints (``ManageLayout``) for the implementations to loop over.
"""

from __future__ import annotations

import attrs
import torch

from kvo_core.residency import RequestState
from kvo_kernels import _checks as check
from kvo_kernels import cache_pool
from kvo_kernels.errors import KernelArgumentError, KernelUnsupportedError
from kvo_kernels.limits import MAX_CAPACITY, MAX_QUERY_ROWS

FP8_DTYPES = tuple(getattr(torch, name) for name in
                   ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, name))
OUTPUTS = ("cache_slots_pool", "topk_src_ids", "topk_dst_slots", "topk_miss_counts",
           "miss_src_ids", "miss_dst_slots", "miss_counts")


@attrs.frozen
class ManageArgs:
    """The manage ABI, in order. The last seven tensors are written in place."""

    index_weights: torch.Tensor            # [T, H] float
    query_dequant_scale: torch.Tensor      # [T, H] (C8: fp16; BF16 op: unused, shape only)
    query: torch.Tensor                    # [T, H, D] (C8: int8)
    index_key_dequant_scale: torch.Tensor  # [blocks, block, 1] (C8: fp16; BF16 op: unused)
    index_key_cache: torch.Tensor          # [blocks, block, 1, D] (C8: int8)
    index_block_table: torch.Tensor        # [B, max_blocks] int
    actual_seq_lengths_query: torch.Tensor  # [B] prefix sums of query rows
    actual_seq_lengths_key: torch.Tensor   # [B] key length seen by the request's last row
    offload_seq_lengths_key: torch.Tensor  # [B] stable prefix length
    num_cache_tokens: torch.Tensor         # [B] hot slots of the request
    request_state: torch.Tensor            # [B] -3 / -2 / -1
    req_pool_entries: torch.Tensor         # [B] row of cache_slots_pool
    cache_slots_pool: torch.Tensor         # [POOL, 2, C] in/out (see kvo_kernels.cache_pool)
    topk_src_ids: torch.Tensor             # [T, 1, K] out
    topk_dst_slots: torch.Tensor           # [T, 1, K] out
    topk_miss_counts: torch.Tensor         # [T] out
    miss_src_ids: torch.Tensor             # [B, W] out
    miss_dst_slots: torch.Tensor           # [B, W] out
    miss_counts: torch.Tensor              # [B] out


@attrs.frozen
class RequestLayout:
    """One request's metadata, read once from the metadata tensors."""

    index: int
    query_start: int
    query_end: int
    key_length: int
    stable_length: int
    capacity: int
    state: RequestState
    pool_entry: int

    @property
    def rows(self) -> int:
        return self.query_end - self.query_start

    def visible_lengths(self) -> list[int]:
        """Causal key length per query row: the last row sees ``key_length`` tokens."""
        return [self.key_length - (self.rows - 1 - r) for r in range(self.rows)]


@attrs.frozen
class ManageLayout:
    requests: tuple[RequestLayout, ...]
    total_rows: int
    top_k: int
    block_size: int
    head_dim: int


def _metadata(name: str, value: torch.Tensor, batch: int) -> list[int]:
    check.ndim(name, value, 1, "[B]")
    check.dtype(name, value, check.INDEX_DTYPES)
    check.dim_size(name, value, 0, batch, "index_block_table.shape[0] (B)")
    return [int(v) for v in value.tolist()]


def _check_dtypes(args: ManageArgs, quantised: bool) -> None:
    for name in ("query", "index_key_cache"):
        value = getattr(args, name)
        if value.dtype in FP8_DTYPES:
            raise KernelUnsupportedError(
                f"{name} has dtype {value.dtype}: the fp8 indexer is not supported; "
                "the quantised indexer is int8 only (see hadamard_quant_int8)")
    check.dtype("index_weights", args.index_weights, check.FLOAT_DTYPES)
    if quantised:
        check.dtype("query", args.query, (torch.int8,))
        check.dtype("index_key_cache", args.index_key_cache, (torch.int8,))
        check.dtype("query_dequant_scale", args.query_dequant_scale, (torch.float16,))
        check.dtype("index_key_dequant_scale", args.index_key_dequant_scale, (torch.float16,))
    else:
        check.dtype("query", args.query, check.FLOAT_DTYPES)
        check.dtype("index_key_cache", args.index_key_cache, (args.query.dtype,))
        check.dtype("query_dequant_scale", args.query_dequant_scale, check.FLOAT_DTYPES)
        check.dtype("index_key_dequant_scale", args.index_key_dequant_scale,
                    check.FLOAT_DTYPES)
    for name in ("index_block_table", *OUTPUTS):
        check.dtype(name, getattr(args, name), check.INDEX_DTYPES)


def _check_shapes(args: ManageArgs) -> None:
    check.ndim("query", args.query, 3, "[T, H, D]")
    check.ndim("index_weights", args.index_weights, 2, "[T, H]")
    check.ndim("query_dequant_scale", args.query_dequant_scale, 2, "[T, H]")
    check.ndim("index_key_cache", args.index_key_cache, 4, "[blocks, block, 1, D]")
    check.ndim("index_key_dequant_scale", args.index_key_dequant_scale, 3, "[blocks, block, 1]")
    check.ndim("index_block_table", args.index_block_table, 2, "[B, max_blocks]")
    check.ndim("cache_slots_pool", args.cache_slots_pool, 3, "[POOL, 2, C]")
    check.ndim("topk_src_ids", args.topk_src_ids, 3, "[T, 1, K]")
    check.ndim("topk_dst_slots", args.topk_dst_slots, 3, "[T, 1, K]")
    check.ndim("topk_miss_counts", args.topk_miss_counts, 1, "[T]")
    check.ndim("miss_src_ids", args.miss_src_ids, 2, "[B, W]")
    check.ndim("miss_dst_slots", args.miss_dst_slots, 2, "[B, W]")
    rows, heads, dim = args.query.shape
    batch = args.index_block_table.shape[0]
    blocks, block_size = args.index_key_cache.shape[:2]
    if rows == 0 or batch == 0:
        raise KernelArgumentError(
            f"query has {rows} rows and index_block_table {batch} requests; both must be > 0")
    if block_size == 0 or blocks == 0:
        raise KernelArgumentError(
            f"index_key_cache shape {tuple(args.index_key_cache.shape)} has no tokens")
    for name in ("index_weights", "query_dequant_scale"):
        check.dim_size(name, getattr(args, name), 0, rows, "query.shape[0] (T)")
        check.dim_size(name, getattr(args, name), 1, heads, "query.shape[1] (H)")
    check.dim_size("index_key_cache", args.index_key_cache, 2, 1, "one key head")
    check.dim_size("index_key_cache", args.index_key_cache, 3, dim, "query.shape[2] (D)")
    check.dim_size("index_key_dequant_scale", args.index_key_dequant_scale, 0, blocks,
                   "index_key_cache.shape[0] (blocks)")
    check.dim_size("index_key_dequant_scale", args.index_key_dequant_scale, 1, block_size,
                   "index_key_cache.shape[1] (block)")
    check.dim_size("index_key_dequant_scale", args.index_key_dequant_scale, 2, 1, "one key head")
    check.dim_size("cache_slots_pool", args.cache_slots_pool, 1, 2, "2 (slot tokens, LRU order)")
    if args.cache_slots_pool.shape[0] == 0 or args.cache_slots_pool.shape[2] == 0:
        raise KernelArgumentError(
            f"cache_slots_pool shape {tuple(args.cache_slots_pool.shape)} is empty")
    check.dim_size("topk_src_ids", args.topk_src_ids, 0, rows, "query.shape[0] (T)")
    check.dim_size("topk_src_ids", args.topk_src_ids, 1, 1, "one key head")
    if args.topk_src_ids.shape[2] == 0:
        raise KernelArgumentError("topk_src_ids has top-k width 0; it must be >= 1")
    if args.topk_dst_slots.shape != args.topk_src_ids.shape:
        raise KernelArgumentError(
            f"topk_dst_slots shape {tuple(args.topk_dst_slots.shape)} must equal topk_src_ids "
            f"shape {tuple(args.topk_src_ids.shape)}")
    check.dim_size("topk_miss_counts", args.topk_miss_counts, 0, rows, "query.shape[0] (T)")
    check.dim_size("miss_src_ids", args.miss_src_ids, 0, batch, "index_block_table.shape[0] (B)")
    if args.miss_dst_slots.shape != args.miss_src_ids.shape:
        raise KernelArgumentError(
            f"miss_dst_slots shape {tuple(args.miss_dst_slots.shape)} must equal miss_src_ids "
            f"shape {tuple(args.miss_src_ids.shape)}")
    for name in OUTPUTS:
        if not getattr(args, name).is_contiguous():
            raise KernelArgumentError(f"{name} must be contiguous (it is written in place)")


def _check_request(req: RequestLayout, args: ManageArgs, top_k: int,
                   used_entries: dict[int, int]) -> None:
    b = req.index
    rows = req.rows
    if not 1 <= rows <= MAX_QUERY_ROWS:
        raise KernelArgumentError(
            f"actual_seq_lengths_query gives request {b} {rows} query rows; allowed: "
            f"1..{MAX_QUERY_ROWS} (prefix sums must increase strictly)")
    max_tokens = args.index_block_table.shape[1] * args.index_key_cache.shape[1]
    if not rows <= req.key_length <= max_tokens:
        raise KernelArgumentError(
            f"actual_seq_lengths_key[{b}] is {req.key_length}; allowed: {rows} (its query "
            f"rows) .. {max_tokens} (index_block_table width x block)")
    if not 0 <= req.stable_length <= req.key_length:
        raise KernelArgumentError(
            f"offload_seq_lengths_key[{b}] is {req.stable_length}; allowed: "
            f"0..actual_seq_lengths_key[{b}] ({req.key_length})")
    if req.state == RequestState.NOT_OFFLOADED:
        return
    pool_rows, _, pool_capacity = args.cache_slots_pool.shape
    if not 0 <= req.pool_entry < pool_rows:
        raise KernelArgumentError(
            f"req_pool_entries[{b}] is {req.pool_entry}; allowed: 0..{pool_rows - 1} "
            "(cache_slots_pool rows)")
    if req.pool_entry in used_entries:
        raise KernelArgumentError(
            f"req_pool_entries[{b}] is {req.pool_entry}, already used by request "
            f"{used_entries[req.pool_entry]}; offloaded requests need distinct entries")
    used_entries[req.pool_entry] = b
    needed = min(rows * top_k, req.key_length)
    limit = min(pool_capacity, MAX_CAPACITY)
    if not needed <= req.capacity <= limit:
        raise KernelArgumentError(
            f"num_cache_tokens[{b}] is {req.capacity}; allowed: {needed} (distinct tokens "
            f"its {rows} rows can select) .. {limit} (cache_slots_pool width, at most "
            f"{MAX_CAPACITY})")
    if args.miss_src_ids.shape[1] < needed:
        raise KernelArgumentError(
            f"miss_src_ids width {args.miss_src_ids.shape[1]} cannot hold request {b}'s "
            f"misses; it must be >= {needed}")
    if req.state == RequestState.STEADY:
        _, lru = cache_pool.entry_state(args.cache_slots_pool, req.pool_entry, req.capacity)
        if not torch.equal(torch.sort(lru).values, torch.arange(req.capacity, device=lru.device)):
            raise KernelArgumentError(
                f"cache_slots_pool[{req.pool_entry}, 1, :{req.capacity}] (request {b}'s LRU "
                "order) is not a permutation of its slots; create the pool with "
                "new_cache_slots_pool and start each request with state -2")


def check_manage_static(args: ManageArgs, quantised: bool) -> None:
    """Types, shapes, dtypes and devices: everything that needs no tensor data (fake kernels)."""
    for field in attrs.fields(ManageArgs):
        check.tensor(field.name, getattr(args, field.name))
    _check_shapes(args)
    _check_dtypes(args, quantised)
    others = {f.name: getattr(args, f.name) for f in attrs.fields(ManageArgs)}
    check.same_device("query", others.pop("query"), **others)


def check_manage_args(args: ManageArgs, quantised: bool) -> ManageLayout:
    """Validate the whole call; raise KernelArgumentError naming the first bad argument."""
    check_manage_static(args, quantised)
    batch = args.index_block_table.shape[0]
    ends = _metadata("actual_seq_lengths_query", args.actual_seq_lengths_query, batch)
    key_lengths = _metadata("actual_seq_lengths_key", args.actual_seq_lengths_key, batch)
    stable = _metadata("offload_seq_lengths_key", args.offload_seq_lengths_key, batch)
    capacities = _metadata("num_cache_tokens", args.num_cache_tokens, batch)
    states = _metadata("request_state", args.request_state, batch)
    entries = _metadata("req_pool_entries", args.req_pool_entries, batch)
    _metadata("miss_counts", args.miss_counts, batch)
    total_rows = args.query.shape[0]
    if ends[-1] != total_rows:
        raise KernelArgumentError(
            f"actual_seq_lengths_query ends at {ends[-1]} but query has {total_rows} rows; "
            "the last prefix sum must equal T")
    allowed_states = {int(s) for s in RequestState}
    top_k = args.topk_src_ids.shape[2]
    requests: list[RequestLayout] = []
    used_entries: dict[int, int] = {}
    for b in range(batch):
        if states[b] not in allowed_states:
            raise KernelArgumentError(
                f"request_state[{b}] is {states[b]}; allowed: -3 (not offloaded), "
                "-2 (first offload), -1 (steady)")
        req = RequestLayout(index=b, query_start=ends[b - 1] if b else 0, query_end=ends[b],
                            key_length=key_lengths[b], stable_length=stable[b],
                            capacity=capacities[b], state=RequestState(states[b]),
                            pool_entry=entries[b])
        _check_request(req, args, top_k, used_entries)
        requests.append(req)
    block_size = args.index_key_cache.shape[1]
    for req in requests:
        used_blocks = -(-req.key_length // block_size)
        check.index_range(f"index_block_table[{req.index}, :{used_blocks}]",
                          args.index_block_table[req.index, :used_blocks], 0,
                          args.index_key_cache.shape[0])
    return ManageLayout(requests=tuple(requests), total_rows=total_rows, top_k=top_k,
                        block_size=block_size, head_dim=args.query.shape[2])
