"""Reference ``lightning_indexer_manage`` / ``quant_lightning_indexer_manage``: the semantics.

Per request b (query rows ``[qs, qe)`` from the prefix sums ``actual_seq_lengths_query``):

1. Keys: token s in ``[0, actual_seq_lengths_key[b])`` lives at block
   ``index_block_table[b, s // block]``, offset ``s % block`` of ``index_key_cache``.
2. Scores ``sum_h w[t,h] * relu(q[t,h] . k[s])`` in fp32. C8: query and key are int8 after a
   Hadamard rotation (``hadamard_quant_int8``), dequantised first as ``q * query_dequant_scale``
   and ``k * index_key_dequant_scale`` (the rotation is orthogonal, so the dot products are the
   unrotated ones up to quantisation error). The BF16 op ignores the two dequant scales.
3. Causal top-k per row: query row r of Q sees ``actual_seq_lengths_key[b] - (Q - 1 - r)``
   tokens (the last row sees them all). Best first; ties go to the LOWER token index; -1 pads a
   row whose visible length is below K.
4. Residency (kvo-core rules) on the request's pool entry with the Q rows' top-k concatenated
   as one row, stable length ``offload_seq_lengths_key[b]`` (resident tokens at or past it are
   dropped first: a speculative suffix may have been rewritten on the host) and capacity
   ``num_cache_tokens[b]`` (the request's hot slots). State -3 maps token -> slot identically
   and leaves the entry alone; -2 resets the entry and lays the distinct selection into slots
   0..n-1 in ascending token order; -1 is the steady LRU update.
5. Outputs, per query row t: ``topk_src_ids[t, 0]`` / ``topk_dst_slots[t, 0]`` list the row's
   selected tokens and their hot slots, MISSES FIRST (tokens that were not resident before this
   step, in top-k order), then the hits (top-k order), then -1 padding;
   ``topk_miss_counts[t]`` is the length of that miss prefix. A token two rows select is in
   both rows' miss prefixes (each row can copy what it reads). Per request:
   ``miss_src_ids[b, :n]`` / ``miss_dst_slots[b, :n]``, ``n = miss_counts[b]``, the union of
   the rows' misses with each token once, in the order the rules filled the slots (top-k order
   of first appearance; ascending for -2); -1 after n.

Everything is validated before any output is written (``check_manage_args``), and every
request is computed before the pool and outputs are updated, so a failing call changes nothing.
"""

from __future__ import annotations

import attrs
import torch

from kvo_core.residency import RequestState, ResidencyInputError
from kvo_kernels import cache_pool
from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.manage_abi import ManageArgs, ManageLayout, RequestLayout, check_manage_args
from kvo_kernels.primitive_set import REFERENCE, Primitives
from kvo_kernels.reference.residency_step import residency_step


@attrs.frozen(eq=False)
class RequestOutputs:
    src_ids: torch.Tensor       # [Q, K] int64, misses first
    dst_slots: torch.Tensor     # [Q, K] int64
    row_miss_counts: torch.Tensor  # [Q] int64
    miss_src_ids: torch.Tensor  # [n] int64
    miss_dst_slots: torch.Tensor  # [n] int64
    new_state: tuple[torch.Tensor, torch.Tensor] | None  # (slot tokens, lru) to store


