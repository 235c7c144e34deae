"""Where a sparse MLA layer's main-KV rows live and how the selected ones are fetched: the seam
between kvo's resident and offload modes.

kvo's sparse MLA attention (:mod:`kvo_vllm.dsa.backend`) runs in three steps per layer and step:

1. ``write``: the new tokens' main-KV rows (latent ``kv_lora_rank`` values, then the rope
   part: ``D = kv_lora_rank + qk_rope_head_dim`` per row) go wherever this strategy keeps them,
   at the slots vLLM's ``slot_mapping`` names;
2. ``gather``: for each query token the rows of its top-k selection (request-local positions
   from the indexer, -1 padded), as ``[T, K, D]`` in top-k order or as a cache the attention
   reads by slot (:class:`SelectedRows`), plus the ``[T, K]`` validity mask (False where the
   selection is padding; such rows may hold anything);
3. attention over those rows with kvo-kernels' reference ``sparse_mla_attention`` (the backend
   does this, not the strategy), so the arithmetic is identical whichever strategy produced
   the rows: resident and offload must give identical tokens and logprobs.

A strategy implements :class:`MainKVAccess`. :class:`PagedMainKV` (``mode="resident"``) keeps
rows in vLLM's own paged cache of the layer, addressed through vLLM's block table.
``mode="offload"`` is ``kvo_vllm.dsa.offload_main_kv.OffloadMainKV`` (main KV in a kvo host
pool, device hot buffers, miss-only copies), built by :func:`make_main_kv_access` with the
same arguments. One strategy object serves one attention layer.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from kvo_core.config import SparseDecodeOffloadConfig
from kvo_core.errors import ConfigError
from kvo_kernels.reference.primitives import (
    sparse_mla_attention,
    sparse_mla_attention_over_keys,
)

OFFLOAD_MODULE = "kvo_vllm.dsa.offload_main_kv"
OFFLOAD_CLASS = "OffloadMainKV"


@attrs.frozen(eq=False)
class RowOverlay:
    """Tokens of a :class:`SelectedRows` whose rows come from a second cache: token
    ``tokens[i]``'s k-th row is ``rows[slots[i, k]]`` (the offload path's hot buffer, for
    the decode tokens of a step that also prefills from the host pool)."""

    tokens: torch.Tensor   # [Td] int64, ascending token indices
    rows: torch.Tensor     # [M, D] cache
    slots: torch.Tensor    # [Td, K] int64 rows of ``rows``; where the selection's ``valid``
    #                        is False any row of ``rows`` (or -1): never attended


@attrs.frozen(eq=False)
class SelectedRows:
    """The rows each query token attends to. Either ``rows`` [T, K, D] in top-k order (with
    ``slots`` None), or, with ``slots`` [T, K] given, ``rows`` is a cache [N, D] and token t's
    k-th row is ``rows[slots[t, k]]`` (-1: none): the offload path's hot buffer or host pool,
    read by the attention directly instead of being gathered into a copy first. With
    ``overlay``, the tokens it lists read their rows from its cache instead (their ``slots``
    entries are not read)."""

    rows: torch.Tensor
    valid: torch.Tensor  # [T, K] bool
    slots: torch.Tensor | None = None
    overlay: RowOverlay | None = None

    def materialized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [T, K, D] in top-k order, valid [T, K]); rows where ``valid`` is False may
        hold anything."""
        if self.slots is None:
            return self.rows, self.valid
        rows = self.rows[self.slots.clamp(min=0)]
        if self.overlay is not None:
            rows[self.overlay.tokens] = self.overlay.rows[self.overlay.slots.clamp(min=0)]
        return rows, self.valid


@attrs.frozen
class LayerInfo:
    """What a strategy may need to know about its layer (fixed at start-up)."""

    layer_name: str
    kv_lora_rank: int
    rope_dim: int
    config: SparseDecodeOffloadConfig
    vllm_config: Any = attrs.field(default=None, repr=False)

    @property
    def row_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim


