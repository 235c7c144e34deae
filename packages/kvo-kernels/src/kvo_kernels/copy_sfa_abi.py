"""The 19-argument ABI of ``scatter_copy_sparse_flash_attention`` (Copy-SFA) and its checks.

Caches are paged: hot-buffer slot s of request b is row ``s % block`` of block
``hbm_block_table[b, s // block]`` of ``hbm_kv_cache`` / ``hbm_k_rope``; token t of request b
is row ``t % block`` of block ``dram_block_table[b, t // block]`` of the host views
``dram_kv_cache`` / ``dram_k_rope``. ``check_copy_sfa_args`` validates everything, including
every index the op will follow, before anything is read or written.
"""

from __future__ import annotations

import math

import attrs
import torch

from kvo_kernels import _checks as check
from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.limits import MAX_QUERY_ROWS

FLOATS = ("query_rope", "query", "hbm_k_rope", "hbm_kv_cache", "dram_k_rope", "dram_kv_cache",
          "attention_out")
METADATA = ("actual_seq_lengths_query", "actual_seq_lengths_kv", "num_cache_tokens",
            "topk_dst_slots", "topk_src_ids", "topk_miss_counts", "miss_src_ids",
            "miss_dst_slots", "miss_counts", "hbm_block_table", "dram_block_table")


@attrs.frozen
class CopySfaArgs:
    """Copy-SFA's arguments, in ABI order. hbm_k_rope, hbm_kv_cache, attention_out are written."""

    query_rope: torch.Tensor               # [T, N, Dr]
    query: torch.Tensor                    # [T, N, Dl]
    actual_seq_lengths_query: torch.Tensor  # [B] prefix sums of query rows
    actual_seq_lengths_kv: torch.Tensor    # [B] key length seen by the request's last row
    num_cache_tokens: torch.Tensor         # [B] hot slots of the request
    topk_dst_slots: torch.Tensor           # [T, 1, K] hot slots, miss prefix first
    topk_src_ids: torch.Tensor             # [T, 1, K] source tokens of those slots
    topk_miss_counts: torch.Tensor         # [T] miss prefix length per row
    miss_src_ids: torch.Tensor             # [B, W] per-request miss union (tokens)
    miss_dst_slots: torch.Tensor           # [B, W] its slots
    miss_counts: torch.Tensor              # [B]
    hbm_block_table: torch.Tensor          # [B, hbm_max_blocks]
    dram_block_table: torch.Tensor         # [B, dram_max_blocks]
    hbm_k_rope: torch.Tensor               # [hbm_blocks, block, 1, Dr] in/out
    hbm_kv_cache: torch.Tensor             # [hbm_blocks, block, 1, Dl] in/out
    dram_k_rope: torch.Tensor              # [dram_blocks, block, Dr] host view
    dram_kv_cache: torch.Tensor            # [dram_blocks, block, Dl] host view
    scale_value: float
    attention_out: torch.Tensor            # [T, N, Dl] out


@attrs.frozen
class CopySfaRequest:
    index: int
    query_start: int
    query_end: int
    kv_length: int
    cache_tokens: int
    miss_count: int

    @property
    def first_fill(self) -> bool:
        """The request's misses cover its whole hot buffer: copy the union, then attend."""
        return self.miss_count >= self.cache_tokens


@attrs.frozen
class CopySfaLayout:
    requests: tuple[CopySfaRequest, ...]
    block_size: int
    visible: torch.Tensor  # [T] int64 causal key length per query row


