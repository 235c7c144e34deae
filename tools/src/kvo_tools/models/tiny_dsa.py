"""A tiny DeepSeek-V3.2-style decoder: MLA latent KV, lightning indexer, top-k sparse attention.

It gives the residency_capacity benchmark a top-k trace that a model produced: random
weights from a fixed seed, a few layers, small widths, a small top-k, so that on a CPU the top-k
changes from step to step over prompts of a few hundred tokens. The model only computes; where a
layer's KV lives and how the selected rows reach attention is the job of a ``SparseKVBackend``
(the fully resident oracle in this file), which calls kvo-kernels' reference primitives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import attrs
import torch

from kvo_kernels.reference.primitives import indexer_scores, sparse_mla_attention, topk_indices


@attrs.frozen
class TinyDSAConfig:
    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 3
    num_heads: int = 4
    latent_dim: int = 64      # production 512
    rope_dim: int = 16        # production 64
    index_heads: int = 2      # production 64
    index_dim: int = 16       # production 128
    ffn: int = 128
    top_k: int = 64
    seed: int = 0
    init_gain: float = 2.0

    @property
    def kv_row_dim(self) -> int:
        """One token's main-KV row: latent then rope."""
        return self.latent_dim + self.rope_dim

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.kv_row_dim)


@attrs.frozen
class LayerRows:
    """What one layer stores per token: the main-KV row (latent + rope) and the indexer key."""

    kv: torch.Tensor         # [T, Dl]
    k_rope: torch.Tensor     # [T, Dr]
    index_key: torch.Tensor  # [T, Di]


@attrs.frozen
class LayerQueries:
    """What one layer asks with per token: MLA query parts and the indexer query/weights."""

    query: torch.Tensor          # [T, N, Dl]
    query_rope: torch.Tensor     # [T, N, Dr]
    index_query: torch.Tensor    # [T, Hi, Di]
    index_weights: torch.Tensor  # [T, Hi]


