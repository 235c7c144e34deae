"""``kernel_backend="fused"``: decode rows of offloaded layers through kvo-kernels' fused ops.

Per layer call, the decode requests (query rows <= the decode limit) of the batch run as one
call of each fused op, with the implementation kvo-kernels' dispatch picks for the tensors'
device (the reference on CPU):

1. ``kvo::lightning_indexer_manage`` (C8 cache: ``kvo::quant_lightning_indexer_manage``) scores
   the request's indexer keys, takes the causal top-k and runs the residency update on the
   request's entry of ``cache_slots_pool``; it returns, per query row, the selected tokens and
   their hot slots (misses first) and, per request, the union of misses;
2. ``kvo::scatter_copy_sparse_flash_attention`` copies those misses from the host pool into the
   hot buffer and runs sparse MLA attention over the hot slots.

Where vLLM's layout and the ops' ABI differ, this module adapts (the ops are unchanged):

- the host pool keeps latent and rope apart (``HostKVStore(rope_apart=True)``), since the op
  takes ``dram_kv_cache`` / ``dram_k_rope`` as two contiguous tensors; the hot buffer likewise
  is two tensors per layer, ``[max_rows x capacity / block, block, 1, D]``;
- the pool is paged by vLLM's own blocks (``dram_block_table`` is vLLM's block table), the hot
  buffer by blocks of the same size (``hbm_block_table`` row ``b``: batch row ``b``'s
  ``capacity / block`` blocks), ``req_pool_entries`` is the batch row;
- the ABI has no request id: a batch row whose request changed (``RowIdentity``'s serial) is
  sent with request state -2 (first offload: the entry is reset), else -1 (steady);
- the indexer's query and weights come from kvo's indexer op (which skips its own top-k for
  batches of decode rows only: the manage op selects), in the ABI's dtypes: the BF16 op's
  query in the key cache's bf16 (kvo's bf16 indexer rounds the query to bf16 on every path,
  so fused and non-fused score the same operands), C8's int8 Hadamard-rotated with fp16 scales.

vLLM's top-k buffer is not written for these rows: only kvo's own attention impl reads it.
"""

from __future__ import annotations

import time

import attrs
import torch

from kvo_core.residency import RequestState
from kvo_kernels import ops
from kvo_kernels.cache_pool import new_cache_slots_pool
from kvo_vllm.dsa.gather.contract import GatherCounts, StepInputs
from kvo_vllm.dsa.main_kv import attend_rows
from kvo_vllm.dsa.offload_identity import RowIdentity

_I64 = torch.int64


@attrs.frozen(eq=False)
class IndexerInputs:
    """One layer call's lightning-indexer operands in the manage ABI's form (all tokens)."""

    query: torch.Tensor        # [T, H, D]: bf16 (BF16 op) or int8 (C8)
    query_scale: torch.Tensor  # [T, H]: fp16 dequant scales (C8); ones for the BF16 op
    weights: torch.Tensor      # [T, H] float32
    key_cache: torch.Tensor    # [blocks, block, 1, D]: bf16 or int8
    key_scale: torch.Tensor    # [blocks, block, 1]: fp16 (C8); ones for the BF16 op
    quantised: bool


@attrs.frozen(eq=False)
class FusedDecodeResult:
    output: torch.Tensor       # [T', N, latent] attention output of the decode tokens
    selected: int              # valid top-k entries over the decode tokens
    misses: int                # rows copied host -> hot buffer