def physical_rows(block_table: torch.Tensor, positions: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """Flat cache rows of logical positions through one request's block table (-1 stays -1)."""
    valid = positions >= 0
    safe = torch.where(valid, positions, 0).to(torch.int64)
    rows = block_table.to(torch.int64)[safe // block_size] * block_size + safe % block_size
    return torch.where(valid, rows, -1)


def _check_shapes(args: CopySfaArgs) -> None:
    check.ndim("query", args.query, 3, "[T, N, Dl]")
    check.ndim("query_rope", args.query_rope, 3, "[T, N, Dr]")
    check.ndim("num_cache_tokens", args.num_cache_tokens, 1, "[B]")
    check.ndim("topk_dst_slots", args.topk_dst_slots, 3, "[T, 1, K]")
    check.ndim("topk_src_ids", args.topk_src_ids, 3, "[T, 1, K]")
    check.ndim("topk_miss_counts", args.topk_miss_counts, 1, "[T]")
    check.ndim("miss_src_ids", args.miss_src_ids, 2, "[B, W]")
    check.ndim("miss_dst_slots", args.miss_dst_slots, 2, "[B, W]")
    check.ndim("hbm_block_table", args.hbm_block_table, 2, "[B, hbm_max_blocks]")
    check.ndim("dram_block_table", args.dram_block_table, 2, "[B, dram_max_blocks]")
    check.ndim("hbm_k_rope", args.hbm_k_rope, 4, "[hbm_blocks, block, 1, Dr]")
    check.ndim("hbm_kv_cache", args.hbm_kv_cache, 4, "[hbm_blocks, block, 1, Dl]")
    check.ndim("dram_k_rope", args.dram_k_rope, 3, "[dram_blocks, block, Dr]")
    check.ndim("dram_kv_cache", args.dram_kv_cache, 3, "[dram_blocks, block, Dl]")
    rows, heads, latent = args.query.shape
    rope = args.query_rope.shape[2]
    batch = args.num_cache_tokens.shape[0]
    if rows == 0 or batch == 0:
        raise KernelArgumentError(
            f"query has {rows} rows and num_cache_tokens {batch} requests; both must be > 0")
    for name in ("actual_seq_lengths_query", "actual_seq_lengths_kv", "miss_counts"):
        check.ndim(name, getattr(args, name), 1, "[B]")
        check.dim_size(name, getattr(args, name), 0, batch, "num_cache_tokens.shape[0] (B)")
    check.dim_size("query_rope", args.query_rope, 0, rows, "query.shape[0] (T)")
    check.dim_size("query_rope", args.query_rope, 1, heads, "query.shape[1] (N)")
    check.dim_size("topk_dst_slots", args.topk_dst_slots, 0, rows, "query.shape[0] (T)")
    check.dim_size("topk_dst_slots", args.topk_dst_slots, 1, 1, "one key head")
    if args.topk_src_ids.shape != args.topk_dst_slots.shape:
        raise KernelArgumentError(
            f"topk_src_ids shape {tuple(args.topk_src_ids.shape)} must equal topk_dst_slots "
            f"shape {tuple(args.topk_dst_slots.shape)}")
    check.dim_size("topk_miss_counts", args.topk_miss_counts, 0, rows, "query.shape[0] (T)")
    check.dim_size("miss_src_ids", args.miss_src_ids, 0, batch, "num_cache_tokens.shape[0] (B)")
    if args.miss_dst_slots.shape != args.miss_src_ids.shape:
        raise KernelArgumentError(
            f"miss_dst_slots shape {tuple(args.miss_dst_slots.shape)} must equal miss_src_ids "
            f"shape {tuple(args.miss_src_ids.shape)}")
    for name in ("hbm_block_table", "dram_block_table"):
        check.dim_size(name, getattr(args, name), 0, batch, "num_cache_tokens.shape[0] (B)")
    block_size = args.hbm_kv_cache.shape[1]
    if block_size == 0 or args.hbm_kv_cache.shape[0] == 0 or args.dram_kv_cache.shape[0] == 0:
        raise KernelArgumentError("hbm_kv_cache and dram_kv_cache must hold at least one block")
    check.dim_size("hbm_kv_cache", args.hbm_kv_cache, 2, 1, "one kv head")
    check.dim_size("hbm_kv_cache", args.hbm_kv_cache, 3, latent, "query.shape[2] (Dl)")
    expected = {"hbm_k_rope": (args.hbm_kv_cache.shape[0], block_size, 1, rope),
                "dram_kv_cache": (args.dram_kv_cache.shape[0], block_size, latent),
                "dram_k_rope": (args.dram_kv_cache.shape[0], block_size, rope),
                "attention_out": tuple(args.query.shape)}
    for name, shape in expected.items():
        if tuple(getattr(args, name).shape) != shape:
            raise KernelArgumentError(
                f"{name} has shape {tuple(getattr(args, name).shape)}; expected {shape} "
                "(from query, query_rope, hbm_kv_cache and dram_kv_cache)")
    for name in ("hbm_k_rope", "hbm_kv_cache", "dram_k_rope", "dram_kv_cache",
                 "attention_out"):
        if not getattr(args, name).is_contiguous():
            raise KernelArgumentError(f"{name} must be contiguous (it is addressed by row)")


def _check_types_and_devices(args: CopySfaArgs) -> None:
    for field in attrs.fields(CopySfaArgs):
        if field.name != "scale_value":
            check.tensor(field.name, getattr(args, field.name))
    if isinstance(args.scale_value, bool) or not isinstance(args.scale_value, (int, float)) \
            or not math.isfinite(args.scale_value):
        raise KernelArgumentError(f"scale_value must be a finite float, got {args.scale_value!r}")
    check.dtype("query", args.query, check.FLOAT_DTYPES)
    for name in FLOATS:
        check.dtype(name, getattr(args, name), (args.query.dtype,))
    for name in METADATA:
        check.dtype(name, getattr(args, name), check.INDEX_DTYPES)
    device_bound = {name: getattr(args, name) for name in (*FLOATS, *METADATA)
                    if not name.startswith("dram_") and name != "query"}
    check.same_device("query", args.query, **device_bound)
    check.same_device("dram_kv_cache", args.dram_kv_cache, dram_k_rope=args.dram_k_rope)
    host = args.dram_kv_cache.device
    if host != args.query.device and host.type != "cpu":
        raise KernelArgumentError(
            f"dram_kv_cache is on {host}; it must be a host (cpu) view or on {args.query.device}")


def _check_block_tables(args: CopySfaArgs, layout_requests: list[CopySfaRequest],
                        block_size: int) -> None:
    for req in layout_requests:
        used = -(-req.kv_length // block_size)
        check.index_range(f"dram_block_table[{req.index}, :{used}]",
                          args.dram_block_table[req.index, :used], 0, args.dram_kv_cache.shape[0])


def _check_slots(name: str, slots: torch.Tensor, request: int, args: CopySfaArgs,
                 block_size: int) -> None:
    """Every listed hot slot lies inside the request's block table, on an existing block."""
    valid = slots[slots >= 0]
    if valid.numel() == 0:
        return
    coverage = args.hbm_block_table.shape[1] * block_size
    check.index_range(f"{name} (request {request})", valid, 0, coverage)
    blocks = torch.unique(valid.to(torch.int64) // block_size)
    check.index_range(f"hbm_block_table[{request}] (blocks of its {name})",
                      args.hbm_block_table[request].to(torch.int64)[blocks], 0,
                      args.hbm_kv_cache.shape[0])


def _check_topk(args: CopySfaArgs, req: CopySfaRequest, visible: torch.Tensor,
                block_size: int) -> None:
    rows = slice(req.query_start, req.query_end)
    src = args.topk_src_ids[rows, 0].to(torch.int64)
    dst = args.topk_dst_slots[rows, 0].to(torch.int64)
    check.index_range(f"topk_src_ids (request {req.index})", src, -1, 1 << 62)
    check.index_range(f"topk_dst_slots (request {req.index})", dst, -1, 1 << 62)
    if bool(((src < 0) != (dst < 0)).any()):
        raise KernelArgumentError(
            f"topk_dst_slots and topk_src_ids of request {req.index} disagree on padding: "
            "an entry is -1 in one and not in the other")
    valid = src >= 0
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise KernelArgumentError(
            f"topk_src_ids of request {req.index} has an entry after -1 padding; "
            "padding must come last")
    if bool((valid & (src >= visible[rows, None])).any()):
        raise KernelArgumentError(
            f"topk_src_ids of request {req.index} selects a token its query row cannot see "
            f"(row r of Q sees actual_seq_lengths_kv[{req.index}] - (Q - 1 - r) = "
            f"{visible[rows].tolist()} tokens)")
    counts = args.topk_miss_counts[rows].to(torch.int64)
    if bool(((counts < 0) | (counts > valid.sum(1))).any()):
        raise KernelArgumentError(
            f"topk_miss_counts of request {req.index} is {counts.tolist()}; each must be in "
            f"0..(selected entries of its row) = {valid.sum(1).tolist()}")
    _check_slots("topk_dst_slots", dst, req.index, args, block_size)


def _check_miss_union(args: CopySfaArgs, req: CopySfaRequest, block_size: int) -> None:
    width = args.miss_src_ids.shape[1]
    if not 0 <= req.miss_count <= width:
        raise KernelArgumentError(
            f"miss_counts[{req.index}] is {req.miss_count}; allowed: 0..{width} "
            "(miss_src_ids width)")
    src = args.miss_src_ids[req.index, :req.miss_count]
    dst = args.miss_dst_slots[req.index, :req.miss_count]
    check.index_range(f"miss_src_ids[{req.index}, :{req.miss_count}]", src, 0, req.kv_length)
    check.index_range(f"miss_dst_slots[{req.index}, :{req.miss_count}]", dst, 0, 1 << 62)
    _check_slots("miss_dst_slots", dst, req.index, args, block_size)


def check_copy_sfa_static(args: CopySfaArgs) -> None:
    """Types, shapes, dtypes and devices: everything that needs no tensor data (fake kernels)."""
    _check_types_and_devices(args)
    _check_shapes(args)


def check_copy_sfa_args(args: CopySfaArgs) -> CopySfaLayout:
    """Validate the whole call; raise KernelArgumentError naming the first bad argument."""
    check_copy_sfa_static(args)
    batch = args.num_cache_tokens.shape[0]
    ends = [int(v) for v in args.actual_seq_lengths_query.tolist()]
    kv_lengths = [int(v) for v in args.actual_seq_lengths_kv.tolist()]
    cache_tokens = [int(v) for v in args.num_cache_tokens.tolist()]
    miss_counts = [int(v) for v in args.miss_counts.tolist()]
    total_rows = args.query.shape[0]
    if ends[-1] != total_rows:
        raise KernelArgumentError(
            f"actual_seq_lengths_query ends at {ends[-1]} but query has {total_rows} rows; "
            "the last prefix sum must equal T")
    block_size = args.hbm_kv_cache.shape[1]
    host_tokens = args.dram_block_table.shape[1] * block_size
    requests = []
    visible = torch.empty(total_rows, dtype=torch.int64)
    for b in range(batch):
        start = ends[b - 1] if b else 0
        rows = ends[b] - start
        if not 1 <= rows <= MAX_QUERY_ROWS:
            raise KernelArgumentError(
                f"actual_seq_lengths_query gives request {b} {rows} query rows; allowed: "
                f"1..{MAX_QUERY_ROWS} (prefix sums must increase strictly)")
        if not rows <= kv_lengths[b] <= host_tokens:
            raise KernelArgumentError(
                f"actual_seq_lengths_kv[{b}] is {kv_lengths[b]}; allowed: {rows} (its query "
                f"rows) .. {host_tokens} (dram_block_table width x block)")
        if cache_tokens[b] < 0:
            raise KernelArgumentError(f"num_cache_tokens[{b}] is {cache_tokens[b]}; must be >= 0")
        visible[start:ends[b]] = torch.arange(kv_lengths[b] - rows + 1, kv_lengths[b] + 1)
        requests.append(CopySfaRequest(index=b, query_start=start, query_end=ends[b],
                                       kv_length=kv_lengths[b], cache_tokens=cache_tokens[b],
                                       miss_count=miss_counts[b]))
    _check_block_tables(args, requests, block_size)
    visible = visible.to(args.query.device)
    for req in requests:
        _check_topk(args, req, visible, block_size)
        _check_miss_union(args, req, block_size)
    return CopySfaLayout(requests=tuple(requests), block_size=block_size, visible=visible)
