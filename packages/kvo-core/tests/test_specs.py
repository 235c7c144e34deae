"""Cache specs (sizes, validation, layout equality) and layer-name parsing (incl. MTP)."""

from __future__ import annotations

import pytest
import torch

from kvo_core.errors import ConfigError, KvoError
from kvo_core.layers import layer_index
from kvo_core.specs import CacheSpec, LayerSpec

MLA = CacheSpec(block_size=64, token_shape=(1, 656), dtype=torch.uint8)
INDEXER = CacheSpec(block_size=64, token_shape=(128,), dtype=torch.int8)
SCALE = CacheSpec(block_size=64, token_shape=(1,), dtype=torch.float16)


def test_cache_spec_sizes() -> None:
    dense = CacheSpec(block_size=16, token_shape=[2, 8, 128], dtype=torch.bfloat16)
    assert dense.token_shape == (2, 8, 128)
    assert dense.elements_per_token == 2 * 8 * 128
    assert dense.bytes_per_token == 2 * 8 * 128 * 2
    assert dense.bytes_per_block == 16 * 4096
    assert isinstance(dense.bytes_per_block, int)


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (16, 1), (17, 2), (160, 10)])
def test_bytes_for_tokens_rounds_up_to_whole_blocks(tokens: int, blocks: int) -> None:
    spec = CacheSpec(block_size=16, token_shape=(4,), dtype=torch.float32)
    assert spec.bytes_for_tokens(tokens) == blocks * 16 * 16


def test_bytes_for_tokens_rejects_negative() -> None:
    with pytest.raises(ConfigError, match="num_tokens must be an integer >= 0, got -1"):
        MLA.bytes_for_tokens(-1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be a positive integer, got 0"),
        ({"block_size": True}, "block_size must be a positive integer, got True"),
        ({"block_size": 16.0}, "block_size must be a positive integer, got 16.0"),
        ({"token_shape": ()}, r"token_shape must be a non-empty tuple .* got \(\)"),
        ({"token_shape": (4, 0)}, r"token_shape .* got \(4, 0\)"),
        ({"token_shape": 576}, "token_shape must be a non-empty tuple .* got 576"),
        ({"dtype": "bfloat16"}, "dtype must be a torch.dtype, got 'bfloat16'"),
    ],
)
def test_cache_spec_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"block_size": 16, "token_shape": (4,), "dtype": torch.float16}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        CacheSpec(**args)  # type: ignore[arg-type]


def test_cache_specs_compare_by_value() -> None:
    a = CacheSpec(block_size=64, token_shape=[1, 656], dtype=torch.uint8)
    assert a == MLA and hash(a) == hash(MLA)
    assert a != CacheSpec(block_size=128, token_shape=(1, 656), dtype=torch.uint8)
    assert a != CacheSpec(block_size=64, token_shape=(1, 656), dtype=torch.int8)


def test_layer_spec_layout_and_bytes() -> None:
    full = LayerSpec("model.layers.3.self_attn.attn", 3, MLA, INDEXER, SCALE)
    assert full.layout == (MLA, INDEXER, SCALE)
    assert full.bytes_per_block == 64 * (656 + 128 + 2)
    plain = LayerSpec("model.layers.4.self_attn.attn", 4, MLA)
    assert plain.layout == (MLA, None, None)
    assert plain.bytes_per_block == MLA.bytes_per_block
    assert len({full.layout, plain.layout}) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"index": -1}, "index must be an integer >= 0, got -1"),
        ({"index": True}, "index must be an integer >= 0, got True"),
        ({"name": ""}, "layer name must be a non-empty string"),
        ({"main": None}, "main must be a CacheSpec, got None"),
        ({"indexer": "x"}, "indexer must be a CacheSpec, got 'x'"),
        ({"indexer_scale": SCALE}, "an indexer_scale spec needs an indexer spec"),
        ({"indexer": CacheSpec(32, (128,), torch.int8)},
         "indexer block size 32 must equal the main-KV block size 64"),
    ],
)
def test_layer_spec_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"name": "model.layers.0.attn", "index": 0, "main": MLA}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        LayerSpec(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "num_base", "expected"),
    [
        ("model.layers.12.self_attn.attn", None, 12),
        ("layers.0", None, 0),
        ("model.layers.60.self_attn.indexer.k_cache", 61, 60),
        ("model.mtp.layers.0.self_attn.attn", 61, 61),
        ("mtp.layers.2.attn", 78, 80),
        ("model.language_model.layers.007.attn", None, 7),
    ],
)
def test_layer_index(name: str, num_base: int | None, expected: int) -> None:
    assert layer_index(name, num_base) == expected


@pytest.mark.parametrize(
    ("name", "num_base", "message"),
    [
        ("model.embed_tokens", None, "cannot find a layer index in 'model.embed_tokens'"),
        ("model.layers.x.attn", None, "cannot find a layer index"),
        ("model.mylayers.3.attn", None, "cannot find a layer index"),
        ("model.layers.3x.attn", None, "cannot find a layer index"),
        ("mtp.layers.1.attn", None, "MTP layer; num_base_layers must be given"),
        ("mtp.layers.1.attn", -1, "got -1"),
    ],
)
def test_layer_index_errors(name: str, num_base: int | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        layer_index(name, num_base)
    assert isinstance(caught.value, KvoError) and isinstance(caught.value, ValueError)