class FusedDecode:
    """Hot buffers (latent, rope) and residency entries of every layer for the fused ops, and
    the layer calls they serve (:meth:`attend`). ``identity``: the manager's row identity of
    every layer."""

    def __init__(self, identity: list[RowIdentity], *, num_layers: int, max_rows: int,
                 capacity: int, block_size: int, top_k: int, decode_query_rows: int,
                 latent_dim: int, rope_dim: int, dtype: torch.dtype, device: torch.device
                 ) -> None:
        if capacity % block_size:
            raise ValueError(f"hot capacity {capacity} must be a multiple of the block size "
                             f"{block_size} (the fused op pages the hot buffer by blocks)")
        self.identity = identity
        self.capacity = capacity
        self.block_size = block_size
        self.top_k = top_k
        self.decode_query_rows = decode_query_rows
        self.miss_width = decode_query_rows * top_k
        self.latent_dim = latent_dim
        self.device = device
        blocks = max_rows * capacity // block_size
        self.hot_latent = [torch.zeros(blocks, block_size, 1, latent_dim, dtype=dtype,
                                       device=device) for _ in range(num_layers)]
        self.hot_rope = [torch.zeros(blocks, block_size, 1, rope_dim, dtype=dtype,
                                     device=device) for _ in range(num_layers)]
        self.slot_pools = [new_cache_slots_pool(max_rows, capacity, device=device)
                           for _ in range(num_layers)]
        self.entry_serials = [torch.full((max_rows,), -1, dtype=_I64)
                              for _ in range(num_layers)]

    @property
    def hot_buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.hot_latent, *self.hot_rope))

    def run(self, layer: int, *, query: torch.Tensor, query_rope: torch.Tensor,
            indexer: IndexerInputs, tokens: torch.Tensor, rows: torch.Tensor,
            query_lens: torch.Tensor, seq_lens: torch.Tensor, blocks: torch.Tensor,
            serials: torch.Tensor, pool_latent: torch.Tensor, pool_rope: torch.Tensor,
            scale: float) -> FusedDecodeResult:
        """Manage + Copy-SFA for decode batch rows ``rows`` (ascending) and their ``tokens``.

        ``query_lens``, ``seq_lens``, ``blocks`` (vLLM's block table) and ``serials`` are those
        rows' values; ``pool_latent`` / ``pool_rope`` the layer's pool ``[blocks, block, D]``.
        """
        dev = self.device
        count, batch = int(tokens.numel()), int(rows.numel())
        ends = torch.cumsum(query_lens, 0).to(dev)
        key_lens = seq_lens.to(dev)
        stable = (seq_lens - query_lens).to(dev)
        capacity = torch.full((batch,), self.capacity, dtype=_I64, device=dev)
        same = self.entry_serials[layer][rows] == serials
        states = torch.where(same, int(RequestState.STEADY), int(RequestState.FIRST_OFFLOAD))
        self.entry_serials[layer][rows] = serials
        table = blocks.to(dev)
        entries = rows.to(dev)
        topk_src = torch.empty(count, 1, self.top_k, dtype=_I64, device=dev)
        topk_dst = torch.empty_like(topk_src)
        row_misses = torch.empty(count, dtype=_I64, device=dev)
        miss_src = torch.empty(batch, self.miss_width, dtype=_I64, device=dev)
        miss_dst = torch.empty_like(miss_src)
        miss_counts = torch.empty(batch, dtype=_I64, device=dev)
        manage = (ops.quant_lightning_indexer_manage if indexer.quantised
                  else ops.lightning_indexer_manage)
        tok = tokens.to(dev)
        manage(indexer.weights[tok], indexer.query_scale[tok], indexer.query[tok],
               indexer.key_scale, indexer.key_cache, table, ends, key_lens, stable, capacity,
               states.to(dev), entries, self.slot_pools[layer], topk_src, topk_dst, row_misses,
               miss_src, miss_dst, miss_counts)

        per_row = self.capacity // self.block_size
        hbm_table = entries[:, None] * per_row + torch.arange(per_row, device=dev)[None, :]
        out = torch.empty(count, *query.shape[1:], dtype=query.dtype, device=dev)
        ops.scatter_copy_sparse_flash_attention(
            query_rope[tok].contiguous(), query[tok].contiguous(), ends, key_lens, capacity,
            topk_dst, topk_src, row_misses, miss_src, miss_dst, miss_counts, hbm_table, table,
            self.hot_rope[layer], self.hot_latent[layer], pool_rope, pool_latent, scale, out)
        return FusedDecodeResult(output=out, selected=int((topk_src >= 0).sum()),
                                 misses=int(miss_counts.sum()))

    def attend(self, layer: int, query: torch.Tensor, query_rope: torch.Tensor,
               topk: torch.Tensor, step: StepInputs, pool: tuple[torch.Tensor, torch.Tensor],
               indexer: IndexerInputs, scale: float
               ) -> tuple[torch.Tensor, GatherCounts, float]:
        """A layer call: (output ``[T, N, latent]``, its counts, the fused ops' seconds).
        Decode rows through :meth:`run`; the other tokens attend to their ``topk`` rows read
        straight from ``pool``, the layer's (latent, rope) ``[num_blocks, block_size, D]``.
        There are no NOT_OFFLOADED rows here yet: every decode row goes through the ops."""
        seq_lens, query_lens, blocks = step.seq_lens, step.query_lens, step.blocks
        count, requests, bs = int(query.shape[0]), step.requests, self.block_size
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
        latent, rope = pool
        if direct.numel():
            picks = topk[:count].cpu().to(_I64)[direct]
            valid = picks >= 0
            pos = picks.clamp(min=0)
            pool_rows = blocks[req[direct]].gather(1, pos // bs) * bs + pos % bs
            rows = torch.cat([latent.flatten(0, 1)[pool_rows], rope.flatten(0, 1)[pool_rows]],
                             dim=-1).to(self.device)
            rows[~valid.to(self.device)] = 0
            where = direct.to(self.device)
            out[where] = attend_rows(query[where], query_rope[where], rows,
                                     valid.to(self.device), self.latent_dim, scale)
        counts = GatherCounts(
            decode_rows=int(decode.sum()), decode_tokens=int(decode_tok.sum()),
            pool_rows=int((~decode).sum()), selected=0, misses=0,
            reload_tokens=int(seq_lens[decode].sum()), pool_rows_used=int(seq_lens.sum()))
        if not bool(decode.any()):
            return out, counts, 0.0
        started = time.perf_counter()
        rows_b = decode.nonzero().squeeze(1)
        tokens = decode_tok.nonzero().squeeze(1)
        result = self.run(
            layer, query=query, query_rope=query_rope, indexer=indexer, tokens=tokens,
            rows=rows_b, query_lens=query_lens[rows_b], seq_lens=seq_lens[rows_b],
            blocks=blocks[rows_b], serials=serials[rows_b], pool_latent=latent,
            pool_rope=rope, scale=scale)
        out[tokens.to(self.device)] = result.output
        counts.selected, counts.misses = result.selected, result.misses
        return out, counts, time.perf_counter() - started
