"""The reference gather: answers every call, in plain PyTorch; the others are checked against it.

Batch rows whose query has at most ``decode_query_rows`` tokens (decode, MTP drafts) are served
from their hot row: a row whose sequence fits it is NOT_OFFLOADED (position ``p`` at hot slot
``p``, filled from the pool once per position: ``offload_hot_rows``), the others go through
residency: their query rows' top-k lists are concatenated into the request's residency row,
the table returns hits, misses and slots, only the misses are copied pool -> hot buffer, and
each query row reads its hot rows through its slots (a row that just outgrew its hot row goes
FIRST_OFFLOAD: the table resets it and copies the selection, ascending). Longer queries
(prefill chunks) read the pool itself: their top-k union would not fit a hot row, and they
write most of what they read in the same call.

With the pool on the attention's device the answer names rows by slot, in the hot buffer and,
for prefill tokens, in the pool (``SelectedRows.overlay``): no gathered copy, which the
attention would gather again. Padding reads a finite row, masked.
"""

from __future__ import annotations

import torch

from kvo_vllm.dsa.gather.contract import GatherCounts, Gathered, LayerCall
from kvo_vllm.dsa.gather.layers import OffloadLayers
from kvo_vllm.dsa.main_kv import RowOverlay, SelectedRows

_I64 = torch.int64


def _overlay(decode_tok: torch.Tensor, hot: torch.Tensor, hot_index: torch.Tensor
             ) -> RowOverlay | None:
    """The decode tokens' hot rows as a :class:`RowOverlay` (None without decode tokens)."""
    tokens = decode_tok.nonzero().squeeze(1)
    if not tokens.numel():
        return None
    return RowOverlay(tokens=tokens, rows=hot, slots=hot_index[tokens])


class ReferenceGather:
    """Every call, any mix of decode, MTP and prefill rows (module docstring)."""

    name = "reference"

    def __init__(self, layers: OffloadLayers) -> None:
        self.layers = layers

    def select_rows(self, call: LayerCall) -> Gathered:
        lay, layer, step = self.layers, call.layer, call.step
        topk = call.topk.to(_I64)
        seq_lens, query_lens, blocks = step.seq_lens, step.query_lens, step.blocks
        count, requests = int(topk.shape[0]), step.requests
        req = torch.repeat_interleave(torch.arange(requests, dtype=_I64), query_lens)
        if req.numel() != count:
            raise ValueError(f"top-k has {count} rows, the query start locations name "
                             f"{req.numel()} tokens")
        serials = lay.serials(call)
        decode = (query_lens >= 1) & (query_lens <= lay.decode_query_rows)
        lay.identity[layer].forget(~decode)
        offloaded, counts = decode, GatherCounts(
            decode_rows=int(decode.sum()), decode_tokens=0, pool_rows=int((~decode).sum()),
            selected=0, misses=0, reload_tokens=int(seq_lens[decode].sum()),
            pool_rows_used=int(seq_lens.sum()))
        first: torch.Tensor | None = None
        held = lay.held[layer]
        if held.any_held or (requests and step.shortest <= lay.capacity):
            # A NOT_OFFLOADED row may be in play, or a row leaving that state.
            plan = held.plan(serials, seq_lens, query_lens, decode)
            offloaded, first = decode & ~plan.identity, plan.first
            counts.identity_rows = int(plan.identity.sum())
            counts.first_offloads = int(plan.first.sum())
            counts.identity_fills = lay.fill_identity_rows(layer, plan, blocks)
        valid = topk >= 0
        pos = topk.clamp(min=0)
        hot_index = req[:, None] * lay.capacity + pos      # NOT_OFFLOADED tokens' hot rows
        offloaded_tok = offloaded[req]
        if bool(offloaded.any()):
            residency_index, counts.misses = self._residency(
                call, topk, req, offloaded, offloaded_tok, serials, first)
            hot_index[offloaded_tok] = residency_index[offloaded_tok]
        decode_tok = decode[req]
        counts.decode_tokens = int(decode_tok.sum())
        counts.selected = int(valid[decode_tok].sum())
        return Gathered(rows=self._answer(layer, blocks, req, pos, valid, decode_tok, hot_index),
                        counts=counts)

    def _residency(self, call: LayerCall, topk: torch.Tensor, req: torch.Tensor,
                   steady: torch.Tensor, steady_tok: torch.Tensor, serials: torch.Tensor,
                   first: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """Residency update and miss copies of the rows in ``steady`` (FIRST_OFFLOAD those in
        ``first``); returns each token's hot-buffer rows and the misses."""
        lay, step = self.layers, call.step
        count, width = topk.shape
        requests = step.requests
        row_width = lay.decode_query_rows * width
        query_row = torch.arange(count, dtype=_I64) - step.query_start_loc[req]
        cols = query_row[:, None] * width + torch.arange(width, dtype=_I64)[None, :]
        cols = cols.clamp(max=row_width - 1)  # other tokens: never read below
        row_topk = torch.full((requests, row_width), -1, dtype=_I64)
        tok = steady_tok.nonzero().squeeze(1)
        row_topk[req[tok][:, None].expand(-1, width), cols[tok]] = topk[tok]
        result = lay.residency.update(call.layer, row_topk, serials,
                                      step.seq_lens - step.query_lens, requests,
                                      steady=steady, first=first)
        misses = lay.copy_misses(call.layer,
                                 *lay.residency.miss_rows(result, step.blocks, requests))
        slots = result.slots[req[:, None], cols].to(_I64)                 # [T, K]
        return req[:, None] * lay.capacity + slots.clamp(min=0), misses

    def _answer(self, layer: int, blocks: torch.Tensor, req: torch.Tensor, pos: torch.Tensor,
                valid: torch.Tensor, decode_tok: torch.Tensor, hot_index: torch.Tensor
                ) -> SelectedRows:
        lay = self.layers
        hot, pool = lay.hot[layer], lay.pools[layer]
        direct = ~decode_tok
        any_direct = bool(direct.any())
        if pool.device == lay.device:
            none = torch.full_like(hot_index, -1)
            if not any_direct:
                return SelectedRows(rows=hot, valid=valid,
                                    slots=torch.where(valid, hot_index, none))
            pool_rows = lay.pool_rows(blocks, req, pos)
            return SelectedRows(rows=pool, valid=valid, slots=torch.where(valid, pool_rows, none),
                                overlay=_overlay(decode_tok, hot, hot_index))
        out = torch.empty(*pos.shape, lay.row_dim, dtype=hot.dtype, device=lay.device)
        out[decode_tok.to(lay.device)] = hot[hot_index[decode_tok].to(lay.device)]
        if any_direct:
            pool_rows = lay.pool_rows(blocks, req[direct], pos[direct])
            out[direct.to(lay.device)] = pool[pool_rows].to(lay.device)
        out.masked_fill_(~valid.unsqueeze(-1).to(lay.device), 0)
        return SelectedRows(rows=out, valid=valid.to(lay.device))
