"""The indexer's key cache on CPU: its byte layout, its vLLM cache spec and its metadata builder.

vLLM allocates the indexer cache as ``[num_blocks, block_size, row_bytes]`` uint8 (one row of
bytes per token, ``DeepseekV32IndexerCache``). kvo stores in those bytes, per token:

- ``indexer_kv_dtype="bfloat16"``: the key as ``head_dim`` bf16 values (``2 x head_dim``
  bytes, 256 for DeepSeek's 128); the spec's row is widened to that (stock: 132 bytes, fp8);
- ``indexer_kv_dtype="int8"`` (C8): the key rotated by the normalised Hadamard matrix and
  quantised to int8 (``head_dim`` bytes), then its fp16 dequantisation scale (2 bytes), then 2
  bytes of padding: 132 bytes, the stock row size. ``kvo_kernels``' ``hadamard_quant_int8``
  makes both; scores are taken on dequantised rotated keys and queries (the rotation is
  orthogonal, so the dot products are the unrotated ones up to quantisation error).

Rows are addressed as ``(block, offset)`` pairs, never through a flattening ``reshape``: a
layer's cache may be a strided view into a shared allocation, where a reshape would copy and
a write into the copy would be lost.

vLLM's own indexer metadata builder launches Triton GPU kernels; the builder here only derives,
with tensor ops, what the CPU indexer needs: each query token's request and absolute position.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

from kvo_kernels.reference.primitives import hadamard_quant_int8
from kvo_vllm.dsa.indexer_groups import IndexerGroup, build_groups
from kvo_vllm.dsa.offload_fused import IndexerInputs

INT8_SCALE_BYTES = 2
INT8_PAD_BYTES = 2


@attrs.frozen
class IndexerKeyLayout:
    """How one token's indexer key is stored in its row of bytes."""

    head_dim: int
    dtype: str  # "bfloat16" | "int8"

    @property
    def row_bytes(self) -> int:
        if self.dtype == "bfloat16":
            return 2 * self.head_dim
        return self.head_dim + INT8_SCALE_BYTES + INT8_PAD_BYTES

    @property
    def quantised(self) -> bool:
        return self.dtype == "int8"

    def encode(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys [N, head_dim] (any float dtype) -> rows [N, row_bytes] uint8."""
        if not self.quantised:
            return keys.to(torch.bfloat16).contiguous().view(torch.uint8)
        values, scales = hadamard_quant_int8(keys)
        rows = torch.zeros(keys.shape[0], self.row_bytes, dtype=torch.uint8, device=keys.device)
        rows[:, : self.head_dim] = values.view(torch.uint8)
        rows[:, self.head_dim: self.head_dim + INT8_SCALE_BYTES] = \
            scales.contiguous().view(torch.uint8)
        return rows

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [..., row_bytes] uint8 -> keys [..., head_dim] fp32 (C8: rotated, dequantised)."""
        if not self.quantised:
            return rows.contiguous().view(torch.bfloat16).float()
        values = rows[..., : self.head_dim].contiguous().view(torch.int8).float()
        scales = rows[..., self.head_dim: self.head_dim + INT8_SCALE_BYTES].contiguous()
        return values * scales.view(torch.float16).float()

    def encode_query(self, query: torch.Tensor) -> torch.Tensor:
        """The query in the keys' space, fp32: bf16 rounds it to bf16 like the keys (the
        fused BF16 op takes query and keys in one dtype, so both paths score the same
        operands); C8 rotates and int8-quantises it as well (per head)."""
        if not self.quantised:
            return query.to(torch.bfloat16).float()
        values, scales = hadamard_quant_int8(query)
        return values.float() * scales.float()


def fused_indexer_inputs(layout: IndexerKeyLayout, cache: torch.Tensor, query: torch.Tensor,
                         weights: torch.Tensor) -> IndexerInputs:
    """The manage op's indexer operands: views of the cache ``[blocks, block, row_bytes]``
    (no copy) and the query in the op's form (bf16; C8: int8 with fp16 scales)."""
    blocks, block = cache.shape[0], cache.shape[1]
    if not layout.quantised:
        keys = cache.view(torch.bfloat16).unsqueeze(2)
        ones = torch.ones(1, 1, 1, device=cache.device).expand(blocks, block, 1)
        return IndexerInputs(query=query.to(torch.bfloat16),
                             query_scale=ones[0, 0].expand(*query.shape[:2]),
                             weights=weights.float(), key_cache=keys, key_scale=ones,
                             quantised=False)
    dim = layout.head_dim
    keys = cache[..., :dim].view(torch.int8).unsqueeze(2)
    key_scale = cache[..., dim: dim + INT8_SCALE_BYTES].view(torch.float16)
    values, scales = hadamard_quant_int8(query)
    return IndexerInputs(query=values, query_scale=scales[..., 0], weights=weights.float(),
                         key_cache=keys, key_scale=key_scale, quantised=True)


def describe_indexer_block(block_bytes: int, block_size: int, head_dim: int) -> str:
    """Which indexer key layout a block of ``block_bytes`` implies, for error messages."""
    row, rest = divmod(block_bytes, block_size)
    for dtype, name in (("bfloat16", "bfloat16 keys"),
                        ("int8", "C8: int8 keys with their fp16 scale")):
        if not rest and row == IndexerKeyLayout(head_dim, dtype).row_bytes:
            return f"{name}, indexer_kv_dtype={dtype!r}, {row} bytes per token"
    return f"an unknown indexer layout of {block_bytes} bytes per {block_size}-token block"


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[slot // block, slot % block] = row`` for every slot >= 0 (cache [B, bs, W])."""
    block_size = cache.shape[1]
    slots = slots.to(torch.int64)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, rows = slots[keep], rows[keep]
    cache[slots // block_size, slots % block_size] = rows


@attrs.frozen(eq=False)
class KvoIndexerMetadata(AttentionMetadata):
    """One step's view of a kv-cache group, as kvo's indexer needs it."""

    num_actual_tokens: int
    num_reqs: int
    max_seq_len: int
    max_query_len: int
    slot_mapping: torch.Tensor     # [T] int64, -1 = not written
    block_table: torch.Tensor      # [R, max_blocks]
    seq_lens: torch.Tensor         # [R] int64
    token_request: torch.Tensor    # [T] int64: the request (batch row) of each query token
    token_position: torch.Tensor   # [T] int64: its absolute position in the request
    token_local_index: torch.Tensor  # [T] int64: its index among the request's query tokens
    groups: tuple[tuple[IndexerGroup, KvoIndexerMetadata], ...] | None = None
    """Requests scored apart (:mod:`kvo_vllm.dsa.indexer_groups`), each with its own view of
    the step (built once per step by :func:`with_groups`); None: all together."""


def token_layout(common: CommonAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
    """(request, absolute position, index within the request's query) of every query token."""
    starts = common.query_start_loc_cpu.to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    requests = torch.repeat_interleave(torch.arange(common.num_reqs), query_lens)
    local = torch.arange(requests.shape[0]) - starts[:-1][requests]
    seq_lens = common.seq_lens.to(torch.int64).cpu()
    positions = seq_lens[requests] - query_lens[requests] + local
    return requests, positions, local


def build_indexer_metadata(common: CommonAttentionMetadata) -> KvoIndexerMetadata:
    tokens = common.num_actual_tokens
    requests, positions, local = token_layout(common)
    starts = common.query_start_loc_cpu.to(torch.int64).numpy()
    seq_lens = common.seq_lens.to(torch.int64)
    groups = build_groups(requests[:tokens], starts[1:] - starts[:-1], seq_lens.cpu().numpy())
    metadata = KvoIndexerMetadata(
        num_actual_tokens=tokens, num_reqs=common.num_reqs, max_seq_len=common.max_seq_len,
        max_query_len=common.max_query_len,
        slot_mapping=common.slot_mapping[:tokens].to(torch.int64),
        block_table=common.block_table_tensor, seq_lens=seq_lens,
        token_request=requests[:tokens], token_position=positions[:tokens],
        token_local_index=local[:tokens])
    return metadata if groups is None else with_groups(metadata, groups)


def with_groups(metadata: KvoIndexerMetadata, groups: tuple[IndexerGroup, ...]
                ) -> KvoIndexerMetadata:
    """``metadata`` scored in ``groups``, each group's own view sliced here once per step (the
    indexer of every layer reuses them)."""
    parts = tuple((group, attrs.evolve(
        metadata, num_actual_tokens=int(group.tokens.shape[0]),
        num_reqs=int(group.rows.shape[0]), max_seq_len=group.max_seq_len,
        max_query_len=group.max_query_len, slot_mapping=metadata.slot_mapping[group.tokens],
        block_table=metadata.block_table[group.rows], seq_lens=metadata.seq_lens[group.rows],
        token_request=group.token_request, token_position=metadata.token_position[group.tokens],
        token_local_index=metadata.token_local_index[group.tokens], groups=None))
        for group in groups)
    return attrs.evolve(metadata, groups=parts)


class KvoIndexerMetadataBuilder(AttentionMetadataBuilder[KvoIndexerMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvoIndexerMetadata:
        return build_indexer_metadata(common_attn_metadata)


class KvoIndexerBackend(DeepseekV32IndexerBackend):
    @staticmethod
    def get_name() -> str:
        return "KVO_CPU_DSA_INDEXER"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []

    @staticmethod
    def get_builder_cls() -> type[KvoIndexerMetadataBuilder]:  # type: ignore[override]
        # vLLM types the stock indexer backend's builder narrowly; any builder is called alike.
        return KvoIndexerMetadataBuilder


class KvoIndexerCache(DeepseekV32IndexerCache):
    """vLLM's indexer cache layer with kvo's row layout and metadata builder.

    ``layout`` is set when the model swaps the class in (:mod:`kvo_vllm.dsa.model`).
    """

    layout: IndexerKeyLayout

    def get_kv_cache_spec(self, vllm_config: Any) -> MLAAttentionSpec:
        return MLAAttentionSpec(block_size=self.cache_config.block_size, num_kv_heads=1,
                                max_tp_shards=1, head_size=self.layout.row_bytes,
                                dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)

    def get_attn_backend(self) -> type[KvoIndexerBackend]:
        return KvoIndexerBackend
