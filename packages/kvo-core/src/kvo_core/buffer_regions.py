"""Byte placement of a layer buffer plan: where each slot's caches live in one allocation.

A slot of :mod:`kvo_core.buffer_plan` holds every cache of the layers that take turns in it:
the main KV and, for sparse (DSA) layers, the indexer keys and (C8) their scales. The indexer
follows its main layer's slot, so a slot's regions are laid out together: slot 0's main KV,
its indexer, its scale, then slot 1's, and so on. Each region holds ``num_blocks`` pages of
its part (vLLM allocates the same number of blocks for every cache of a KV-cache group) and
starts at a multiple of ``alignment`` bytes, so a region can be viewed as any element type.

Part names are the ones the layerwise connector puts in its store keys: ``kv`` (main KV),
``idx`` (indexer keys), ``scale`` (indexer scales).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

import attrs

from kvo_core.buffer_plan import LayerBufferPlan, Layout
from kvo_core.errors import ConfigError, PlanError

MAIN_PART = "kv"
INDEXER_PART = "idx"
SCALE_PART = "scale"
PART_NAMES = (MAIN_PART, INDEXER_PART, SCALE_PART)
"""In the order of :data:`kvo_core.buffer_plan.Layout` (main, indexer, indexer scale)."""
DEFAULT_ALIGNMENT = 64


def layout_parts(layout: Layout) -> tuple[str, ...]:
    """The part names a layer with this layout stores (main KV first)."""
    return tuple(name for name, spec in zip(PART_NAMES, layout, strict=True) if spec is not None)


@attrs.frozen
class PartRegion:
    """One part of one slot: ``num_blocks`` pages of ``block_bytes`` from ``offset``."""

    slot_id: int
    part: str
    offset: int
    block_bytes: int
    num_blocks: int

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.num_blocks

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _as_regions(regions: Iterable[PartRegion]) -> tuple[PartRegion, ...]:
    return tuple(regions)


@attrs.frozen
class BufferRegions:
    """Every slot's part regions in one allocation of ``total_bytes`` (see the module doc)."""

    regions: tuple[PartRegion, ...] = attrs.field(converter=_as_regions)
    total_bytes: int
    logical_bytes: int
    """What the same caches take when every layer owns its storage (no reuse, no padding)."""
    _by_key: Mapping[tuple[int, str], PartRegion] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        by_key = {(region.slot_id, region.part): region for region in self.regions}
        if len(by_key) != len(self.regions):
            raise PlanError("two regions claim the same slot and part")
        ordered = sorted(self.regions, key=lambda region: region.offset)
        for before, after in itertools.pairwise(ordered):
            if after.offset < before.end:
                raise PlanError(f"regions overlap: slot {before.slot_id} {before.part} ends at "
                                f"{before.end}, slot {after.slot_id} {after.part} starts at "
                                f"{after.offset}")
        if ordered and ordered[-1].end > self.total_bytes:
            raise PlanError(f"regions end at {ordered[-1].end} bytes, past the allocation of "
                            f"{self.total_bytes}")
        object.__setattr__(self, "_by_key", by_key)

    def region(self, slot_id: int, part: str) -> PartRegion:
        try:
            return self._by_key[(slot_id, part)]
        except KeyError:
            raise PlanError(f"slot {slot_id} has no {part!r} region; it has "
                            f"{sorted(p for s, p in self._by_key if s == slot_id)}") from None

    @property
    def footprint_ratio(self) -> float:
        """Physical over logical bytes of every part (main KV and indexer together)."""
        return self.total_bytes / self.logical_bytes


def place_regions(plan: LayerBufferPlan, num_blocks: int,
                  alignment: int = DEFAULT_ALIGNMENT) -> BufferRegions:
    """Lay every slot's parts out in one allocation (slot by slot, main KV first)."""
    for name, value in (("num_blocks", num_blocks), ("alignment", alignment)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    regions: list[PartRegion] = []
    offset = 0
    logical = 0
    for slot in plan.slots:
        for part, spec in zip(PART_NAMES, slot.layout, strict=True):
            if spec is None:
                continue
            offset = -(-offset // alignment) * alignment
            region = PartRegion(slot_id=slot.slot_id, part=part, offset=offset,
                                block_bytes=spec.bytes_per_block, num_blocks=num_blocks)
            regions.append(region)
            offset = region.end
            logical += region.nbytes * len(slot.layers)
    return BufferRegions(regions=regions, total_bytes=offset, logical_bytes=logical)
