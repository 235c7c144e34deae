"""``kernel_backend="fused"``: a layer call's attention output, decode rows through the fused ops
(:mod:`kvo_vllm.dsa.offload_fused`: indexer + residency + copy + attention in two calls), the
other tokens attending to their top-k rows read straight from the pool, as the reference
gather reads them. There are no NOT_OFFLOADED rows on this path yet: every decode row goes
through the ops. It answers with attention output, not rows, so it is not a ``RowSource``."""

from __future__ import annotations

import time

import torch

from kvo_vllm.dsa.gather.contract import GatherCounts, StepInputs
from kvo_vllm.dsa.main_kv import attend_rows
from kvo_vllm.dsa.offload_fused import FusedDecode, IndexerInputs
from kvo_vllm.dsa.offload_identity import RowIdentity

_I64 = torch.int64


class FusedAttention:
    """The fused path's state (hot buffers and residency entries: :class:`FusedDecode`) and
    its per-call work. ``identity``: the manager's row identity of every layer."""

    def __init__(self, identity: list[RowIdentity], *, num_layers: int, max_rows: int,
                 capacity: int, block_size: int, top_k: int, decode_query_rows: int,
                 latent_dim: int, rope_dim: int, dtype: torch.dtype, device: torch.device
                 ) -> None:
        self.identity = identity
        self.block_size = block_size
        self.decode_query_rows = decode_query_rows
        self.latent_dim = latent_dim
        self.device = device
        self.ops = FusedDecode(
            num_layers=num_layers, max_rows=max_rows, capacity=capacity, block_size=block_size,
            top_k=top_k, decode_query_rows=decode_query_rows, latent_dim=latent_dim,
            rope_dim=rope_dim, dtype=dtype, device=device)

    @property
    def hot_buffer_bytes(self) -> int:
        return self.ops.hot_buffer_bytes

    def attend(self, layer: int, query: torch.Tensor, query_rope: torch.Tensor,
               topk: torch.Tensor, step: StepInputs, pool: tuple[torch.Tensor, torch.Tensor],
               indexer: IndexerInputs, scale: float
               ) -> tuple[torch.Tensor, GatherCounts, float]:
        """(output ``[T, N, latent]``, the call's counts, the fused ops' seconds). ``pool``:
        the layer's (latent, rope) ``[num_blocks, block_size, D]``; other arguments as for
        ``OffloadManager.attend``."""
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
        result = self.ops.run(
            layer, query=query, query_rope=query_rope, indexer=indexer, tokens=tokens,
            rows=rows_b, query_lens=query_lens[rows_b], seq_lens=seq_lens[rows_b],
            blocks=blocks[rows_b], serials=serials[rows_b], pool_latent=latent,
            pool_rope=rope, scale=scale)
        out[tokens.to(self.device)] = result.output
        counts.selected, counts.misses = result.selected, result.misses
        return out, counts, time.perf_counter() - started