class MainKVAccess(Protocol):
    def write(self, kv_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor,
              metadata: Any) -> None:
        """Store ``rows`` [N, D] (latent then rope) at vLLM slots ``slot_mapping`` [N] (-1 skip).

        ``kv_cache`` is the tensor vLLM bound to the layer; ``metadata`` the step's
        :class:`~kvo_vllm.dsa.backend.KvoSparseMLAMetadata` (None in a profiling run).
        """
        ...

    def gather(self, kv_cache: torch.Tensor, topk: torch.Tensor, metadata: Any) -> SelectedRows:
        """The rows of each query token's selection ``topk`` [T, K] (request-local, -1 pad)."""
        ...


@runtime_checkable
class FusedMainKVAccess(MainKVAccess, Protocol):
    """A strategy that also runs whole decode rows through kvo-kernels' fused ops
    (``kernel_backend="fused"``: ``kvo_vllm.dsa.offload_main_kv.OffloadMainKV``)."""

    def attend(self, kv_cache: torch.Tensor, query: torch.Tensor, query_rope: torch.Tensor,
               topk: torch.Tensor, metadata: Any, indexer: Any, scale: float) -> torch.Tensor:
        """Attention output ``[T, N, latent]``; ``indexer``: the layer's ``IndexerInputs``."""
        ...


