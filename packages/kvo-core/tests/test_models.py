"""Model descriptions: presets, per-rank specs under TP, and parsing Hugging Face config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvo_core.cli import load_model
from kvo_core.errors import ConfigError
from kvo_core.layers import layer_index
from kvo_core.models import ModelDescription, model_from_hf_config, preset, preset_names


def test_preset_names() -> None:
    assert {"deepseek-v3.2", "glm-5", "llama-3.1-8b"} <= set(preset_names())


@pytest.mark.parametrize(("name", "base", "mtp", "index_heads"),
                         [("deepseek-v3.2", 61, 1, 64), ("glm-5", 78, 1, 32)])
def test_mla_indexer_presets(name: str, base: int, mtp: int, index_heads: int) -> None:
    model = preset(name)
    assert model.attention == "mla"
    assert (model.num_layers, model.num_mtp_layers) == (base, mtp)
    assert (model.kv_lora_rank, model.rope_head_dim) == (512, 64)
    assert model.index_n_heads == index_heads
    assert model.default_top_k == 2048
    specs = model.layer_specs()
    assert [s.index for s in specs] == list(range(base + mtp))
    for spec in specs:
        assert spec.main.token_shape == (1, 576)
        assert spec.main.dtype == torch.bfloat16
        assert spec.main.bytes_per_token == 1152
        assert spec.indexer is not None and spec.indexer.bytes_per_token == 256
        assert spec.indexer_scale is None
        assert layer_index(spec.name, base) == spec.index
    assert specs[-1].name.startswith("mtp.layers.0.")
    # MLA latent KV is replicated: a TP rank holds the whole row
    assert model.layer_specs(tp=8)[0].main == specs[0].main
    assert len(model.layer_specs(include_mtp=False)) == base


def test_int8_indexer_adds_fp16_scale() -> None:
    spec = preset("deepseek-v3.2").layer_specs(indexer_kv_dtype="int8", block_size=64)[0]
    assert spec.indexer is not None and spec.indexer_scale is not None
    assert spec.indexer.dtype == torch.int8 and spec.indexer.bytes_per_token == 128
    assert spec.indexer_scale.dtype == torch.float16 and spec.indexer_scale.bytes_per_token == 2
    assert spec.main.block_size == spec.indexer.block_size == 64
    assert spec.bytes_per_block == 64 * (1152 + 128 + 2)


def test_llama_preset_and_tp_sharding() -> None:
    model = preset("Llama-3.1-8B")  # case-insensitive
    assert model.attention == "gqa" and not model.has_indexer
    specs = model.layer_specs()
    assert len(specs) == 32
    assert specs[0].main.token_shape == (2, 8, 128)
    assert specs[0].main.bytes_per_token == 4096
    assert specs[0].indexer is None
    assert model.layer_specs(tp=2)[0].main.token_shape == (2, 4, 128)
    assert model.layer_specs(tp=8)[0].main.token_shape == (2, 1, 128)
    assert model.layer_specs(tp=16)[0].main.token_shape == (2, 1, 128)  # replicated head
    with pytest.raises(ConfigError, match="TP size 3 does not divide the 8 KV heads"):
        model.layer_specs(tp=3)
    with pytest.raises(ConfigError, match="TP size 12 exceeds the 8 KV heads"):
        model.layer_specs(tp=12)
    with pytest.raises(ConfigError, match="TP size must be an integer >= 1, got 0"):
        model.layer_specs(tp=0)


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError, match=r"unknown model preset 'gpt-9'.*deepseek-v3\.2"):
        preset("gpt-9")


def _write(tmp_path: Path, config: dict[str, Any], folder: str = "my-model") -> Path:
    directory = tmp_path / folder
    directory.mkdir()
    path = directory / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_parse_written_deepseek_style_config(tmp_path: Path) -> None:
    path = _write(tmp_path, {
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
        "num_hidden_layers": 5, "kv_lora_rank": 96, "qk_rope_head_dim": 32,
        "index_n_heads": 4, "index_head_dim": 64, "index_topk": 256,
        "num_nextn_predict_layers": 2, "hidden_size": 1024, "num_attention_heads": 8})
    for source in (str(path), str(path.parent)):  # the file or its directory
        model = load_model(source)
        assert model.name == "my-model"
        assert model.attention == "mla"
        assert model.total_layers == 7
        assert model.default_top_k == 256
        specs = model.layer_specs(block_size=16)
        assert [s.index for s in specs] == list(range(7))
        assert specs[0].main.bytes_per_token == (96 + 32) * 2
        assert specs[0].indexer is not None and specs[0].indexer.bytes_per_token == 128
        assert specs[5].name.startswith("mtp.layers.0.") and specs[5].indexer is not None


def test_parse_dense_config_derives_head_dim(tmp_path: Path) -> None:
    model = load_model(str(_write(tmp_path, {
        "num_hidden_layers": 3, "num_attention_heads": 16, "num_key_value_heads": 4,
        "hidden_size": 1024})))
    assert (model.attention, model.num_kv_heads, model.head_dim) == ("gqa", 4, 64)
    assert model.layer_specs()[0].main.token_shape == (2, 4, 64)
    # no num_key_value_heads: multi-head attention (one KV head per query head)
    mha = model_from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4,
                                "hidden_size": 256, "head_dim": None})
    assert (mha.num_kv_heads, mha.head_dim) == (4, 64)


def test_text_config_is_read() -> None:
    model = model_from_hf_config({"model_type": "llava", "text_config": {
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32}})
    assert model.num_layers == 2 and model.num_kv_heads == 2


def test_shared_indexer_layers_have_no_indexer_cache() -> None:
    model = model_from_hf_config({
        "num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "index_head_dim": 128, "index_topk": 2048, "num_nextn_predict_layers": 1,
        "indexer_types": ["full", "shared", "shared", "full"]})
    assert model.indexer_layers == frozenset({0, 3})
    specs = model.layer_specs()
    assert [s.indexer is not None for s in specs] == [True, False, False, True, True]
    all_full = model_from_hf_config({
        "num_hidden_layers": 2, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
        "index_head_dim": 128, "indexer_types": ["full", "full"],
        "layer_types": ["indexed_attention", "indexed_attention"]})
    assert all_full.indexer_layers is None


@pytest.mark.parametrize(("config", "fragment"), [
    ({}, "missing 'num_hidden_layers'"),
    ({"num_hidden_layers": 0}, "'num_hidden_layers' must be an integer >= 1, got 0"),
    ({"num_hidden_layers": 2, "kv_lora_rank": 512}, "missing 'qk_rope_head_dim'"),
    ({"num_hidden_layers": 2}, "missing 'num_attention_heads'"),
    ({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 100},
     "hidden_size 100 is not a multiple of num_attention_heads 3"),
    ({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 64,
      "layer_types": ["full_attention", "sliding_attention"]},
     "layer types ['sliding_attention'] are not supported"),
    ({"num_hidden_layers": 2, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
      "index_head_dim": 16, "indexer_types": ["full"]}, "one entry per layer (2)"),
    ({"num_hidden_layers": 2, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
      "index_head_dim": 16, "indexer_types": ["full", "odd"]}, "'full' or 'shared'"),
    ({"num_hidden_layers": "61"}, "'num_hidden_layers' must be an integer >= 1, got '61'"),
])
def test_bad_configs(config: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        model_from_hf_config(config, name="bad")
    assert fragment in str(info.value)
    assert "'bad'" in str(info.value)


def test_description_validation() -> None:
    with pytest.raises(ConfigError, match="kv_lora_rank >= 1"):
        ModelDescription(name="x", attention="mla", num_layers=2)
    with pytest.raises(ConfigError, match="num_kv_heads >= 1 and head_dim >= 1"):
        ModelDescription(name="x", attention="gqa", num_layers=2, num_kv_heads=2)
    with pytest.raises(ConfigError, match="indexer_layers \\[5\\] are outside"):
        ModelDescription(name="x", attention="mla", num_layers=2, kv_lora_rank=8,
                         index_head_dim=16, indexer_layers={0, 5})


def test_load_model_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a preset"):
        load_model(str(tmp_path / "missing.json"))
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"is not a JSON config\.json"):
        load_model(str(bad))


def test_transformers_configs_parse_like_the_presets() -> None:
    """The presets agree with transformers' own config classes for these models."""
    transformers = pytest.importorskip("transformers")
    v32 = model_from_hf_config(transformers.DeepseekV32Config().to_dict())
    glm = model_from_hf_config(transformers.GlmMoeDsaConfig().to_dict())
    for parsed, name in ((v32, "deepseek-v3.2"), (glm, "glm-5")):
        expected = preset(name)
        assert parsed.num_layers == expected.num_layers
        assert (parsed.kv_lora_rank, parsed.rope_head_dim) == (512, 64)
        assert (parsed.index_head_dim, parsed.index_n_heads, parsed.index_topk) == (
            expected.index_head_dim, expected.index_n_heads, expected.index_topk)
        assert parsed.indexer_layers is None
