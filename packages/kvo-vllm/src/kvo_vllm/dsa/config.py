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
OFFLOAD_KERNEL_BACKENDS = ("auto", "reference", "fused")
"""What the offload mode runs here: the reference primitives and ``kvo::sparse_copy``, or
(``fused``) the fused ops for decode rows, each with the implementation kvo-kernels' dispatch
picks for the device (the reference on CPU)."""


MAIN_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
"""vLLM ``kv_cache_dtype`` values kvo's sparse MLA backend serves: an unpacked main-KV row of
the model's dtype (``auto``) or a 16-bit one. Packed main caches (fp8 / int8 / FP4 / TurboQuant
rows with scales) are refused: the host pool, its residency copies and the P/D pulls move
whole unpacked rows (docs/design.md section 12: "BF16 main KV only")."""


def check_main_kv_cache_dtype(cache_dtype: object) -> None:
    """Refuse at start-up a packed main-KV cache, naming the field, the value and what is
    allowed (vLLM would otherwise fail deep in backend selection or quietly pick another
    backend)."""
    if cache_dtype not in MAIN_KV_CACHE_DTYPES:
        raise ConfigError(
            f"kv_cache_dtype={cache_dtype!r} is a packed main-KV cache, which kvo's sparse MLA "
            f"backend does not serve (its host pool and transfers move unpacked rows); "
            f"allowed: {', '.join(repr(d) for d in MAIN_KV_CACHE_DTYPES)} (bfloat16 for "
            f"DeepSeek-V3.2; 'auto' is the model's dtype)")


def kernel_backends(mode: str) -> tuple[str, ...]:
    """The ``kernel_backend`` values kvo's sparse MLA backend can run in ``mode`` here."""
    return OFFLOAD_KERNEL_BACKENDS if mode == "offload" else RESIDENT_KERNEL_BACKENDS


def _why_not(kernel_backend: str) -> str:
    """Why a backend name cannot run in kvo's CPU sparse MLA backend (for the error)."""
    from kvo_kernels import dispatch

    if kernel_backend == "fused":
        return "the fused ops serve offloaded decode rows: set mode 'offload'"
    if kernel_backend == "triton":
        if not dispatch.triton_available():
            return "triton is not installed"
        return ("kvo's sparse MLA backend runs on the CPU, where Triton runs only in its "
                "interpreter, a test mode")
    if kernel_backend == "native":
        if dispatch.torch_ops_native_lookup(dispatch.NATIVE_OPS["lightning_indexer_manage"]) \
                is None:
            return ("the Ascend ops torch.ops._C_ascend.npu_fused_* are not registered "
                    "(they come with a vllm-ascend build)")
        return "kvo's sparse MLA backend runs on the CPU, the Ascend ops on NPU tensors"
    return "not a backend of kvo's sparse MLA attention"


def decode_query_rows(config: SparseDecodeOffloadConfig) -> int:
    """Query rows up to which a request's call is a decode (residency, hot buffer): at most
    ``max_query_rows``, and as many whole top-k selections as ``hot_capacity`` holds."""
    return min(config.max_query_rows, config.hot_capacity // config.top_k)


def uses_fused_ops(config: SparseDecodeOffloadConfig) -> bool:
    """Decode rows run through kvo-kernels' fused ops (``kernel_backend="fused"``)."""
    return config.mode == "offload" and config.kernel_backend == "fused"


def check_kernel_backend(config: SparseDecodeOffloadConfig) -> None:
    """Refuse at start-up a ``kernel_backend`` that cannot run here, naming what can."""
    available = kernel_backends(config.mode)
    if config.kernel_backend not in available:
        raise ConfigError(
            f"kernel_backend {config.kernel_backend!r} cannot run in mode {config.mode!r} on "
            f"this device ({_why_not(config.kernel_backend)}); available: "
            f"{', '.join(available)}")


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
    check_kernel_backend(config)
    return config


def sparse_config_for(vllm_config: Any) -> SparseDecodeOffloadConfig:
    """The validated settings for a vLLM engine serving a DeepSeek-V3.2-architecture model."""
    text_config = vllm_config.model_config.hf_text_config
    check_main_kv_cache_dtype(vllm_config.cache_config.cache_dtype)
    return resolve_sparse_config(raw_sparse_settings(vllm_config.additional_config),
                                 index_topk=int(text_config.index_topk),
                                 cache_block_size=int(vllm_config.cache_config.block_size))


def is_sparse_mla_model(model_config: Any) -> bool:
    """A model with DeepSeek's lightning indexer (``index_topk`` in its config) and MLA."""
    if model_config is None:
        return False
    return (hasattr(model_config.hf_text_config, "index_topk")
            and bool(getattr(model_config, "use_mla", False)))