class SparseKVBackend(Protocol):
    """Where KV lives during decode. ``decode_layer`` stores the new rows, selects, attends."""

    def admit(self, request_id: int, history: Sequence[LayerRows]) -> None: ...

    def decode_layer(self, layer: int, request_ids: Sequence[int], rows: LayerRows,
                     queries: LayerQueries) -> torch.Tensor: ...

    def finish(self, request_id: int) -> None: ...


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the last dim of ``x`` ([T, ..., D], D even) at ``positions`` [T]."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]           # [T, half]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = angles.cos().reshape(shape), angles.sin().reshape(shape)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class TinyDSA:
    """Weights and per-layer maths of the tiny model; stateless between calls."""

    def __init__(self, config: TinyDSAConfig | None = None) -> None:
        self.config = cfg = config or TinyDSAConfig()
        gen = torch.Generator().manual_seed(cfg.seed)

        def weight(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * (cfg.init_gain / math.sqrt(shape[0]))

        self.embedding = torch.randn(cfg.vocab_size, cfg.hidden, generator=gen)
        self.layers = [
            {
                "w_q": weight(cfg.hidden, cfg.num_heads * cfg.latent_dim),
                "w_q_rope": weight(cfg.hidden, cfg.num_heads * cfg.rope_dim),
                "w_kv": weight(cfg.hidden, cfg.latent_dim),
                "w_k_rope": weight(cfg.hidden, cfg.rope_dim),
                "w_index_q": weight(cfg.hidden, cfg.index_heads * cfg.index_dim),
                "w_index_w": weight(cfg.hidden, cfg.index_heads),
                "w_index_k": weight(cfg.hidden, cfg.index_dim),
                "w_o": weight(cfg.num_heads * cfg.latent_dim, cfg.hidden) * 0.5,
                "w_up": weight(cfg.hidden, cfg.ffn),
                "w_down": weight(cfg.ffn, cfg.hidden) * 0.5,
            }
            for _ in range(cfg.num_layers)
        ]
        self.unembedding = weight(cfg.hidden, cfg.vocab_size)

    def project(self, layer: int, hidden: torch.Tensor,
                positions: torch.Tensor) -> tuple[LayerRows, LayerQueries]:
        """The rows a layer stores and the queries it asks with, for tokens at ``positions``."""
        cfg, w = self.config, self.layers[layer]
        x = _rms_norm(hidden)
        tokens = x.shape[0]
        rows = LayerRows(
            kv=x @ w["w_kv"],
            k_rope=_rotate(x @ w["w_k_rope"], positions),
            index_key=x @ w["w_index_k"],
        )
        queries = LayerQueries(
            query=(x @ w["w_q"]).reshape(tokens, cfg.num_heads, cfg.latent_dim),
            query_rope=_rotate((x @ w["w_q_rope"]).reshape(tokens, cfg.num_heads, cfg.rope_dim),
                               positions),
            index_query=(x @ w["w_index_q"]).reshape(tokens, cfg.index_heads, cfg.index_dim),
            index_weights=torch.softmax(x @ w["w_index_w"], dim=-1),
        )
        return rows, queries

    def finish_layer(self, layer: int, hidden: torch.Tensor,
                     attention: torch.Tensor) -> torch.Tensor:
        """Residual attention output and MLP: the next layer's input."""
        w = self.layers[layer]
        hidden = hidden + attention.reshape(hidden.shape[0], -1) @ w["w_o"]
        return hidden + torch.relu(_rms_norm(hidden) @ w["w_up"]) @ w["w_down"]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _rms_norm(hidden) @ self.unembedding

    def prefill(self, prompt: Sequence[int]) -> tuple[list[LayerRows], int]:
        """Causal sparse prefill of one prompt: every layer's rows and the first generated token.

        Each position selects its top-k among positions ``0..t`` with the indexer, as in decode.
        """
        cfg = self.config
        positions = torch.arange(len(prompt))
        hidden = self.embedding[torch.tensor(list(prompt), dtype=torch.int64)]
        history: list[LayerRows] = []
        for layer in range(cfg.num_layers):
            rows, queries = self.project(layer, hidden, positions)
            scores = indexer_scores(queries.index_query, queries.index_weights, rows.index_key)
            selected = topk_indices(scores, cfg.top_k, positions + 1)
            attention = sparse_mla_attention(queries.query, queries.query_rope, rows.kv,
                                             rows.k_rope, selected, cfg.softmax_scale)
            hidden = self.finish_layer(layer, hidden, attention)
            history.append(rows)
        return history, int(self.logits(hidden[-1:]).argmax(-1).item())

    def decode_step(self, backend: SparseKVBackend, request_ids: Sequence[int],
                    tokens: Sequence[int], positions: Sequence[int]) -> list[int]:
        """One greedy decode step for a batch: one new token per request, KV kept by ``backend``."""
        position_tensor = torch.tensor(list(positions), dtype=torch.int64)
        hidden = self.embedding[torch.tensor(list(tokens), dtype=torch.int64)]
        for layer in range(self.config.num_layers):
            rows, queries = self.project(layer, hidden, position_tensor)
            attention = backend.decode_layer(layer, request_ids, rows, queries)
            hidden = self.finish_layer(layer, hidden, attention)
        return [int(t) for t in self.logits(hidden).argmax(-1).tolist()]


class ResidentBackend:
    """The oracle: every request's full KV history stays on the "device"; nothing is offloaded.

    Selection and attention use exactly the primitives the offload path uses, over the full
    history instead of a hot buffer.
    """

    def __init__(self, config: TinyDSAConfig, max_tokens: int) -> None:
        self.config = config
        self.max_tokens = max_tokens
        self._kv: dict[int, list[torch.Tensor]] = {}
        self._index_keys: dict[int, list[torch.Tensor]] = {}
        self._lengths: dict[int, int] = {}
        self.selected: dict[tuple[int, int], torch.Tensor] = {}  # (request, layer) -> last top-k

    def admit(self, request_id: int, history: Sequence[LayerRows]) -> None:
        cfg, length = self.config, history[0].kv.shape[0]
        if length >= self.max_tokens:
            raise ValueError(f"request {request_id}: {length} tokens do not fit {self.max_tokens}")
        self._kv[request_id] = []
        self._index_keys[request_id] = []
        for rows in history:
            kv = torch.zeros(self.max_tokens, cfg.kv_row_dim)
            kv[:length] = torch.cat([rows.kv, rows.k_rope], dim=-1)
            keys = torch.zeros(self.max_tokens, cfg.index_dim)
            keys[:length] = rows.index_key
            self._kv[request_id].append(kv)
            self._index_keys[request_id].append(keys)
        self._lengths[request_id] = length

    def decode_layer(self, layer: int, request_ids: Sequence[int], rows: LayerRows,
                     queries: LayerQueries) -> torch.Tensor:
        cfg = self.config
        outputs = []
        for i, request in enumerate(request_ids):
            position = self._lengths[request]
            kv, keys = self._kv[request][layer], self._index_keys[request][layer]
            kv[position] = torch.cat([rows.kv[i], rows.k_rope[i]])
            keys[position] = rows.index_key[i]
            valid = torch.tensor([position + 1])
            scores = indexer_scores(queries.index_query[i:i + 1], queries.index_weights[i:i + 1],
                                    keys[:position + 1])
            selected = topk_indices(scores, cfg.top_k, valid)
            self.selected[(request, layer)] = selected[0]
            outputs.append(sparse_mla_attention(
                queries.query[i:i + 1], queries.query_rope[i:i + 1], kv[:, :cfg.latent_dim],
                kv[:, cfg.latent_dim:], selected, cfg.softmax_scale))
            if layer == cfg.num_layers - 1:
                self._lengths[request] = position + 1
        return torch.cat(outputs, dim=0)

    def finish(self, request_id: int) -> None:
        for table in (self._kv, self._index_keys, self._lengths):
            table.pop(request_id, None)
