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
    SlidingWindowSpec,
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
