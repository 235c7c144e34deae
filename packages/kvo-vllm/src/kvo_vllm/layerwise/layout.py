"""Apply kvo-core's layer buffer plan to vLLM's KV-cache configuration.

vLLM 0.32 describes the KV allocation with ``KVCacheConfig.kv_cache_tensors``: one backing
buffer of ``size`` bytes, and per ``KVCacheTensor`` a list of layers placed at
``offset + l * layer_stride + b * block_stride``. Tensors whose byte ranges overlap alias the
same memory (vLLM allows this explicitly). The worker-side connector is built before the
model runner allocates the cache, with the very ``KVCacheConfig`` object it then allocates
from, so rewriting ``kv_cache_tensors`` there is enough to make several logical layers share
one physical buffer: every layer gets a one-layer ``KVCacheTensor`` whose offset is its slot's
region, and the backing buffer shrinks to ``physical_buffers`` layer regions.

Everything is checked before anything is rewritten; a layout this cannot plan (several cache
groups, non attention caches, block-outermost packing, padded pages) raises PlanError naming
what was found and what is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from kvo_core.buffer_plan import LayerBufferPlan, plan_layer_buffers
from kvo_core.config import LayerwiseOffloadConfig
from kvo_core.errors import KvoError, PlanError
from kvo_core.layers import layer_index
from kvo_core.specs import CacheSpec, LayerSpec


@attrs.frozen
class PlannedLayer:
    """One logical layer: its vLLM name, index, slot and whether the slot is shared."""

    name: str
    index: int
    slot_id: int
    shared: bool
    """True when other layers write the same storage, so its KV does not survive a step."""


@attrs.frozen
class LayerLayout:
    """The buffer plan for one engine's KV cache, with the byte geometry of a layer region."""

    plan: LayerBufferPlan
    layers: tuple[PlannedLayer, ...]
    """In forward order (ascending layer index)."""
    block_size: int
    block_bytes: int
    """Bytes of one block of one layer (a contiguous page)."""
    num_blocks: int
    layer_region_bytes: int
    """Bytes between two layers' regions in vLLM's own allocation."""
    dtype: torch.dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def physical_buffers(self) -> int:
        return self.plan.physical_buffers

    @property
    def logical_bytes(self) -> int:
        """What vLLM would allocate without the plan."""
        return self.num_layers * self.layer_region_bytes

    @property
    def physical_bytes(self) -> int:
        """What is allocated with the plan applied."""
        return self.physical_buffers * self.layer_region_bytes

    @property
    def reuses_buffers(self) -> bool:
        return self.physical_buffers < self.num_layers

    def by_name(self) -> dict[str, PlannedLayer]:
        return {layer.name: layer for layer in self.layers}

    def describe(self) -> str:
        slots = "; ".join(f"slot {s.slot_id}: layers {list(s.layers)}" for s in self.plan.slots)
        return (f"{self.num_layers} layers in {self.physical_buffers} physical buffers "
                f"({slots})")


def plan_layout(kv_cache_config: Any, config: LayerwiseOffloadConfig) -> LayerLayout:
    """Check vLLM's KV-cache configuration and plan its layers' buffers (changes nothing)."""
    group = _single_attention_group(kv_cache_config)
    names = list(group.layer_names)
    tensor = _single_layer_outermost_tensor(kv_cache_config, names)
    spec = group.kv_cache_spec
    block_size = int(spec.block_size)
    dtype = spec.dtype
    page = int(spec.page_size_bytes)
    if page != tensor.block_stride:
        raise PlanError(
            f"layerwise offload needs dense KV pages: the block stride is {tensor.block_stride} "
            f"bytes but a page is {page} bytes (padded or packed pages are not supported)")
    element_bytes = dtype.itemsize
    if page % (block_size * element_bytes):
        raise PlanError(f"a KV page of {page} bytes is not a whole number of {dtype} elements "
                        f"per token for block size {block_size}")
    main = CacheSpec(block_size=block_size, token_shape=(page // block_size // element_bytes,),
                     dtype=dtype)
    indexed = _layer_indices(names)
    specs = [LayerSpec(name=name, index=index, main=main) for name, index in indexed.items()]
    plan = plan_layer_buffers(specs, config.shared_buffers, config.independent_layers)
    if config.prefetch_depth >= config.shared_buffers and any(
            len(slot.layers) > 1 for slot in plan.slots):
        raise PlanError(
            f"prefetch_depth {config.prefetch_depth} needs more than {config.shared_buffers} "
            f"shared buffers: a prefetched layer would overwrite a buffer the running layer still "
            f"uses; set prefetch_depth <= shared_buffers - 1 = {config.shared_buffers - 1}")
    layers = tuple(
        PlannedLayer(name=name, index=index, slot_id=plan.slot_of(index),
                     shared=len(plan.layers_sharing(index)) > 1)
        for name, index in sorted(indexed.items(), key=lambda item: item[1]))
    return LayerLayout(plan=plan, layers=layers, block_size=block_size, block_bytes=page,
                       num_blocks=int(kv_cache_config.num_blocks),
                       layer_region_bytes=int(tensor.layer_stride), dtype=dtype)


def apply_layout(kv_cache_config: Any, layout: LayerLayout) -> None:
    """Rewrite ``kv_cache_config.kv_cache_tensors`` so the planned layers alias their slots.

    Must run before vLLM allocates the cache (the worker connector's constructor does).
    """
    from vllm.v1.kv_cache_interface import KVCacheTensor

    original = kv_cache_config.kv_cache_tensors[0]
    size = layout.physical_bytes
    tensors = [
        KVCacheTensor(size=size, layers=[layer.name], layer_stride=original.layer_stride,
                      block_stride=original.block_stride,
                      offset=layer.slot_id * layout.layer_region_bytes)
        for layer in layout.layers
    ]
    kv_cache_config.kv_cache_tensors = tensors


def _single_attention_group(kv_cache_config: Any) -> Any:
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise PlanError(
            f"layerwise offload supports models with one KV-cache group (uniform full "
            f"attention); this model has {len(groups)} groups "
            f"({', '.join(type(g.kv_cache_spec).__name__ for g in groups)})")
    spec = groups[0].kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs) or not isinstance(spec, AttentionSpec):
        raise PlanError(f"layerwise offload needs one attention spec for every layer, got "
                        f"{type(spec).__name__}")
    if getattr(spec, "sliding_window", None) is not None:
        raise PlanError("layerwise offload does not support sliding-window attention layers")
    if not spec.has_layer_views:
        raise PlanError(f"{type(spec).__name__} has no per-layer cache views to plan")
    if groups[0].host_resident:
        raise PlanError("layerwise offload cannot plan a host-resident KV-cache group")
    return groups[0]


