"""The one switch of kvo's sparse MLA backend: where it is read and how defaults are filled.

The settings are kvo-core's :class:`~kvo_core.config.SparseDecodeOffloadConfig` (every value
validated there, an unknown key an error naming it). They come from exactly one of:

- ``additional_config={"kvo_sparse": {...}}`` of vLLM (``--additional-config`` on the CLI), the
  platform-plugin way: it travels with the engine config into every worker;
- the environment variable ``KVO_SPARSE_CONFIG`` holding the same mapping as JSON.

Setting both is an error (two sources could disagree silently). With neither, every default
applies: ``mode="resident"``. Defaults that depend on the model: ``top_k`` is the model's
``index_topk`` (a different value is refused: vLLM's top-k buffer is that wide), ``block_size``
is vLLM's cache block size and ``hot_capacity`` is ``2 x top_k`` rounded up to whole blocks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from kvo_core.config import SparseDecodeOffloadConfig
from kvo_core.errors import ConfigError

ENV_VAR = "KVO_SPARSE_CONFIG"
ADDITIONAL_CONFIG_KEY = "kvo_sparse"
RESIDENT_KERNEL_BACKENDS = ("auto", "reference")
"""What the resident mode runs here: kvo-kernels' reference primitives (``auto`` picks them)."""


def raw_sparse_settings(additional_config: Any, environ: Mapping[str, str] | None = None
                        ) -> dict[str, Any]:
    """The user's mapping from the one place it was given (``{}`` when nowhere)."""
    environ = os.environ if environ is None else environ
    from_vllm = None
    if isinstance(additional_config, Mapping) and ADDITIONAL_CONFIG_KEY in additional_config:
        from_vllm = additional_config[ADDITIONAL_CONFIG_KEY]
    from_env = environ.get(ENV_VAR)
    if from_vllm is not None and from_env:
        raise ConfigError(
            f"kvo sparse settings given twice: additional_config[{ADDITIONAL_CONFIG_KEY!r}] "
            f"and the environment variable {ENV_VAR}; set exactly one")
    if from_env:
        try:
            from_vllm = json.loads(from_env)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{ENV_VAR} must hold a JSON object, got {from_env!r}: "
                              f"{error}") from None
    if from_vllm is None:
        return {}
    if not isinstance(from_vllm, Mapping):
        raise ConfigError(f"kvo sparse settings must be a mapping of option names to values, "
                          f"got {type(from_vllm).__name__}: {from_vllm!r}")
    return dict(from_vllm)


def resolve_sparse_config(settings: Mapping[str, Any], *, index_topk: int,
                          cache_block_size: int) -> SparseDecodeOffloadConfig:
    """Fill the model-dependent defaults, validate, and check what this backend can run."""
    values = dict(settings)
    if "top_k" in values and values["top_k"] != index_topk:
        raise ConfigError(f"top_k must equal the model's index_topk ({index_topk}) or be left "
                          f"out, got {values['top_k']!r}")
    values["top_k"] = index_topk
    values.setdefault("block_size", cache_block_size)
    block = values["block_size"]
    if "hot_capacity" not in values and isinstance(block, int) and block > 0:
        values["hot_capacity"] = -(-2 * index_topk // block) * block
    config = SparseDecodeOffloadConfig.from_extra_config(values)
    if config.mode == "resident" and config.kernel_backend not in RESIDENT_KERNEL_BACKENDS:
        raise ConfigError(
            f"kernel_backend {config.kernel_backend!r} cannot run in mode 'resident' on this "
            f"device; available: {', '.join(RESIDENT_KERNEL_BACKENDS)}")
    return config


def sparse_config_for(vllm_config: Any) -> SparseDecodeOffloadConfig:
    """The validated settings for a vLLM engine serving a DeepSeek-V3.2-architecture model."""
    text_config = vllm_config.model_config.hf_text_config
    return resolve_sparse_config(raw_sparse_settings(vllm_config.additional_config),
                                 index_topk=int(text_config.index_topk),
                                 cache_block_size=int(vllm_config.cache_config.block_size))


def is_sparse_mla_model(model_config: Any) -> bool:
    """A model with DeepSeek's lightning indexer (``index_topk`` in its config) and MLA."""
    if model_config is None:
        return False
    return (hasattr(model_config.hf_text_config, "index_topk")
            and bool(getattr(model_config, "use_mla", False)))
