"""Install kvo's indexer op and model classes into vLLM (idempotent: vLLM calls general plugins
once per process, tests may call them again)."""

from __future__ import annotations

_registered = False

ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
MTP_ARCHITECTURES = ("DeepseekV32MTPModel",)


def register_dsa_components() -> None:
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    from kvo_vllm.dsa.indexer import KvoSparseAttnIndexer
    from kvo_vllm.dsa.model import KvoDeepseekV32ForCausalLM, KvoDeepseekV32MTP

    if op_registry_oot.get(SparseAttnIndexer.__name__) is not KvoSparseAttnIndexer:
        SparseAttnIndexer.register_oot(KvoSparseAttnIndexer)
    # The class itself, not a "module:Class" string: a lazy registration makes vLLM inspect the
    # model in a fresh subprocess at every start (tens of seconds).
    for architecture in ARCHITECTURES:
        ModelRegistry.register_model(architecture, KvoDeepseekV32ForCausalLM)
    for architecture in MTP_ARCHITECTURES:
        ModelRegistry.register_model(architecture, KvoDeepseekV32MTP)
    _registered = True
