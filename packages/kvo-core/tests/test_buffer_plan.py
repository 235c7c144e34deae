"""Layerwise buffer plan: round-robin slots, independent layers, predecessors, errors."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvo_core.buffer_plan import BufferSlot, LayerBufferPlan, plan_layer_buffers
from kvo_core.errors import ConfigError, PlanError
from kvo_core.layers import layer_index
from kvo_core.specs import CacheSpec, LayerSpec

MLA = CacheSpec(block_size=64, token_shape=(1, 656), dtype=torch.uint8)
MLA_BF16 = CacheSpec(block_size=64, token_shape=(1, 576), dtype=torch.bfloat16)
DENSE = CacheSpec(block_size=16, token_shape=(2, 8, 128), dtype=torch.bfloat16)
INDEXER = CacheSpec(block_size=64, token_shape=(128,), dtype=torch.int8)
SCALE = CacheSpec(block_size=64, token_shape=(1,), dtype=torch.float16)


def layer(index: int, main: CacheSpec = MLA, indexer: CacheSpec | None = None,
          scale: CacheSpec | None = None) -> LayerSpec:
    return LayerSpec(f"model.layers.{index}.self_attn.attn", index, main, indexer, scale)


def uniform(n: int, main: CacheSpec = MLA) -> list[LayerSpec]:
    return [layer(i, main) for i in range(n)]


def slot_layers(plan: LayerBufferPlan) -> list[tuple[int, ...]]:
    return [slot.layers for slot in plan.slots]


# -- worked examples ----------------------------------------------------------------------


def test_default_plan_round_robins_after_layer_zero() -> None:
    plan = plan_layer_buffers(uniform(8), shared_buffers=2)
    assert slot_layers(plan) == [(0,), (1, 3, 5, 7), (2, 4, 6)]
    assert [slot.slot_id for slot in plan.slots] == [0, 1, 2]
    assert plan.num_layers == 8
    assert plan.independent == frozenset({0})
    assert plan.physical_buffers == 3
    assert plan.footprint_ratio == pytest.approx(3 / 8)
    assert [plan.slot_of(i) for i in range(8)] == [0, 1, 2, 1, 2, 1, 2, 1]
    assert [plan.predecessor(i) for i in range(8)] == [None, None, None, 1, 2, 3, 4, 5]
    assert [plan.storage_owner(i) for i in range(8)] == [0, 1, 2, 1, 2, 1, 2, 1]
    assert plan.layers_sharing(5) == (1, 3, 5, 7)
    assert plan.is_reused(3) and not plan.is_reused(1) and not plan.is_reused(0)
    assert plan.layer_indices == tuple(range(8))


def test_layer_order_of_the_input_does_not_matter() -> None:
    shuffled = [layer(i) for i in (5, 0, 7, 2, 1, 6, 3, 4)]
    assert plan_layer_buffers(shuffled, 3) == plan_layer_buffers(uniform(8), 3)


def test_negative_independent_layers_count_from_the_end() -> None:
    plan = plan_layer_buffers(uniform(6), shared_buffers=2, independent_layers=[0, -1])
    assert plan.independent == frozenset({0, 5})
    assert slot_layers(plan) == [(0,), (1, 3), (2, 4), (5,)]
    assert plan.physical_buffers == 4


def test_all_independent_disables_reuse() -> None:
    plan = plan_layer_buffers(uniform(5), shared_buffers=2, independent_layers="all")
    assert slot_layers(plan) == [(i,) for i in range(5)]
    assert plan.physical_buffers == 5
    assert plan.footprint_ratio == 1.0
    assert all(plan.predecessor(i) is None for i in range(5))


def test_no_independent_layers() -> None:
    plan = plan_layer_buffers(uniform(4), shared_buffers=1, independent_layers=())
    assert slot_layers(plan) == [(0, 1, 2, 3)]
    assert plan.footprint_ratio == pytest.approx(1 / 4)


def test_more_buffers_than_layers_gives_each_layer_its_own() -> None:
    plan = plan_layer_buffers(uniform(4), shared_buffers=10)
    assert slot_layers(plan) == [(0,), (1,), (2,), (3,)]
    assert plan.physical_buffers == 4


def test_incompatible_layouts_never_share() -> None:
    # Layers 0-2 dense MLA without an indexer, the rest with an indexer (a DeepSeek-V3.2-like
    # mix): an indexer layer may not alias storage of a layer that has no indexer cache.
    layers = [layer(i) for i in range(3)] + [layer(i, MLA, INDEXER, SCALE) for i in range(3, 9)]
    plan = plan_layer_buffers(layers, shared_buffers=2)
    assert slot_layers(plan) == [(0,), (1,), (2,), (3, 5, 7), (4, 6, 8)]
    assert plan.slot_for(1).layout == (MLA, None, None)
    assert plan.slot_for(5).layout == (MLA, INDEXER, SCALE)
    assert plan.slot_for(5).bytes_per_block == 64 * (656 + 128 + 2)
    assert plan.slot_for(5).main_bytes_per_block == 64 * 656
    # main KV only: 5 physical of 9 logical, all with the same main-KV spec
    assert plan.footprint_ratio == pytest.approx(5 / 9)


def test_footprint_ratio_weights_by_main_kv_bytes() -> None:
    small = CacheSpec(block_size=64, token_shape=(100,), dtype=torch.uint8)
    big = CacheSpec(block_size=64, token_shape=(300,), dtype=torch.uint8)
    layers = [layer(0, small), layer(1, big), layer(2, small), layer(3, big), layer(4, big)]
    plan = plan_layer_buffers(layers, shared_buffers=1)
    assert slot_layers(plan) == [(0,), (1, 3, 4), (2,)]
    physical = 64 * (100 + 300 + 100)
    logical = 64 * (2 * 100 + 3 * 300)
    assert plan.footprint_ratio == pytest.approx(physical / logical)


def test_mtp_layers_join_the_plan_after_the_base_layers() -> None:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    names.append("model.mtp.layers.0.self_attn.attn")
    layers = [LayerSpec(n, layer_index(n, num_base_layers=4), MLA) for n in names]
    plan = plan_layer_buffers(layers, shared_buffers=2)
    assert slot_layers(plan) == [(0,), (1, 3), (2, 4)]
    assert plan.predecessor(4) == 2


def test_non_contiguous_indices() -> None:
    layers = [layer(i) for i in (0, 2, 5, 9, 11)]
    plan = plan_layer_buffers(layers, shared_buffers=2, independent_layers=[-1])
    assert plan.independent == frozenset({11})
    assert slot_layers(plan) == [(0, 5), (2, 9), (11,)]
    with pytest.raises(ConfigError, match=r"entry 3 is not a planned layer.*\[0, 2, 5, 9, 11\]"):
        plan_layer_buffers(layers, 2, independent_layers=[3])


def test_plan_is_immutable_and_hashable() -> None:
    plan = plan_layer_buffers(uniform(4), 2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.num_layers = 3  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.slots[0].layers = (1,)  # type: ignore[misc]
    assert hash(plan) == hash(plan_layer_buffers(uniform(4), 2))


# -- errors --------------------------------------------------------------------------------


def test_empty_layer_list() -> None:
    with pytest.raises(PlanError, match="empty layer list"):
        plan_layer_buffers([], 2)


def test_duplicate_layer_index() -> None:
    layers = [layer(0), LayerSpec("model.mtp.layers.0.attn", 0, MLA)]
    with pytest.raises(PlanError, match="both have index 0"):
        plan_layer_buffers(layers, 2)


def test_duplicate_layer_name() -> None:
    layers = [layer(0), LayerSpec("model.layers.0.self_attn.attn", 1, MLA)]
    with pytest.raises(PlanError, match=r"both named 'model\.layers\.0\.self_attn\.attn'"):
        plan_layer_buffers(layers, 2)


def test_not_a_layer_spec() -> None:
    with pytest.raises(PlanError, match=r"must be LayerSpec objects, got 'layers\.0'"):
        plan_layer_buffers(["layers.0"], 2)  # type: ignore[list-item]


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2", None])
def test_bad_shared_buffers(value: object) -> None:
    with pytest.raises(ConfigError, match=f"shared_buffers must be an integer >= 1, got {value!r}"):
        plan_layer_buffers(uniform(4), value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("independent", "message"),
    [
        ([4], r"entry 4 is not a planned layer; allowed: the layer indices 0\.\.3 or -1\.\.-4"),
        ([-5], r"entry -5 is out of range; allowed: the layer indices 0\.\.3 or -1\.\.-4"),
        ([1, 1], "entries 1 and 1 both name layer 1"),
        ([0, -4], "entries 0 and -4 both name layer 0"),
        ([True], "entries must be integers, got True"),
        ([0.0], "entries must be integers, got 0.0"),
        ("none", "must be a list of layer indices or 'all', got 'none'"),
        (7, "must be a list of layer indices or 'all', got 7"),
    ],
)
def test_bad_independent_layers(independent: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_layer_buffers(uniform(4), 2, independent)  # type: ignore[arg-type]


def test_unknown_layer_lookup() -> None:
    plan = plan_layer_buffers(uniform(4), 2)
    with pytest.raises(PlanError,
                       match=r"layer 7 is not in this buffer plan; planned layers: 0\.\.3"):
        plan.slot_of(7)
    with pytest.raises(PlanError, match="layer 7"):
        plan.predecessor(7)


def test_direct_construction_is_checked() -> None:
    layout = (MLA, None, None)
    with pytest.raises(PlanError, match="layer 1 is in slot 0 and in slot 1"):
        LayerBufferPlan((BufferSlot(0, layout, (0, 1)), BufferSlot(1, layout, (1,))), 2)
    with pytest.raises(PlanError, match="slot at position 0 has id 3"):
        LayerBufferPlan((BufferSlot(3, layout, (0,)),), 1)
    with pytest.raises(PlanError, match="hold 1 layers but num_layers is 2"):
        LayerBufferPlan((BufferSlot(0, layout, (0,)),), 2)
    with pytest.raises(PlanError, match="distinct layers in ascending order"):
        LayerBufferPlan((BufferSlot(0, layout, (1, 0)),), 2)
    with pytest.raises(PlanError, match="independent layer 1 must have a slot of its own"):
        LayerBufferPlan((BufferSlot(0, layout, (0, 1)),), 2, frozenset({1}))
    with pytest.raises(PlanError, match="at least one slot"):
        LayerBufferPlan((), 0)


# -- properties ----------------------------------------------------------------------------

LAYOUTS = [(MLA, None, None), (MLA, INDEXER, SCALE), (MLA_BF16, None, None), (DENSE, None, None)]


@st.composite
def layer_lists(draw: st.DrawFn, max_layouts: int = len(LAYOUTS)) -> list[LayerSpec]:
    indices = draw(st.lists(st.integers(0, 200), min_size=1, max_size=40, unique=True))
    kinds = draw(st.lists(st.integers(0, max_layouts - 1), min_size=len(indices),
                          max_size=len(indices)))
    return [layer(i, *LAYOUTS[k]) for i, k in zip(indices, kinds, strict=True)]


@st.composite
def independent_choices(draw: st.DrawFn, layers: Sequence[LayerSpec]) -> list[int]:
    """A few independent layers, each written either as its index or counted from the end."""
    ordered = sorted(spec.index for spec in layers)
    positions = draw(st.lists(st.integers(0, len(ordered) - 1), max_size=4, unique=True))
    return [ordered[p] if draw(st.booleans()) else p - len(ordered) for p in positions]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), layers=layer_lists(), shared_buffers=st.integers(1, 6))
def test_plan_invariants(data: st.DataObject, layers: list[LayerSpec], shared_buffers: int) -> None:
    independent_values = data.draw(independent_choices(layers))
    plan = plan_layer_buffers(layers, shared_buffers, independent_values)
    by_index = {spec.index: spec for spec in layers}
    ordered = sorted(by_index)

    # every layer has exactly one slot
    placed = [i for slot in plan.slots for i in slot.layers]
    assert sorted(placed) == ordered
    assert plan.num_layers == len(layers)

    # only identical layouts share; independent layers are alone
    for slot in plan.slots:
        assert {by_index[i].layout for i in slot.layers} == {slot.layout}
    expected_independent = {ordered[v] if v < 0 else v for v in independent_values}
    assert plan.independent == expected_independent
    for i in expected_independent:
        assert plan.layers_sharing(i) == (i,)

    # each layout group is dealt round robin over min(B, len(group)) slots
    groups: dict[object, list[int]] = {}
    for i in ordered:
        if i not in expected_independent:
            groups.setdefault(by_index[i].layout, []).append(i)
    shared = {slot.layers for slot in plan.slots
              if not (len(slot.layers) == 1 and slot.layers[0] in expected_independent)}
    expected_shared = set()
    for group in groups.values():
        nb = min(shared_buffers, len(group))
        expected_shared |= {tuple(group[k::nb]) for k in range(nb)}
    assert shared == expected_shared

    # predecessor chains walk each slot backwards and cover it; owner is the slot's first layer
    for slot in plan.slots:
        chain = [slot.layers[-1]]
        while (previous := plan.predecessor(chain[-1])) is not None:
            assert previous < chain[-1]
            chain.append(previous)
        assert chain[::-1] == list(slot.layers)
        assert all(plan.storage_owner(i) == slot.layers[0] for i in slot.layers)
        assert all(plan.slot_of(i) == slot.slot_id for i in slot.layers)

    # slots are numbered in order of their first layer
    firsts = [slot.layers[0] for slot in plan.slots]
    assert firsts == sorted(firsts)
    assert 0 < plan.footprint_ratio <= 1


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 100), shared_buffers=st.integers(1, 8), data=st.data())
def test_physical_buffer_formula_for_uniform_layouts(n: int, shared_buffers: int,
                                                     data: st.DataObject) -> None:
    layers = uniform(n, DENSE)
    independent = data.draw(independent_choices(layers))
    plan = plan_layer_buffers(layers, shared_buffers, independent)
    i = len(independent)
    assert plan.physical_buffers == i + min(shared_buffers, n - i)
    assert plan.footprint_ratio == pytest.approx(plan.physical_buffers / n)