def attend_rows(query: torch.Tensor, query_rope: torch.Tensor, rows: torch.Tensor,
                valid: torch.Tensor, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Sparse MLA attention of query token t over its own rows ``rows[t]`` [K, D].

    The rows become kvo-kernels' ``sparse_mla_attention`` cache (``T x K`` rows) and each
    token's slots are its own K rows in top-k order (-1 where ``valid`` is False), so the
    arithmetic is exactly the reference's. Returns [T, N, kv_lora_rank].
    """
    tokens, top_k, width = rows.shape
    flat = rows.reshape(tokens * top_k, width)
    slots = torch.arange(tokens * top_k, dtype=torch.int64).view(tokens, top_k)
    slots = torch.where(valid, slots, torch.full_like(slots, -1))
    return sparse_mla_attention(query, query_rope, flat[:, :kv_lora_rank],
                                flat[:, kv_lora_rank:], slots, scale)


def attend_selected(query: torch.Tensor, query_rope: torch.Tensor, selected: SelectedRows,
                    kv_lora_rank: int, scale: float) -> torch.Tensor:
    """:func:`attend_rows` over either form of :class:`SelectedRows`: the attention reads the
    same rows in the same order, so the output is the same bits."""
    if selected.slots is None:
        return attend_rows(query, query_rope, selected.rows, selected.valid, kv_lora_rank,
                           scale)
    if selected.overlay is not None:
        return _attend_two_caches(query, query_rope, selected, kv_lora_rank, scale)
    cache = selected.rows
    return sparse_mla_attention(query, query_rope, cache[:, :kv_lora_rank],
                                cache[:, kv_lora_rank:], selected.slots, scale)


def _attend_two_caches(query: torch.Tensor, query_rope: torch.Tensor, selected: SelectedRows,
                       kv_lora_rank: int, scale: float) -> torch.Tensor:
    """:func:`attend_selected` of rows in two caches: each token's keys gathered once from
    its cache (the overlay's tokens from the overlay), then the attention's own arithmetic
    over them (kvo-kernels' ``sparse_mla_attention_over_keys``: the same bits as over one
    cache holding those rows). A gathered ``[T, K, D]`` copy attended by
    :func:`attend_rows` is read twice; a mixed step's prefill chunk made that copy the
    offload path's largest cost (docs/benchmarks.md, sparse_budget)."""
    assert selected.slots is not None and selected.overlay is not None
    overlay = selected.overlay
    cache, slots = selected.rows, selected.slots.clamp(min=0)
    tokens, top_k = slots.shape
    rope = cache.shape[1] - kv_lora_rank
    keys = []
    for part, width in ((slice(None, kv_lora_rank), kv_lora_rank), (slice(kv_lora_rank, None),
                                                                     rope)):
        gathered = cache[:, part].index_select(0, slots.reshape(-1)).view(tokens, top_k, width)
        gathered[overlay.tokens] = overlay.rows[:, part].index_select(
            0, overlay.slots.clamp(min=0).reshape(-1)).view(overlay.slots.shape[0], top_k,
                                                            width)
        keys.append(gathered)
    return sparse_mla_attention_over_keys(query, query_rope, keys[0], keys[1], selected.valid,
                                          scale)


def cache_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's MLA cache of a layer as ``[num_blocks, block_size, D]`` (a view, never a copy)."""
    if kv_cache.dim() == 3:
        return kv_cache
    if kv_cache.dim() == 4 and kv_cache.shape[1] == 1:
        return kv_cache.squeeze(1)
    raise ValueError(f"unexpected MLA cache shape {tuple(kv_cache.shape)}; expected "
                     f"[num_blocks, block_size, D]")


class PagedMainKV:
    """Resident mode: rows in vLLM's paged cache of the layer, addressed by its block table."""

    def __init__(self, layer: LayerInfo) -> None:
        self.layer = layer

    def write(self, kv_cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor,
              metadata: Any) -> None:
        cache = cache_rows(kv_cache)
        block_size = cache.shape[1]
        slots = slot_mapping[: rows.shape[0]].to(torch.int64)
        keep = slots >= 0
        if not bool(keep.all()):
            slots, rows = slots[keep], rows[keep]
        cache[slots // block_size, slots % block_size] = rows.to(cache.dtype)

    def gather(self, kv_cache: torch.Tensor, topk: torch.Tensor, metadata: Any) -> SelectedRows:
        cache = cache_rows(kv_cache)
        block_size = cache.shape[1]
        valid = topk >= 0
        positions = topk.clamp(min=0).to(torch.int64)
        tables = metadata.block_table.to(torch.int64)[metadata.token_request]   # [T, blocks]
        blocks = torch.gather(tables, 1, positions // block_size)
        flat = flat_rows(cache)
        if flat is None:  # rows not evenly spaced in memory: gather a copy
            return SelectedRows(rows=cache[blocks, positions % block_size], valid=valid)
        # The attention reads the selected rows straight from vLLM's cache: one pass over
        # them instead of a gathered copy read again (the same rows in the same order).
        slots = blocks * block_size + positions % block_size
        return SelectedRows(rows=flat, valid=valid,
                            slots=torch.where(valid, slots, torch.full_like(slots, -1)))


def flat_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """``cache`` [num_blocks, block_size, D] as a ``[num_blocks * block_size, D]`` view whose
    row ``block * block_size + offset`` is ``cache[block, offset]``, or None where no such view
    exists (a layer's rows interleaved with another's in one allocation). A view, never a
    copy: ``reshape`` would copy a whole strided cache."""
    num_blocks, block_size, width = cache.shape
    if cache.stride(2) != 1 or (num_blocks > 1
                                and cache.stride(0) != block_size * cache.stride(1)):
        return None
    return cache.as_strided((num_blocks * block_size, width), (cache.stride(1), 1))


def make_main_kv_access(layer: LayerInfo) -> MainKVAccess:
    """The strategy ``layer.config.mode`` names."""
    mode = layer.config.mode
    if mode == "resident":
        return PagedMainKV(layer)
    if mode == "offload":
        try:
            module = importlib.import_module(OFFLOAD_MODULE)
        except ModuleNotFoundError as error:
            if error.name != OFFLOAD_MODULE:
                raise
            raise ConfigError("mode 'offload' is not available in this kvo-vllm build; "
                              "available: resident") from None
        strategy: MainKVAccess = getattr(module, OFFLOAD_CLASS)(layer)
        return strategy
    raise ConfigError(f"mode must be one of resident, offload; got {mode!r}")
