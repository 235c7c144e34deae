"""Byte placement of buffer plans for DSA layouts: 61-layer-style models with indexers and MTP."""

from __future__ import annotations

import pytest
import torch

from kvo_core.buffer_plan import plan_layer_buffers
from kvo_core.buffer_regions import (
    INDEXER_PART,
    MAIN_PART,
    SCALE_PART,
    BufferRegions,
    PartRegion,
    layout_parts,
    place_regions,
)
from kvo_core.errors import ConfigError, PlanError
from kvo_core.models import model_from_hf_config, preset
from kvo_core.specs import CacheSpec, LayerSpec

NUM_BLOCKS = 100


@pytest.mark.parametrize(("indexer_dtype", "parts"), [
    ("bfloat16", (MAIN_PART, INDEXER_PART)),
    ("int8", (MAIN_PART, INDEXER_PART, SCALE_PART)),
])
def test_deepseek_v32_plan_places_main_kv_indexer_and_scale_per_slot(
        indexer_dtype: str, parts: tuple[str, ...]) -> None:
    specs = preset("deepseek-v3.2").layer_specs(block_size=64, indexer_kv_dtype=indexer_dtype)
    assert len(specs) == 62 and specs[-1].name == "mtp.layers.0.self_attn.attn"
    assert all(spec.indexer is not None for spec in specs)  # indexer on every layer, MTP too
    plan = plan_layer_buffers(specs, shared_buffers=2, independent_layers=[0])
    assert plan.layer_indices == tuple(range(62))  # the MTP layer joins as layer 61
    assert [slot.layers[:3] for slot in plan.slots] == [(0,), (1, 3, 5), (2, 4, 6)]
    assert plan.slot_of(61) == 1 and plan.predecessor(61) == 59  # odd: slot 1

    regions = place_regions(plan, NUM_BLOCKS)
    spec = specs[0]
    main, indexer, scale = spec.layout
    assert layout_parts(spec.layout) == parts
    per_slot = {MAIN_PART: main.bytes_per_block, INDEXER_PART: indexer.bytes_per_block,
                SCALE_PART: scale.bytes_per_block if scale is not None else 0}
    for slot in plan.slots:
        # The indexer (and scale) follow their main layer's slot, right after its main KV.
        placed = [regions.region(slot.slot_id, part) for part in parts]
        assert [r.block_bytes for r in placed] == [per_slot[p] for p in parts]
        assert all(r.num_blocks == NUM_BLOCKS for r in placed)
        assert all(r.offset % 64 == 0 for r in placed)
        assert [r.offset for r in placed] == sorted(r.offset for r in placed)
        assert placed[0].offset == (0 if slot.slot_id == 0 else
                                    regions.region(slot.slot_id - 1, parts[-1]).end)
    if SCALE_PART not in parts:
        with pytest.raises(PlanError, match="has no 'scale' region"):
            regions.region(0, SCALE_PART)
    logical_per_layer = NUM_BLOCKS * sum(per_slot.values())
    assert regions.logical_bytes == 62 * logical_per_layer
    # Uniform layout, sizes multiples of 64: no padding, the ratio is slots / layers.
    assert regions.total_bytes == 3 * logical_per_layer
    assert regions.footprint_ratio == pytest.approx(3 / 62)


def test_c8_indexer_is_smaller_than_bf16_and_carries_a_scale() -> None:
    model = preset("deepseek-v3.2")
    bf16 = model.layer_specs(block_size=64, indexer_kv_dtype="bfloat16")[0]
    c8 = model.layer_specs(block_size=64, indexer_kv_dtype="int8")[0]
    assert bf16.main == c8.main and bf16.layout != c8.layout  # never aliased with each other
    assert c8.indexer is not None and bf16.indexer is not None and c8.indexer_scale is not None
    assert c8.indexer.bytes_per_block == 64 * 128 and bf16.indexer.bytes_per_block == 64 * 256
    assert c8.indexer_scale.bytes_per_block == 64 * 2


def test_layers_without_an_indexer_form_their_own_group() -> None:
    # GLM-5.2 style: some layers reuse another layer's top-k and cache no indexer keys.
    config = {"num_hidden_layers": 8, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
              "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
              "indexer_types": ["full", "shared"] * 4, "num_nextn_predict_layers": 1}
    specs = model_from_hf_config(config).layer_specs(block_size=64)
    plan = plan_layer_buffers(specs, shared_buffers=1, independent_layers=[0])
    # Layer 0 alone; full-indexer layers 2, 4, 6, 8 (MTP) share; shared-indexer 1, 3, 5, 7.
    assert [slot.layers for slot in plan.slots] == [(0,), (1, 3, 5, 7), (2, 4, 6, 8)]
    regions = place_regions(plan, NUM_BLOCKS)
    assert [(r.slot_id, r.part) for r in regions.regions] == [
        (0, MAIN_PART), (0, INDEXER_PART), (1, MAIN_PART), (2, MAIN_PART), (2, INDEXER_PART)]


def test_offsets_are_aligned_when_pages_are_odd_sized() -> None:
    main = CacheSpec(block_size=3, token_shape=(7,), dtype=torch.uint8)  # 21-byte pages
    indexer = CacheSpec(block_size=3, token_shape=(5,), dtype=torch.uint8)
    specs = [LayerSpec(f"model.layers.{i}.attn", i, main, indexer) for i in range(3)]
    regions = place_regions(plan_layer_buffers(specs, shared_buffers=1), num_blocks=5,
                            alignment=16)
    assert [(r.part, r.offset) for r in regions.regions] == [
        (MAIN_PART, 0), (INDEXER_PART, 112), (MAIN_PART, 192), (INDEXER_PART, 304)]
    assert regions.total_bytes == 304 + 75
    assert regions.logical_bytes == 3 * 5 * (21 + 15)


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_bad_sizes_are_refused(value: object) -> None:
    plan = plan_layer_buffers(preset("deepseek-v3.2").layer_specs(), shared_buffers=2)
    with pytest.raises(ConfigError, match="num_blocks must be an integer >= 1"):
        place_regions(plan, value)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="alignment must be an integer >= 1"):
        place_regions(plan, 4, alignment=value)  # type: ignore[arg-type]


def test_overlapping_regions_are_refused() -> None:
    with pytest.raises(PlanError, match="regions overlap"):
        BufferRegions(regions=[PartRegion(0, MAIN_PART, 0, 10, 2),
                               PartRegion(0, INDEXER_PART, 15, 10, 1)],
                      total_bytes=40, logical_bytes=40)
    with pytest.raises(PlanError, match="past the allocation"):
        BufferRegions(regions=[PartRegion(0, MAIN_PART, 0, 10, 2)], total_bytes=19,
                      logical_bytes=20)
