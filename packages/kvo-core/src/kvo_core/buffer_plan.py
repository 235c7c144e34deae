"""Layerwise buffer plan: which logical layers share one physical device buffer during prefill.

During layerwise prefill offload a layer's KV only has to live on the device from the moment
attention writes it until its save (and every remote read) has finished, so most layers can
take turns in a few physical buffers. This module decides that assignment from the layer specs
alone; it allocates nothing. The vLLM glue applies the plan by aliasing every layer's cache
tensors to those of :meth:`LayerBufferPlan.storage_owner` and by gating each reuse on
:meth:`LayerBufferPlan.predecessor` (see ``kvo_core.gates``).

Rules (docs/design.md section 4):

- Independent layers keep a buffer of their own. By default layer 0 (it is written before the
  pipeline has anything to overlap with); ``"all"`` gives every layer its own buffer (no reuse).
- The other layers are grouped by identical :attr:`LayerSpec.layout` (main KV, indexer and
  indexer scale together: the indexer cache follows its main layer, so two layers may alias only
  when every one of their caches has the same size). Incompatible layouts never share.
- A group of ``n`` layers gets ``nb = min(shared_buffers, n)`` slots; slot ``i`` holds
  ``group[i::nb]`` (round robin over the group in ascending layer index order).

Layer indices need not be contiguous (e.g. only some layers carry a cache). Non-negative
``independent_layers`` entries are layer indices (:attr:`LayerSpec.index`); negative entries
count from the end of the plan's layers sorted by index (``-1`` is the highest index).
MTP layers are ordinary layers here, with indices after the base model's layers.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import attrs

from kvo_core.errors import ConfigError, PlanError
from kvo_core.specs import CacheSpec, LayerSpec

Layout = tuple[CacheSpec, CacheSpec | None, CacheSpec | None]
"""A layer's caches (main KV, indexer, indexer scale); equal layouts may share storage."""


@attrs.frozen
class BufferSlot:
    """One physical device buffer and the layers that take turns in it (ascending order)."""

    slot_id: int
    layout: Layout
    layers: tuple[int, ...]

    @property
    def owner(self) -> int:
        """The first layer of the slot: its tensors are allocated, the others alias them."""
        return self.layers[0]

    @property
    def main_bytes_per_block(self) -> int:
        return self.layout[0].bytes_per_block

    @property
    def bytes_per_block(self) -> int:
        """Bytes per block of every cache in the slot (main KV plus indexer, where present)."""
        return sum(part.bytes_per_block for part in self.layout if part is not None)


def _as_slots(slots: Iterable[BufferSlot]) -> tuple[BufferSlot, ...]:
    return tuple(slots)


def _as_frozenset(indices: Iterable[int]) -> frozenset[int]:
    return frozenset(indices)


def _check_slots(instance: LayerBufferPlan, attribute: object,
                 slots: tuple[BufferSlot, ...]) -> None:
    if not slots:
        raise PlanError("a layer buffer plan needs at least one slot")
    for position, slot in enumerate(slots):
        if slot.slot_id != position:
            raise PlanError(f"slot ids must be 0..{len(slots) - 1} in order; slot at position "
                            f"{position} has id {slot.slot_id}")
        if not slot.layers or list(slot.layers) != sorted(set(slot.layers)):
            raise PlanError(f"slot {slot.slot_id} must list distinct layers in ascending order, "
                            f"got {slot.layers}")


@attrs.frozen
class LayerBufferPlan:
    """The immutable result of :func:`plan_layer_buffers`; every layer is in exactly one slot."""

    slots: tuple[BufferSlot, ...] = attrs.field(converter=_as_slots, validator=_check_slots)
    num_layers: int
    independent: frozenset[int] = attrs.field(converter=_as_frozenset, default=frozenset())
    _slot_by_layer: Mapping[int, int] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        slot_by_layer: dict[int, int] = {}
        for slot in self.slots:
            for layer in slot.layers:
                if layer in slot_by_layer:
                    raise PlanError(f"layer {layer} is in slot {slot_by_layer[layer]} and in "
                                    f"slot {slot.slot_id}; every layer needs exactly one slot")
                slot_by_layer[layer] = slot.slot_id
        if len(slot_by_layer) != self.num_layers:
            raise PlanError(f"the slots hold {len(slot_by_layer)} layers but num_layers is "
                            f"{self.num_layers}")
        for layer in self.independent:
            if layer not in slot_by_layer or len(self.slots[slot_by_layer[layer]].layers) != 1:
                raise PlanError(f"independent layer {layer} must have a slot of its own")
        object.__setattr__(self, "_slot_by_layer", types.MappingProxyType(slot_by_layer))

    # -- lookups the vLLM glue needs ------------------------------------------------------

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """Every planned layer index, ascending."""
        return tuple(sorted(self._slot_by_layer))

    def slot_of(self, layer_index: int) -> int:
        """The id of the slot holding ``layer_index``."""
        try:
            return self._slot_by_layer[layer_index]
        except KeyError:
            raise PlanError(
                f"layer {layer_index!r} is not in this buffer plan; planned layers: "
                f"{_describe_indices(self.layer_indices)}") from None

    def slot_for(self, layer_index: int) -> BufferSlot:
        return self.slots[self.slot_of(layer_index)]

    def storage_owner(self, layer_index: int) -> int:
        """The layer whose tensors ``layer_index`` uses (itself when it owns its slot)."""
        return self.slot_for(layer_index).owner

    def layers_sharing(self, layer_index: int) -> tuple[int, ...]:
        """All layers in the slot of ``layer_index`` (including itself), ascending."""
        return self.slot_for(layer_index).layers

    def predecessor(self, layer_index: int) -> int | None:
        """The previous layer in the same slot, or None for a slot's first layer.

        Before ``layer_index`` may write its slot, the predecessor's save and every remote
        read of it must have finished.
        """
        layers = self.slot_for(layer_index).layers
        position = layers.index(layer_index)
        return layers[position - 1] if position > 0 else None

    def is_reused(self, layer_index: int) -> bool:
        """True when ``layer_index`` writes into storage an earlier layer used."""
        return self.predecessor(layer_index) is not None

    # -- footprint ------------------------------------------------------------------------

    @property
    def physical_buffers(self) -> int:
        return len(self.slots)

    @property
    def footprint_ratio(self) -> float:
        """Physical over logical main-KV bytes (indexer caches not counted).

        Assumes every layer holds the same number of blocks, as vLLM allocates them.
        For a uniform layout this is ``physical_buffers / num_layers``.
        """
        physical = sum(slot.main_bytes_per_block for slot in self.slots)
        logical = sum(slot.main_bytes_per_block * len(slot.layers) for slot in self.slots)
        return physical / logical