def request_keys(args: ManageArgs, req: RequestLayout, block_size: int,
                 quantised: bool) -> torch.Tensor:
    """The request's indexer keys [S, D] in token order (fp32 dequantised for C8)."""
    tokens = torch.arange(req.key_length, device=args.query.device)
    blocks = args.index_block_table[req.index].to(torch.int64)[tokens // block_size]
    flat = blocks * block_size + tokens % block_size
    keys = args.index_key_cache.reshape(-1, args.index_key_cache.shape[-1])[flat]
    if not quantised:
        return keys
    scales = args.index_key_dequant_scale.reshape(-1)[flat]
    return keys.float() * scales.float()[:, None]


def request_topk(args: ManageArgs, req: RequestLayout, layout: ManageLayout, quantised: bool,
                 primitives: Primitives) -> torch.Tensor:
    """Causal top-k of the request's query rows: [Q, K] int64, -1 padding."""
    rows = slice(req.query_start, req.query_end)
    query = args.query[rows]
    if quantised:
        query = query.float() * args.query_dequant_scale[rows].float()[..., None]
    keys = request_keys(args, req, layout.block_size, quantised)
    scores = primitives.indexer_scores(query, args.index_weights[rows], keys)
    visible = torch.tensor(req.visible_lengths(), dtype=torch.int64, device=scores.device)
    return primitives.topk_indices(scores, layout.top_k, visible)


def misses_first(topk: torch.Tensor, slots: torch.Tensor,
                 missed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reorder each row: misses, then hits, then padding, each group in top-k order."""
    valid = topk >= 0
    is_miss = valid & torch.isin(topk, missed)
    group = torch.where(is_miss, 0, torch.where(valid, 1, 2))
    order = torch.sort(group, dim=1, stable=True).indices
    return topk.gather(1, order), slots.gather(1, order), is_miss.sum(dim=1)


def manage_request(args: ManageArgs, req: RequestLayout, layout: ManageLayout, quantised: bool,
                   primitives: Primitives) -> RequestOutputs:
    topk = request_topk(args, req, layout, quantised, primitives).cpu()
    saved = None
    if req.state == RequestState.STEADY:
        saved = cache_pool.entry_state(args.cache_slots_pool, req.pool_entry, req.capacity)
    try:
        step = residency_step(saved, req.capacity, topk.reshape(-1), req.stable_length,
                              req.state, max_seq_len=req.key_length)
    except ResidencyInputError as exc:  # e.g. a pool entry no residency step could have left
        raise KernelArgumentError(
            f"cache_slots_pool entry {req.pool_entry} (request {req.index}): {exc}") from exc
    count = int(step.result.miss_counts[0])
    # The residency result is int32; this op's outputs are int64.
    miss_tokens = step.result.miss_tokens[0, :count].long()
    src, dst, row_misses = misses_first(topk, step.result.slots[0].reshape(topk.shape).long(),
                                        miss_tokens)
    new_state = None
    if req.state != RequestState.NOT_OFFLOADED:
        new_state = (step.slot_tokens, step.lru_order)
    return RequestOutputs(src_ids=src, dst_slots=dst, row_miss_counts=row_misses,
                          miss_src_ids=miss_tokens,
                          miss_dst_slots=step.result.miss_slots[0, :count].long(),
                          new_state=new_state)


def _store(args: ManageArgs, req: RequestLayout, out: RequestOutputs) -> None:
    rows = slice(req.query_start, req.query_end)
    args.topk_src_ids[rows, 0].copy_(out.src_ids)
    args.topk_dst_slots[rows, 0].copy_(out.dst_slots)
    args.topk_miss_counts[rows].copy_(out.row_miss_counts)
    count = out.miss_src_ids.shape[0]
    args.miss_src_ids[req.index].fill_(-1)
    args.miss_dst_slots[req.index].fill_(-1)
    args.miss_src_ids[req.index, :count].copy_(out.miss_src_ids)
    args.miss_dst_slots[req.index, :count].copy_(out.miss_dst_slots)
    args.miss_counts[req.index].fill_(count)
    if out.new_state is not None:
        cache_pool.store_entry_state(args.cache_slots_pool, req.pool_entry, *out.new_state)


def lightning_indexer_manage(args: ManageArgs, *, quantised: bool,
                             primitives: Primitives = REFERENCE) -> None:
    """Run the manage op (module docstring) and write its seven outputs in place."""
    layout = check_manage_args(args, quantised)
    outputs = [manage_request(args, req, layout, quantised, primitives)
               for req in layout.requests]
    for req, out in zip(layout.requests, outputs, strict=True):
        _store(args, req, out)
