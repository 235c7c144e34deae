"""kvo's lightning indexer for vLLM on CPU (replaces vLLM's ``SparseAttnIndexer`` op).

Per step and layer: write the new tokens' keys into the indexer cache (layout in
:mod:`kvo_vllm.dsa.indexer_cache`), score every query token against its request's keys with
the lightning-indexer formula ``sum_h w[t, h] * relu(q[t, h] . k[s])`` (kvo-kernels'
``indexer_scores``), take the causal top-k with kvo-kernels' ``topk_indices`` (best first, ties
to the lower position, -1 padding) and write it into vLLM's shared top-k buffer as
request-local positions, which the sparse MLA backend reads.

The whole batch is scored at once: keys are gathered per request and padded to the batch's
longest sequence, query tokens are grouped per request and padded to the longest query; the
causal limit of each token masks the padding (``valid_lengths`` of ``topk_indices``). No Python
loop runs over requests. ``scores_for_tokens`` is tested against ``indexer_scores`` request by
request.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

from kvo_kernels.reference.primitives import topk_indices
from kvo_vllm.dsa.indexer_cache import (
    IndexerKeyLayout,
    KvoIndexerMetadata,
    fused_indexer_inputs,
    write_rows,
)
from kvo_vllm.dsa.main_kv import flat_rows
from kvo_vllm.dsa.offload_fused import IndexerInputs
from kvo_vllm.dsa.stats import COUNTERS

MAX_SCORE_ELEMENTS = 1 << 24
"""Bound on one scoring chunk's [R, Q, H, S] intermediate (floats): long prefills go in chunks."""


