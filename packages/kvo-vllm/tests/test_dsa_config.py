"""kvo's sparse serving switch: one source, model-dependent defaults, errors naming the field."""

from __future__ import annotations

import json

import pytest

from kvo_core.errors import ConfigError
from kvo_vllm.dsa.config import (
    ADDITIONAL_CONFIG_KEY,
    ENV_VAR,
    raw_sparse_settings,
    resolve_sparse_config,
)


def _resolve(settings: dict, topk: int = 32, block: int = 64):  # type: ignore[no-untyped-def]
    return resolve_sparse_config(settings, index_topk=topk, cache_block_size=block)


def test_defaults_follow_the_model() -> None:
    config = _resolve({})
    assert (config.mode, config.top_k, config.block_size, config.hot_capacity) == \
        ("resident", 32, 64, 64)
    # 2 x top-k rounded up to whole blocks
    assert _resolve({}, topk=48, block=64).hot_capacity == 128
    assert _resolve({"hot_capacity": 192}).hot_capacity == 192


def test_settings_come_from_exactly_one_place() -> None:
    from_vllm = {ADDITIONAL_CONFIG_KEY: {"mode": "offload"}}
    assert raw_sparse_settings(from_vllm, environ={}) == {"mode": "offload"}
    assert raw_sparse_settings({}, environ={ENV_VAR: json.dumps({"indexer_kv_dtype": "int8"})}) \
        == {"indexer_kv_dtype": "int8"}
    assert raw_sparse_settings({}, environ={}) == {}
    with pytest.raises(ConfigError, match="given twice"):
        raw_sparse_settings(from_vllm, environ={ENV_VAR: "{}"})
    with pytest.raises(ConfigError, match=ENV_VAR):
        raw_sparse_settings({}, environ={ENV_VAR: "{mode: offload"})
    with pytest.raises(ConfigError, match="mapping"):
        raw_sparse_settings({ADDITIONAL_CONFIG_KEY: ["offload"]}, environ={})


@pytest.mark.parametrize(("settings", "words"), [
    ({"modee": "offload"}, ("unknown", "'modee'", "mode")),
    ({"mode": "remote"}, ("mode", "'remote'", "resident, offload")),
    ({"indexer_kv_dtype": "fp8"}, ("indexer_kv_dtype", "'fp8'", "bfloat16, int8")),
    ({"top_k": 64}, ("top_k", "index_topk (32)", "64")),
    ({"hot_capacity": 16}, ("hot_capacity", ">= top_k")),
    ({"kernel_backend": "triton"}, ("kernel_backend", "'triton'", "available: auto, reference")),
    ({"kernel_backend": "native"}, ("kernel_backend", "'native'", "available: auto, reference")),
    ({"kernel_backend": "fused"},
     ("kernel_backend", "'fused'", "mode 'resident'", "set mode 'offload'",
      "available: auto, reference")),
    ({"mode": "offload", "kernel_backend": "triton"},
     ("kernel_backend", "'triton'", "mode 'offload'", "available: auto, reference, fused")),
    ({"mode": "offload", "kernel_backend": "native"},
     ("kernel_backend", "'native'", "_C_ascend", "available: auto, reference, fused")),
])
def test_bad_values_are_refused_naming_the_field(settings: dict, words: tuple) -> None:
    with pytest.raises(ConfigError) as raised:
        _resolve(settings)
    for word in words:
        assert word in str(raised.value)


def test_fused_is_accepted_in_offload_mode() -> None:
    config = _resolve({"mode": "offload", "kernel_backend": "fused"})
    assert (config.mode, config.kernel_backend) == ("offload", "fused")


def test_triton_refusal_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed or not, Triton cannot run kvo's CPU sparse backend: the error says which."""
    from kvo_kernels import dispatch

    for installed, reason in ((False, "triton is not installed"), (True, "interpreter")):
        monkeypatch.setattr(dispatch, "triton_available", lambda installed=installed: installed)
        with pytest.raises(ConfigError, match=reason):
            _resolve({"mode": "offload", "kernel_backend": "triton"})


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e4m3", "fp8_ds_mla", "int8", "turboquant_4bit_nc"])
def test_packed_main_kv_cache_is_refused_naming_the_field(dtype: str) -> None:
    from kvo_vllm.dsa.config import check_main_kv_cache_dtype

    with pytest.raises(ConfigError, match=rf"kv_cache_dtype='{dtype}' is a packed main-KV "
                                          r"cache.*allowed: 'auto', 'bfloat16', 'float16'"):
        check_main_kv_cache_dtype(dtype)


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float16"])
def test_unpacked_main_kv_cache_is_accepted(dtype: str) -> None:
    from kvo_vllm.dsa.config import check_main_kv_cache_dtype

    check_main_kv_cache_dtype(dtype)
