"""What vLLM allocates for an offloaded layer, and how many blocks the host pool gets.

vLLM 0.32 sizes one device KV budget over every layer's ``KVCacheSpec`` page (DeepSeek-V3.2:
one kv-cache group, ``UniformTypeKVCacheSpecs`` of the MLA main-KV specs and the indexer's,
same block size, different page sizes) and binds each layer a view of the shared allocation.
For the offload mode the main-KV rows must not be in that budget: they live in kvo's host pool.

Options looked at (vLLM 0.32 source): vLLM's own HiSparse path (``attention_config.
hisparse_config``: host-resident kv-cache groups, ``HiSparseHotSpec``) allocates its own host
pool and swap kernels for CUDA, not a kvo ``HostPool`` a transfer engine can fill; marking a
spec without per-layer views (``has_layer_views = False``) also drops the layer from attention
backend selection; a platform hook on the worker's allocation would re-implement
``allocate_kv_cache``. Chosen, the least invasive: the backend's ``customize_spec`` hook (vLLM
calls it for every attention layer's spec) returns :class:`HostStoredMLASpec`, the layer's
``MLAAttentionSpec`` whose per-token device content is one element instead of a 576-value row
(vllm-ascend's ``store_on_host`` marks the same thing). The spec stays a full-attention MLA spec
(same group, same block table, same slot mapping), so vLLM keeps allocating block ids and slot
mappings for the layer; the device view it binds is a ``[blocks, block_size, 1]`` placeholder
(a page size of 0 would divide by zero in vLLM's sizing), and the real rows go to the host pool
at the same slot ids (:mod:`kvo_vllm.dsa.offload_manager`). The device budget thus pays for the
indexer cache plus ``1 / row_dim`` of the main KV; the hot buffers come on top, allocated by
kvo when the cache is bound.

The block count: the pool holds every block vLLM may hand out, so the platform sets vLLM's
``num_gpu_blocks_override`` to what the pool holds (:func:`apply_offload_cache_config`):
``host_pool_bytes`` when given, else ``max_num_seqs`` full-length requests. vLLM's scheduler
then never hands out a block the pool lacks: a request that does not fit waits (or preempts),
and a pool too small for one ``max_model_len`` request is a start-up error.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.v1.kv_cache_interface import MLAAttentionSpec

from kvo_core.config import SparseDecodeOffloadConfig
from kvo_core.errors import ConfigError
from kvo_vllm.dsa.backend import KvoSparseMLABackend
from kvo_vllm.dsa.config import check_kernel_backend

OFFLOAD_BACKEND = "kvo_vllm.dsa.offload_backend.KvoOffloadSparseMLABackend"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostStoredMLASpec(MLAAttentionSpec):
    """An MLA main-KV spec whose rows are stored on the host (one placeholder value per token
    on the device); ``host_row_bytes`` is the real row each token has in the host pool."""

    store_on_host: bool = True
    host_row_bytes: int = 0


def host_stored(spec: Any) -> Any:
    """The host-stored variant of an MLA main-KV spec (other specs unchanged)."""
    if not isinstance(spec, MLAAttentionSpec) or isinstance(spec, HostStoredMLASpec):
        return spec
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    itemsize = spec.dtype.itemsize
    values.update(state_content_bytes=itemsize, num_head_slots=1, page_size_padded=None,
                  host_row_bytes=spec.head_size * itemsize)
    return HostStoredMLASpec(**values)


class KvoOffloadSparseMLABackend(KvoSparseMLABackend):
    """kvo's sparse MLA backend whose main-KV cache is host-stored (module docstring)."""

    @staticmethod
    def get_name() -> str:
        return "KVO_CPU_SPARSE_MLA_OFFLOAD"

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        return host_stored(super().customize_spec(spec))


def sparse_backend_for_current_config(resident_backend: str) -> str:
    """The sparse MLA backend class path for the engine being built (vLLM's current config)."""
    from vllm.config import get_current_vllm_config_or_none

    from kvo_vllm.dsa.config import is_sparse_mla_model, sparse_config_for

    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is None or not is_sparse_mla_model(vllm_config.model_config):
        return resident_backend
    return OFFLOAD_BACKEND if sparse_config_for(vllm_config).mode == "offload" else (
        resident_backend)


def configure_mode(vllm_config: Any, config: SparseDecodeOffloadConfig) -> None:
    """The platform's start-up step for kvo's sparse mode (resident or offload)."""
    forget_backend_choice()
    if config.mode == "offload":
        apply_offload_cache_config(vllm_config, config)


def forget_backend_choice() -> None:
    """Drop vLLM's memo of attention backend choices (``_cached_get_attn_backend``).

    vLLM memoises the backend per layer signature, and kvo's mode is not part of that key: a
    second engine in the same process (tests, benchmarks) with the other mode would get the
    first one's backend class. The platform calls this for every sparse model it configures.
    """
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()


def offloaded_layers(vllm_config: Any) -> int:
    """Main-KV layers the pool will hold: the model's, plus MTP draft layers when drafting."""
    text = vllm_config.model_config.hf_text_config
    layers = int(text.num_hidden_layers)
    speculative = getattr(vllm_config, "speculative_config", None)
    if speculative is not None and getattr(speculative, "method", None) == "mtp":
        layers += int(getattr(text, "num_nextn_predict_layers", 0) or 0)
    return layers


def apply_offload_cache_config(vllm_config: Any, config: SparseDecodeOffloadConfig) -> int:
    """Check the offload settings and set vLLM's block count to the pool's; returns it."""
    check_kernel_backend(config)
    cache = vllm_config.cache_config
    text = vllm_config.model_config.hf_text_config
    block = int(cache.block_size)
    if config.kernel_backend == "fused" and config.hot_capacity % block:
        raise ConfigError(
            f"hot_capacity={config.hot_capacity} must be a multiple of vLLM's block size "
            f"({block}) with kernel_backend 'fused': the fused op pages the hot buffer in "
            f"the pool's blocks")
    max_len = int(vllm_config.model_config.max_model_len)
    per_request = -(-max_len // block)
    if config.host_pool_bytes is None:
        blocks = per_request * int(vllm_config.scheduler_config.max_num_seqs) + 1
    else:
        row_bytes = (int(text.kv_lora_rank) + int(text.qk_rope_head_dim)) * int(
            vllm_config.model_config.dtype.itemsize)
        per_block = block * row_bytes * offloaded_layers(vllm_config)
        blocks = config.host_pool_bytes // per_block
        if blocks < per_request + 1:
            raise ConfigError(
                f"host_pool_bytes={config.host_pool_bytes} holds {blocks} blocks of {block} "
                f"tokens ({per_block} bytes each over {offloaded_layers(vllm_config)} layers); "
                f"one request of max_model_len={max_len} needs {per_request} blocks plus "
                f"vLLM's null block: raise host_pool_bytes to at least "
                f"{(per_request + 1) * per_block} or lower max_model_len")
    if cache.num_gpu_blocks_override is None:
        cache.num_gpu_blocks_override = blocks
    return int(cache.num_gpu_blocks_override)
