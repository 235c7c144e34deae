"""Reference ``scatter_copy_sparse_flash_attention`` (Copy-SFA): the semantics.

1. Copy the missing rows host -> hot buffer, per request by one of two paths:
   - first fill, when ``miss_counts[b] >= num_cache_tokens[b]`` (the misses cover the whole
     hot buffer, as on a request's first offloaded step): copy the request's de-duplicated
     union ``miss_src_ids[b, :n] -> miss_dst_slots[b, :n]``;
   - steady otherwise: every query row copies its own miss prefix, ``topk_src_ids[t, 0, :m]
     -> topk_dst_slots[t, 0, :m]`` with ``m = topk_miss_counts[t]`` (a token two rows miss is
     copied once; one slot named for two different tokens is an error).
   For metadata written by the manage op both paths copy the same rows; they differ in how a
   kernel schedules them (the steady path overlaps the copy with attention; upstream decides
   per batch, this reference per request, which gives the same result).
2. Sparse MLA attention of each query row over its selected hot slots: keys
   ``concat(kv, k_rope)``, values ``kv``, logits ``scale_value * (q . kv + q_rope . k_rope)``,
   fp32 softmax; -1 entries are skipped, a row without entries yields zeros. Output written to
   ``attention_out`` in the query dtype.

The attention reads only the hot buffer, so its result equals dense attention over the same
tokens of the full host cache exactly when the copy step made every selected slot current.
(Upstream's native op also attends a causal, never-offloaded tail kept on the device; kvo keeps
every token in the host pool and lets the top-k select it, so it has no such tail.)
"""

from __future__ import annotations

import torch

from kvo_kernels.copy_sfa_abi import (
    CopySfaArgs,
    CopySfaLayout,
    CopySfaRequest,
    check_copy_sfa_args,
    physical_rows,
)
from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.primitive_set import REFERENCE, Primitives


def request_copies(args: CopySfaArgs, req: CopySfaRequest) -> tuple[torch.Tensor, torch.Tensor]:
    """The (source token, hot slot) pairs the request's path copies, int64, unordered."""
    if req.first_fill:
        src = args.miss_src_ids[req.index, :req.miss_count]
        dst = args.miss_dst_slots[req.index, :req.miss_count]
        return src.to(torch.int64), dst.to(torch.int64)
    rows = slice(req.query_start, req.query_end)
    counts = args.topk_miss_counts[rows].to(torch.int64)
    width = args.topk_src_ids.shape[2]
    prefix = torch.arange(width, device=counts.device)[None, :] < counts[:, None]
    src = args.topk_src_ids[rows, 0].to(torch.int64)[prefix]
    dst = args.topk_dst_slots[rows, 0].to(torch.int64)[prefix]
    return src, dst


def copy_plan(args: CopySfaArgs, layout: CopySfaLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat host rows -> flat hot-buffer rows for the whole batch, each destination once."""
    host_rows, hot_rows = [], []
    for req in layout.requests:
        src, dst = request_copies(args, req)
        host_rows.append(physical_rows(args.dram_block_table[req.index], src, layout.block_size))
        hot_rows.append(physical_rows(args.hbm_block_table[req.index], dst, layout.block_size))
    pairs = torch.unique(torch.stack([torch.cat(hot_rows), torch.cat(host_rows)]), dim=1)
    if torch.unique(pairs[0]).numel() != pairs.shape[1]:
        raise KernelArgumentError(
            "topk_dst_slots / miss_dst_slots (through hbm_block_table) name one hot-buffer row "
            "for two different source tokens in this call")
    return pairs[1], pairs[0]


def scatter_copy_sparse_flash_attention(args: CopySfaArgs, *,
                                        primitives: Primitives = REFERENCE) -> None:
    """Run Copy-SFA (module docstring): update the hot buffer, write ``attention_out``."""
    layout = check_copy_sfa_args(args)
    host_rows, hot_rows = copy_plan(args, layout)
    latent, rope = args.hbm_kv_cache.shape[-1], args.hbm_k_rope.shape[-1]
    hot_kv, hot_rope = args.hbm_kv_cache.view(-1, latent), args.hbm_k_rope.view(-1, rope)
    host_device = args.dram_kv_cache.device
    src_rows = host_rows.to(host_device)
    for src, dst in ((args.dram_kv_cache.view(-1, latent), hot_kv),
                     (args.dram_k_rope.view(-1, rope), hot_rope)):
        primitives.sparse_copy(src, dst, src_rows, hot_rows)

    rows, _, top_k = args.topk_dst_slots.shape
    slots = torch.full((rows, top_k), -1, dtype=torch.int64, device=args.query.device)
    for req in layout.requests:
        own = slice(req.query_start, req.query_end)
        slots[own] = physical_rows(args.hbm_block_table[req.index],
                                   args.topk_dst_slots[own, 0].to(torch.int64),
                                   layout.block_size)
    out = primitives.sparse_mla_attention(args.query, args.query_rope, hot_kv, hot_rope, slots,
                                          float(args.scale_value))
    args.attention_out.copy_(out)