def gather_request_keys(cache: torch.Tensor, layout: IndexerKeyLayout,
                        block_table: torch.Tensor, num_reqs: int, max_seq_len: int
                        ) -> torch.Tensor:
    """Every request's first ``max_seq_len`` keys, [R, S, head_dim] float32 (padding: junk)."""
    block_size = cache.shape[1]
    positions = torch.arange(max_seq_len)
    blocks = block_table[:num_reqs, positions // block_size].to(torch.int64)
    flat = flat_rows(cache)
    if flat is None:
        rows = cache[blocks, (positions % block_size)[None, :].expand(num_reqs, -1)]
        return layout.decode(rows)
    # One index_select over a flat view of the cache: the same bytes as the two-index
    # gather, several times faster (docs/benchmarks.md).
    slots = (blocks * block_size + positions % block_size).view(-1)
    rows = flat.index_select(0, slots).view(num_reqs, max_seq_len, flat.shape[1])
    return layout.decode(rows)


def scores_for_tokens(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                      metadata: KvoIndexerMetadata) -> torch.Tensor:
    """Indexer scores of each query token against its own request's keys: [T, S] float32.

    query [T, H, D] and weights [T, H] (float32), keys [R, S, D] from ``gather_request_keys``.
    """
    _, heads, dim = query.shape
    requests, local = metadata.token_request, metadata.token_local_index
    num_reqs, max_seq_len = keys.shape[0], keys.shape[1]
    max_query = int(metadata.max_query_len)
    padded_query = query.new_zeros(num_reqs, max_query, heads, dim)
    padded_query[requests, local] = query
    padded_weights = weights.new_zeros(num_reqs, max_query, heads)
    padded_weights[requests, local] = weights
    chunk = max(1, MAX_SCORE_ELEMENTS // max(1, num_reqs * heads * max_seq_len))
    pieces = []
    for start in range(0, max_query, chunk):
        part = slice(start, start + chunk)
        dots = torch.einsum("rqhd,rsd->rqhs", padded_query[:, part], keys)
        pieces.append(torch.einsum("rqh,rqhs->rqs", padded_weights[:, part], torch.relu(dots)))
    padded_scores = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
    return padded_scores[requests, local]


def select_topk(query: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                layout: IndexerKeyLayout, metadata: KvoIndexerMetadata, top_k: int
                ) -> torch.Tensor:
    """Causal top-k request-local positions per query token, [T, top_k] int64 (-1 padded).

    Requests are scored in the groups the metadata names (a mixed step's prefill apart from
    its decodes); a token's selection depends only on its own row of scores, so the groups
    change the work, not the answer's meaning."""
    query, weights = layout.encode_query(query), weights.float()
    if metadata.groups is None:
        return _select_group(query, weights, cache, layout, metadata, top_k)
    out = torch.empty(query.shape[0], top_k, dtype=torch.int64)
    for group, part in metadata.groups:
        out[group.tokens] = _select_group(query[group.tokens], weights[group.tokens], cache,
                                          layout, part, top_k)
    return out


def _select_group(query: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                  layout: IndexerKeyLayout, metadata: KvoIndexerMetadata, top_k: int
                  ) -> torch.Tensor:
    """``select_topk`` of one group (query already encoded, weights float32)."""
    keys = gather_request_keys(cache, layout, metadata.block_table, metadata.num_reqs,
                               metadata.max_seq_len)
    scores = scores_for_tokens(query, weights, keys, metadata)
    return topk_indices(scores, top_k, metadata.token_position + 1)


class KvoSparseAttnIndexer(SparseAttnIndexer):
    """vLLM's indexer op with kvo's CPU implementation (registered with ``register_oot``).

    Expects the query unquantised (kvo's model class, :mod:`kvo_vllm.dsa.model`, skips vLLM's
    fp8 query quantisation, a Triton kernel on CPU) and ``weights`` already scaled.

    With ``kernel_backend="fused"`` (``fused_decode_rows`` > 0, set by kvo's model class) the
    decode rows' selection belongs to the fused manage op, run by the attention impl: the op
    then leaves its operands in ``fused_inputs`` for the impl and, when every request of the
    batch is a decode (at most ``fused_decode_rows`` query rows), selects nothing itself.
    """

    fused_decode_rows: int = 0
    fused_inputs: IndexerInputs | None = None

    def forward_native(self, hidden_states: torch.Tensor, q_quant: Any, k: torch.Tensor | None,
                       weights: torch.Tensor) -> torch.Tensor:
        return self._select(q_quant, k, weights)

    def forward_cpu(self, hidden_states: torch.Tensor, q_quant: Any, k: torch.Tensor | None,
                    weights: torch.Tensor) -> torch.Tensor:
        return self._select(q_quant, k, weights)

    def _select(self, query: Any, k: torch.Tensor | None, weights: torch.Tensor
                ) -> torch.Tensor:
        buffer = self.topk_indices_buffer
        all_metadata = get_forward_context().attn_metadata
        if not isinstance(all_metadata, dict):
            return buffer  # profiling / dummy run: nothing to index
        metadata = all_metadata[self.k_cache.prefix]
        if not isinstance(metadata, KvoIndexerMetadata):
            raise TypeError(f"kvo's indexer needs kvo's indexer metadata for "
                            f"{self.k_cache.prefix}, got {type(metadata).__name__}")
        if isinstance(query, tuple):
            raise TypeError("kvo's indexer takes an unquantised query tensor, got a tuple "
                            "(an fp4 query): serve the model through kvo's model class")
        layout: IndexerKeyLayout = self.k_cache.layout
        cache = self.k_cache.kv_cache
        tokens = metadata.num_actual_tokens
        if k is not None:
            write_rows(cache, metadata.slot_mapping, layout.encode(k[:tokens]))
        if self.fused_decode_rows:
            self.fused_inputs = fused_indexer_inputs(layout, cache, query[:tokens],
                                                     weights[:tokens])
            if metadata.max_query_len <= self.fused_decode_rows:
                COUNTERS.indexer_calls += 1
                COUNTERS.indexer_rows += tokens
                return buffer
        topk = select_topk(query[:tokens], weights[:tokens], cache, layout, metadata,
                           self.topk_tokens)
        buffer[:tokens, : self.topk_tokens] = topk.to(buffer.dtype)
        COUNTERS.indexer_calls += 1
        COUNTERS.indexer_rows += tokens
        return buffer
