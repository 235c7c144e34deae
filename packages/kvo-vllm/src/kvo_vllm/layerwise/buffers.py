"""Where a layer's blocks lie: the registered caches of each layer, addressed for the store.

A layer's buffer is its slot's storage (shared with other layers when the slot is shared); a
block of the layer is stored as one key per cache part (main KV, then a DSA layer's indexer
keys). ``LayerBuffers`` is built once from the live caches (``register_kv_caches``) and read
by the loader and the savers; it holds no state of a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
import torch

from kvo_core.gates import SlotKey
from kvo_vllm.layerwise.keys import StoreKeys, layer_suffix
from kvo_vllm.layerwise.layout import LayerLayout, PlannedLayer, PlannedPart, check_aliasing
from kvo_vllm.layerwise.metadata import BlockRef
from kvo_vllm.layerwise.staging import block_rows, block_runs


@attrs.frozen
class CachePart:
    """One registered cache of a layer (its main KV or its indexer keys)."""

    planned: PlannedPart
    tensor: torch.Tensor
    pointer: int
    rows: torch.Tensor
    """The cache as uint8 [blocks, block_bytes] (what the staging gather reads)."""
    num_blocks: int

    def address(self, block_id: int) -> int:
        """Where block ``block_id`` starts; refused outside the cache (a raw memmove to it
        would write into another layer's blocks unnoticed)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} is outside the {self.num_blocks} blocks of "
                             f"cache {self.planned.cache_name!r}")
        return self.pointer + block_id * self.planned.block_bytes


@attrs.frozen
class LayerBuffer:
    """A layer's caches in its slot's storage, and the store keys of its blocks."""

    layer: PlannedLayer
    parts: tuple[CachePart, ...]
    """Main KV first, then the indexer: every cache a block of this layer is stored as."""
    slot: SlotKey
    suffixes: tuple[str, ...]
    """Key endings of this layer's parts, in part order (``keys.layer_suffix``)."""

    block_bytes: int
    """One block's bytes in all parts together."""

    def keys(self, keys: StoreKeys, refs: Iterable[BlockRef]) -> list[str]:
        """Store keys of ``refs`` in every part, part by part."""
        refs = list(refs)
        return [keys.key(ref.name, self.layer.index, part.planned.part)
                for part in self.parts for ref in refs]

    def locations(self, refs: list[BlockRef]) -> tuple[list[int], list[int]]:
        """(addresses, sizes) of ``refs`` in every part, part by part (the order of ``keys``)."""
        ids = [ref.block_id for ref in refs]
        addresses: list[int] = []
        sizes: list[int] = []
        if not ids:
            return addresses, sizes
        for part in self.parts:
            part.address(min(ids))  # every id is inside the cache if both ends are
            part.address(max(ids))
            width = part.planned.block_bytes
            addresses += [part.pointer + block * width for block in ids]
            sizes += [width] * len(ids)
        return addresses, sizes

    def run_locations(self, runs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """``locations`` of the blocks of ``runs`` (``block_runs``), in order: a range per run
        and part, extended in C (the step-end batch of a long prompt: one run, not a Python
        operation per block and layer)."""
        addresses: list[int] = []
        sizes: list[int] = []
        for part in self.parts:
            width = part.planned.block_bytes
            for first, length in runs:
                start = part.address(first)
                part.address(first + length - 1)
                addresses += range(start, start + length * width, width)
            sizes += [width] * (len(addresses) - len(sizes))
        return addresses, sizes


@attrs.frozen
class BlockSet:
    """Blocks a layer saves, with what every layer needs of them found once: their key
    prefixes (``StoreKeys.block_prefixes``) and their runs of consecutive ids."""

    refs: list[BlockRef]
    prefixes: list[str]
    runs: list[tuple[int, int]]

    @classmethod
    def of(cls, refs: list[BlockRef], keys: StoreKeys) -> BlockSet:
        return cls(refs=refs, prefixes=keys.block_prefixes([ref.name for ref in refs]),
                   runs=block_runs([ref.block_id for ref in refs]))

    def keys_in(self, buffer: LayerBuffer) -> list[str]:
        """``LayerBuffer.keys`` of these blocks, from their prefixes (the per-layer save path)."""
        return [prefix + suffix for suffix in buffer.suffixes for prefix in self.prefixes]

    def __len__(self) -> int:
        return len(self.refs)


EMPTY_BLOCKS = BlockSet(refs=[], prefixes=[], runs=[])


class LayerBuffers:
    """Every layer's buffer, in forward order, built from the live caches."""

    def __init__(self, layout: LayerLayout, kv_caches: Mapping[str, torch.Tensor]) -> None:
        check_aliasing(layout, kv_caches)
        self.in_order: tuple[LayerBuffer, ...] = tuple(
            _buffer_of(layer, kv_caches, layout.num_blocks) for layer in layout.layers)
        self.by_name = {buffer.layer.name: buffer for buffer in self.in_order}
        self.position = {buffer.layer.name: i for i, buffer in enumerate(self.in_order)}
        self._layer_of_cache = {name: layer.name
                                for name, layer in layout.by_cache_name().items()}
        self.start = min(part.pointer for b in self.in_order for part in b.parts)
        """The lowest address of the caches (their registration with the store starts there)."""

    def slot_key(self, cache_name: str) -> SlotKey:
        """The slot of the layer owning ``cache_name`` (a layer's main KV or indexer cache)."""
        return self.by_name[self._layer_of_cache.get(cache_name, cache_name)].slot

    def last_of_each_slot(self) -> frozenset[str]:
        """The last layer in the forward of each buffer (no later layer of a step reuses it)."""
        last: dict[SlotKey, str] = {}
        for buffer in self.in_order:
            last[buffer.slot] = buffer.layer.name
        return frozenset(last.values())

    @property
    def widest_block_bytes(self) -> int:
        return max(buffer.block_bytes for buffer in self.in_order)


def _buffer_of(layer: PlannedLayer, kv_caches: Mapping[str, torch.Tensor],
               num_blocks: int) -> LayerBuffer:
    parts = tuple(CachePart(planned=part, tensor=kv_caches[part.cache_name],
                            pointer=kv_caches[part.cache_name].data_ptr(),
                            rows=block_rows(kv_caches[part.cache_name], part.block_bytes),
                            num_blocks=num_blocks)
                  for part in layer.parts)
    return LayerBuffer(layer=layer, parts=parts, slot=(parts[0].pointer,),
                       block_bytes=sum(part.block_bytes for part in layer.parts),
                       suffixes=tuple(layer_suffix(layer.index, part.planned.part)
                                      for part in parts))
