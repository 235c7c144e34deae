"""kvo's sparse MLA attention backend for vLLM (DeepSeek-V3.2 architecture, CPU).

Every query token, of a decode or of a (possibly chunked) prefill, attends only to the rows of
its own top-k selection, which kvo's indexer wrote into vLLM's shared top-k buffer as
request-local positions (-1 padded). So the metadata reports every token as a "decode" (MQA)
token: vLLM's MLA layer then absorbs ``W_UK`` into the query and calls ``forward_mqa`` for the
whole batch, and no dense prefill path exists.

Per layer and step (the seam is documented in :mod:`kvo_vllm.dsa.main_kv`):
``do_kv_cache_update`` hands the new rows to the layer's :class:`MainKVAccess` strategy
(``mode`` of kvo's sparse config), ``forward_mqa`` asks it for the selected rows ``[T, K, D]``
and runs kvo-kernels' reference ``sparse_mla_attention`` over them (:func:`attend_selected`).
Deterministic: the same batch gives the same bits (plain torch ops on the CPU).
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch
from vllm.model_executor.layers.attention.sparse_mla_attention import SharedTopkIndicesBuffer
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttentionImpl,
    MultipleOf,
)

from kvo_core.errors import ConfigError
from kvo_vllm.dsa.config import uses_fused_ops
from kvo_vllm.dsa.indexer_cache import token_layout
from kvo_vllm.dsa.main_kv import (
    FusedMainKVAccess,
    LayerInfo,
    MainKVAccess,
    attend_selected,
    make_main_kv_access,
)
from kvo_vllm.dsa.stats import COUNTERS


@attrs.define(eq=False)
class KvoSparseMLAMetadata(AttentionMetadata):
    """One step of the main-KV cache group, for kvo's sparse MLA impl (and vLLM's MLA layer)."""

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    token_request: torch.Tensor   # [T] int64
    token_position: torch.Tensor  # [T] int64, absolute position of each query token
    block_size: int
    topk_tokens: int
    # vLLM's MLA layer routes the first num_decode_tokens tokens to forward_mqa: all of them.
    num_decodes: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    prefill: Any = None
    decode: Any = None


class KvoSparseMLAMetadataBuilder(AttentionMetadataBuilder[KvoSparseMLAMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any,
                 device: torch.device, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.topk_tokens = int(vllm_config.model_config.hf_text_config.index_topk)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvoSparseMLAMetadata:
        common = common_attn_metadata
        tokens = common.num_actual_tokens
        requests, positions, _ = token_layout(common)
        return KvoSparseMLAMetadata(
            num_reqs=common.num_reqs, num_actual_tokens=tokens,
            max_query_len=common.max_query_len, max_seq_len=common.max_seq_len,
            query_start_loc=common.query_start_loc, seq_lens=common.seq_lens,
            slot_mapping=common.slot_mapping[:tokens], block_table=common.block_table_tensor,
            token_request=requests[:tokens], token_position=positions[:tokens],
            block_size=self.kv_cache_spec.block_size, topk_tokens=self.topk_tokens,
            num_decodes=common.num_reqs, num_decode_tokens=tokens)


class KvoSparseMLAImpl(MLAAttentionImpl[KvoSparseMLAMetadata], SharedTopkIndicesBuffer):
    is_sparse = True
    supports_dense_mha_prefill = False
    can_return_lse_for_decode = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Any, sliding_window: Any, kv_cache_dtype: str,
                 logits_soft_cap: Any, attn_type: str, kv_sharing_target_layer_name: Any,
                 topk_indices_buffer: torch.Tensor | None = None, indexer: Any = None,
                 **mla_args: Any) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_lora_rank = int(mla_args["kv_lora_rank"])
        self.rope_dim = int(mla_args["qk_rope_head_dim"])
        self.dcp_world_size = 1
        self.cp_kv_cache_interleave_size = 1
        self.supports_quant_query_input = False
        self.main_kv: MainKVAccess | None = None
        self.layer_info: LayerInfo | None = None
        self.fused = False
        self.init_topk_indices_buffer(indexer, topk_indices_buffer)

    def bind_layer(self, layer: LayerInfo) -> None:
        """Called by kvo's model class once the layer's name is known."""
        if layer.row_dim != self.kv_lora_rank + self.rope_dim:
            raise ValueError(f"{layer.layer_name}: row width {layer.row_dim} differs from the "
                             f"impl's {self.kv_lora_rank} + {self.rope_dim}")
        self.layer_info = layer
        self.main_kv = make_main_kv_access(layer)
        self.fused = uses_fused_ops(layer.config)
        if self.fused and getattr(self._indexer, "indexer_op", None) is None:
            raise ConfigError(
                f"{layer.layer_name}: kernel_backend 'fused' needs the layer's own lightning "
                f"indexer (the fused op selects and attends in one call); this layer reuses "
                f"another layer's top-k. Available for this model: auto, reference")

    def _strategy(self) -> MainKVAccess:
        if self.main_kv is None:
            raise RuntimeError("kvo's sparse MLA backend runs only inside kvo's model class "
                               "(kvo_vllm.dsa.model.KvoDeepseekV32ForCausalLM), which binds "
                               "each layer to its main-KV strategy")
        return self.main_kv

    def record_logical_topk_ready(self) -> None:
        """vLLM's hook for asynchronous top-k producers; kvo's indexer is synchronous."""

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        if kv_cache.numel() == 0:
            return  # profiling run before the cache exists
        rows = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], dim=-1)
        self._strategy().write(kv_cache, rows, slot_mapping, None)
        COUNTERS.kv_rows_written += rows.shape[0]

    def forward_mqa(self, q: Any, kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: KvoSparseMLAMetadata, layer: Any
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query, query_rope = q if isinstance(q, tuple) else q.split(
            [self.kv_lora_rank, self.rope_dim], dim=-1)
        tokens = query.shape[0]
        buffer = self.topk_indices_buffer
        assert buffer is not None, "sparse MLA without a top-k buffer"
        topk = buffer[:tokens, : attn_metadata.topk_tokens]
        if self.fused:
            output = self._fused_forward(query, query_rope, kv_c_and_k_pe_cache, topk,
                                         attn_metadata)
        else:
            selected = self._strategy().gather(kv_c_and_k_pe_cache, topk, attn_metadata)
            output = attend_selected(query, query_rope, selected, self.kv_lora_rank,
                                     self.scale)
        COUNTERS.attention_calls += 1
        COUNTERS.attention_rows += tokens
        return output, None


    def _fused_forward(self, query: torch.Tensor, query_rope: torch.Tensor,
                       kv_cache: torch.Tensor, topk: torch.Tensor,
                       attn_metadata: KvoSparseMLAMetadata) -> torch.Tensor:
        """``kernel_backend="fused"``: the indexer op of this layer left its operands; the
        offload strategy runs the fused ops for decode rows (``OffloadMainKV.attend``)."""
        indexer_op = self._indexer.indexer_op  # type: ignore[attr-defined]
        inputs = indexer_op.fused_inputs
        indexer_op.fused_inputs = None  # one layer call's operands, never reused
        if inputs is None:
            raise RuntimeError("kernel_backend 'fused': the layer's indexer op left no "
                               "operands for this step (kvo's indexer op did not run)")
        strategy = self._strategy()
        if not isinstance(strategy, FusedMainKVAccess):
            raise RuntimeError(f"kernel_backend 'fused' needs the offload strategy, got "
                               f"{type(strategy).__name__}")
        output: torch.Tensor = strategy.attend(kv_cache, query, query_rope, topk,
                                               attn_metadata, inputs, self.scale)
        return output


class KvoSparseMLABackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "KVO_CPU_SPARSE_MLA"

    @staticmethod
    def get_impl_cls() -> type[KvoSparseMLAImpl]:
        return KvoSparseMLAImpl

    @staticmethod
    def get_builder_cls() -> type[KvoSparseMLAMetadataBuilder]:
        return KvoSparseMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True