def _single_layer_outermost_tensor(kv_cache_config: Any, names: Sequence[str]) -> Any:
    tensors = list(kv_cache_config.kv_cache_tensors)
    if len(tensors) != 1:
        raise PlanError(
            f"layerwise offload expects vLLM to place all layers in one KV-cache tensor, got "
            f"{len(tensors)} tensors (was the configuration already rewritten?)")
    tensor = tensors[0]
    if sorted(tensor.layers) != sorted(names):
        raise PlanError(f"the KV-cache tensor holds layers {tensor.layers}, but the cache group "
                        f"has {list(names)}")
    if tensor.offset != 0 or tensor.host_resident:
        raise PlanError(f"unexpected KV-cache tensor placement (offset {tensor.offset}, "
                        f"host_resident {tensor.host_resident})")
    num_blocks = int(kv_cache_config.num_blocks)
    if tensor.layer_stride < num_blocks * tensor.block_stride:
        raise PlanError(
            f"layerwise offload needs a layer-outermost KV layout (each layer one contiguous "
            f"region); this one interleaves layers inside blocks (layer stride "
            f"{tensor.layer_stride} < {num_blocks} blocks x {tensor.block_stride} bytes). "
            f"Use a layer-outermost VLLM_KV_CACHE_LAYOUT (e.g. LBHNC, the CPU default)")
    if tensor.size < len(tensor.layers) * tensor.layer_stride:
        raise PlanError(f"KV-cache tensor of {tensor.size} bytes is smaller than its "
                        f"{len(tensor.layers)} layer regions of {tensor.layer_stride} bytes")
    return tensor


def _layer_indices(names: Sequence[str]) -> dict[str, int]:
    try:
        indexed = {name: layer_index(name) for name in names}
    except KvoError as error:
        raise PlanError(f"cannot plan buffers: {error}") from error
    seen: dict[int, str] = {}
    for name, index in indexed.items():
        if index in seen:
            raise PlanError(f"layers {seen[index]!r} and {name!r} map to the same layer index "
                            f"{index}; cannot plan buffers for several caches per layer")
        seen[index] = name
    return indexed


def check_aliasing(layout: LayerLayout, kv_caches: Mapping[str, torch.Tensor]) -> None:
    """Check that the allocated caches follow the plan: same storage within a slot only."""
    missing = [layer.name for layer in layout.layers if layer.name not in kv_caches]
    if missing:
        raise PlanError(f"vLLM registered no KV cache for planned layers {missing}")
    pointer_by_slot: dict[int, int] = {}
    for layer in layout.layers:
        tensor = kv_caches[layer.name]
        if tensor.shape[0] != layout.num_blocks:
            raise PlanError(f"layer {layer.name!r}: KV cache has {tensor.shape[0]} blocks, "
                            f"the plan expects {layout.num_blocks}")
        page_bytes = tensor.stride(0) * tensor.element_size()
        if page_bytes != layout.block_bytes or not tensor[0].is_contiguous():
            raise PlanError(f"layer {layer.name!r}: a KV block is not one contiguous page of "
                            f"{layout.block_bytes} bytes (shape {tuple(tensor.shape)}, strides "
                            f"{tensor.stride()})")
        pointer = tensor.data_ptr()
        expected = pointer_by_slot.setdefault(layer.slot_id, pointer)
        if pointer != expected:
            raise PlanError(f"layer {layer.name!r} should share slot {layer.slot_id}'s storage "
                            f"at {expected:#x} but lives at {pointer:#x}: the plan was not "
                            f"applied before allocation")
    if len(set(pointer_by_slot.values())) != len(pointer_by_slot):
        raise PlanError("two buffer slots share storage; the allocation does not follow the plan")