def plan_layer_buffers(
    layers: Sequence[LayerSpec],
    shared_buffers: int,
    independent_layers: Sequence[int] | Literal["all"] = (0,),
) -> LayerBufferPlan:
    """Assign every layer to a physical buffer slot (rules in the module docstring).

    Raises ConfigError for a bad ``shared_buffers`` or ``independent_layers`` value and
    PlanError for a bad layer list (empty, not LayerSpecs, duplicate indices or names).
    """
    _check_shared_buffers(shared_buffers)
    ordered = _check_layers(layers)
    independent = _resolve_independent(independent_layers, ordered)

    groups: dict[Layout, list[int]] = {}
    for spec in ordered:
        if spec.index not in independent:
            groups.setdefault(spec.layout, []).append(spec.index)

    slot_members: list[tuple[Layout, tuple[int, ...]]] = [
        (spec.layout, (spec.index,)) for spec in ordered if spec.index in independent]
    for layout, group in groups.items():
        nb = min(shared_buffers, len(group))
        slot_members.extend((layout, tuple(group[i::nb])) for i in range(nb))
    slot_members.sort(key=lambda member: member[1][0])

    slots = tuple(BufferSlot(slot_id=i, layout=layout, layers=members)
                  for i, (layout, members) in enumerate(slot_members))
    return LayerBufferPlan(slots=slots, num_layers=len(ordered), independent=independent)


def _check_shared_buffers(shared_buffers: int) -> None:
    if (not isinstance(shared_buffers, int) or isinstance(shared_buffers, bool)
            or shared_buffers < 1):
        raise ConfigError(
            f"shared_buffers must be an integer >= 1, got {shared_buffers!r}")


def _check_layers(layers: Sequence[LayerSpec]) -> list[LayerSpec]:
    """The layers sorted by index, after checking they can be planned at all."""
    layers = list(layers)
    if not layers:
        raise PlanError("cannot plan buffers for an empty layer list")
    by_index: dict[int, LayerSpec] = {}
    by_name: dict[str, LayerSpec] = {}
    for spec in layers:
        if not isinstance(spec, LayerSpec):
            raise PlanError(f"layers must be LayerSpec objects, got {spec!r}")
        if spec.index in by_index:
            raise PlanError(f"layers {by_index[spec.index].name!r} and {spec.name!r} both "
                            f"have index {spec.index}; layer indices must be distinct")
        if spec.name in by_name:
            raise PlanError(f"layers {spec.index} and {by_name[spec.name].index} are both "
                            f"named {spec.name!r}; layer names must be distinct")
        by_index[spec.index] = spec
        by_name[spec.name] = spec
    return sorted(layers, key=lambda spec: spec.index)


def _resolve_independent(independent_layers: Sequence[int] | Literal["all"],
                         ordered: list[LayerSpec]) -> frozenset[int]:
    """Independent layer indices, with negative entries counted from the end of ``ordered``."""
    indices = [spec.index for spec in ordered]
    if isinstance(independent_layers, str):
        if independent_layers == "all":
            return frozenset(indices)
        raise ConfigError(f"independent_layers must be a list of layer indices or 'all', "
                          f"got {independent_layers!r}")
    try:
        values = list(independent_layers)
    except TypeError:
        raise ConfigError(f"independent_layers must be a list of layer indices or 'all', "
                          f"got {independent_layers!r}") from None

    allowed = (f"allowed: the layer indices {_describe_indices(tuple(indices))} or "
               f"-1..-{len(indices)} counting from the end")
    known = set(indices)
    resolved: dict[int, int] = {}
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"independent_layers entries must be integers, got {value!r}")
        if value < 0:
            if value < -len(indices):
                raise ConfigError(f"independent_layers entry {value} is out of range; {allowed}")
            index = indices[value]
        elif value in known:
            index = value
        else:
            raise ConfigError(f"independent_layers entry {value} is not a planned layer; "
                              f"{allowed}")
        if index in resolved:
            raise ConfigError(f"independent_layers entries {resolved[index]} and {value} both "
                              f"name layer {index}; list each layer once")
        resolved[index] = value
    return frozenset(resolved)


def _describe_indices(indices: tuple[int, ...]) -> str:
    """``0..59`` for a contiguous run, else the list (shortened when long)."""
    if not indices:
        return "(none)"
    if list(indices) == list(range(indices[0], indices[0] + len(indices))):
        return f"{indices[0]}..{indices[-1]}"
    if len(indices) <= 12:
        return "[" + ", ".join(map(str, indices)) + "]"
    head = ", ".join(map(str, indices[:10]))
    return f"[{head}, ... {indices[-1]}] ({len(indices)} layers)"
