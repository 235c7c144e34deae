"""Residency (docs/design.md section 6): hand-worked rule cases, invariants, reference ==
vectorised.

Hand cases run against both implementations; hypothesis drives random multi-step traces through
both and checks they agree slot for slot (outputs and full state) and that the invariants hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvo_core.errors import KvoError
from kvo_core.residency import (
    ReferenceResidency,
    RequestState,
    ResidencyInputError,
    ResidencyOverflowError,
    ResidencyResult,
    ResidencyTable,
    belady_min_misses,
)

STEADY = int(RequestState.STEADY)
FIRST = int(RequestState.FIRST_OFFLOAD)
NOT_OFFLOADED = int(RequestState.NOT_OFFLOADED)
IMPLEMENTATIONS = [ReferenceResidency, ResidencyTable]
RESULT_FIELDS = ("slots", "miss_counts", "miss_tokens", "miss_slots")
BIG = 1 << 19


def t64(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def step(table: Any, topk: Sequence[Sequence[int]], requests: Sequence[int],
         stable: Sequence[int] | None = None, states: Sequence[int] | None = None,
         seq_lens: Sequence[int] | None = None) -> ResidencyResult:
    rows = len(topk)
    result: ResidencyResult = table.update(
        t64(topk), t64(requests), t64(stable if stable is not None else [BIG] * rows),
        None if states is None else t64(states),
        seq_lens=None if seq_lens is None else t64(seq_lens))
    return result


def misses(result: ResidencyResult, row: int = 0) -> tuple[list[int], list[int]]:
    n = int(result.miss_counts[row])
    tokens = result.miss_tokens[row].tolist()
    slots = result.miss_slots[row].tolist()
    assert tokens[n:] == [-1] * (len(tokens) - n) and slots[n:] == [-1] * (len(slots) - n)
    return tokens[:n], slots[:n]


impl = pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)


# --------------------------------------------------------------------------- hand-worked rules


@impl
def test_fresh_row_fills_slots_in_lru_order_with_padding_and_duplicates(cls: Any) -> None:
    table = cls(1, 4)
    result = step(table, [[5, 3, -1, 5, 7]], [1])
    assert result.slots.tolist() == [[0, 1, -1, 0, 2]]
    assert misses(result) == ([5, 3, 7], [0, 1, 2])
    assert table.slot_tokens.tolist() == [[5, 3, 7, -1]]
    # Unused evictable slot 3 stays least recent, then the fills in miss order.
    assert table.lru_order.tolist() == [[3, 0, 1, 2]]
    assert table.row_requests.tolist() == [1]


@impl
def test_hits_keep_their_slot_and_misses_evict_least_recent_first(cls: Any) -> None:
    table = cls(1, 4)
    step(table, [[5, 3, -1, 5, 7]], [1])
    result = step(table, [[7, 9, 4, -1, -1]], [1])
    # 7 hits in slot 2; 9 and 4 take the evictable slots in LRU order [3, 0, 1]: 3 then 0.
    assert result.slots.tolist() == [[2, 3, 0, -1, -1]]
    assert misses(result) == ([9, 4], [3, 0])
    assert table.slot_tokens.tolist() == [[4, 3, 7, 9]]
    # [unused evictable: 1] + [filled: 3, 0] + [hits: 2]
    assert table.lru_order.tolist() == [[1, 3, 0, 2]]


@impl
def test_speculative_suffix_is_dropped_and_its_slot_keeps_its_lru_place(cls: Any) -> None:
    table = cls(1, 4)
    step(table, [[5, 3, -1, 5, 7]], [1])
    step(table, [[7, 9, 4, -1, -1]], [1])  # slots [4, 3, 7, 9], LRU [1, 3, 0, 2]
    # Stable length 8: token 9 (slot 3) may have been overwritten, so it is forgotten. The
    # re-selected 9 is a miss and takes the least recent evictable slot (1, evicting 3), not
    # the now empty slot 3: empty slots are evictable in LRU order like any other.
    result = step(table, [[9, 4]], [1], stable=[8])
    assert result.slots.tolist() == [[1, 0]]
    assert misses(result) == ([9], [1])
    assert table.slot_tokens.tolist() == [[4, 9, 7, -1]]
    assert table.lru_order.tolist() == [[3, 2, 1, 0]]


@impl
def test_tokens_below_the_stable_length_stay_resident(cls: Any) -> None:
    table = cls(1, 3)
    step(table, [[0, 1, 2]], [4])
    result = step(table, [[2, 1, 0]], [4], stable=[3])
    assert result.miss_counts.tolist() == [0]
    assert result.slots.tolist() == [[2, 1, 0]]


@impl
def test_request_change_resets_the_row(cls: Any) -> None:
    table = cls(1, 4)
    step(table, [[5, 3, 7]], [1])
    result = step(table, [[3, 8]], [2])
    # 3 was resident for request 1 only: a miss for request 2, laid out from an empty row.
    assert misses(result) == ([3, 8], [0, 1])
    assert table.slot_tokens.tolist() == [[3, 8, -1, -1]]
    assert table.lru_order.tolist() == [[2, 3, 0, 1]]
    assert table.row_requests.tolist() == [2]


@impl
def test_padding_negative_and_beyond_seq_len(cls: Any) -> None:
    table = cls(1, 4)
    result = step(table, [[-1, 6, -7, 2, 9]], [1], seq_lens=[7])
    # -1 and -7 are negative, 9 >= seq_len 7: all padding.
    assert result.slots.tolist() == [[-1, 0, -1, 1, -1]]
    assert misses(result) == ([6, 2], [0, 1])


@impl
def test_all_padding_row_changes_nothing(cls: Any) -> None:
    table = cls(1, 3)
    step(table, [[1, 2]], [1])
    before = (table.slot_tokens, table.lru_order)
    result = step(table, [[-1, -1]], [1])
    assert result.slots.tolist() == [[-1, -1]]
    assert result.miss_counts.tolist() == [0]
    assert torch.equal(table.slot_tokens, before[0]) and torch.equal(table.lru_order, before[1])


@impl
def test_duplicates_count_once_at_first_position(cls: Any) -> None:
    table = cls(1, 4)
    step(table, [[1]], [0])
    # MTP: two query rows [4, 1, 2] and [2, 4, 4] concatenated into one residency row.
    result = step(table, [[4, 1, 2, 2, 4, 4]], [0])
    assert misses(result) == ([4, 2], [1, 2])
    assert result.slots.tolist() == [[1, 0, 2, 2, 1, 1]]


@impl
def test_first_offload_lays_distinct_tokens_ascending(cls: Any) -> None:
    table = cls(1, 5)
    step(table, [[40, 41]], [7])  # some earlier state, same request
    result = step(table, [[9, 2, 7, 2, -1]], [7], states=[FIRST])
    assert misses(result) == ([2, 7, 9], [0, 1, 2])
    assert result.slots.tolist() == [[2, 0, 1, 0, -1]]
    assert table.slot_tokens.tolist() == [[2, 7, 9, -1, -1]]
    assert table.lru_order.tolist() == [[3, 4, 0, 1, 2]]
    assert table.row_requests.tolist() == [7]


@impl
def test_first_offload_equals_reset_then_steady_with_ascending_misses(cls: Any) -> None:
    first, steady = cls(1, 6), cls(1, 6)
    step(first, [[3, 4]], [1])
    first_result = step(first, [[5, 1, 3]], [1], states=[FIRST])
    # Same tokens presented in ascending order to a fresh row in STEADY give the same state.
    step(steady, [[1, 3, 5]], [1])
    assert torch.equal(first.slot_tokens, steady.slot_tokens)
    assert torch.equal(first.lru_order, steady.lru_order)
    assert first_result.slots.tolist() == [[2, 0, 1]]


@impl
def test_not_offloaded_is_identity_and_leaves_state_untouched(cls: Any) -> None:
    table = cls(2, 3)
    step(table, [[1, 2], [4, 5]], [10, 11])
    before = (table.slot_tokens, table.lru_order, table.row_requests)
    result = step(table, [[100, -1], [6, 4]], [99, 11], states=[NOT_OFFLOADED, STEADY],
                  seq_lens=[200, 200])
    assert result.slots[0].tolist() == [100, -1]  # identity, even beyond capacity
    assert result.miss_counts.tolist() == [0, 1]
    assert misses(result, 0) == ([], [])
    assert table.slot_tokens[0].tolist() == before[0][0].tolist()
    assert table.lru_order[0].tolist() == before[1][0].tolist()
    assert table.row_requests.tolist() == [10, 11]  # row 0 kept its request
    assert misses(result, 1) == ([6], [2])


@impl
def test_rows_are_independent(cls: Any) -> None:
    table = cls(2, 2)
    result = step(table, [[1, 2], [2, 3]], [1, 2])
    assert result.slots.tolist() == [[0, 1], [0, 1]]
    result = step(table, [[2, 5], [3, 2]], [1, 2])
    assert result.slots.tolist() == [[1, 0], [1, 0]]
    assert result.miss_counts.tolist() == [1, 0]


@impl
def test_overflow_raises_and_leaves_the_table_unchanged(cls: Any) -> None:
    table = cls(2, 3)
    step(table, [[1, 2, -1, -1], [5, 6, -1, -1]], [1, 2])
    before = (table.slot_tokens, table.lru_order, table.row_requests)
    with pytest.raises(ResidencyOverflowError, match="row 1 selects 4 distinct tokens"):
        step(table, [[1, 2, 2, 1], [7, 8, 9, 5]], [1, 3])
    assert torch.equal(table.slot_tokens, before[0])
    assert torch.equal(table.lru_order, before[1])
    assert torch.equal(table.row_requests, before[2])
    # The table still works and agrees with a reference that never saw the failed call.
    ref = ReferenceResidency(2, 3)
    step(ref, [[1, 2, -1, -1], [5, 6, -1, -1]], [1, 2])
    args = ([[2, 3, 4, -1], [6, 7, -1, 5]], [1, 2])
    assert_same(step(table, *args), step(ref, *args))
    assert_same_state(table, ref)


@impl
def test_overflow_counts_distinct_tokens_only(cls: Any) -> None:
    table = cls(1, 2)
    result = step(table, [[3, 3, 4, 4, -1, 3]], [0])
    assert result.miss_counts.tolist() == [2]
    assert issubclass(ResidencyOverflowError, KvoError)


@impl
def test_not_offloaded_rows_never_overflow(cls: Any) -> None:
    table = cls(1, 1)
    result = step(table, [[0, 1, 2]], [0], states=[NOT_OFFLOADED])
    assert result.slots.tolist() == [[0, 1, 2]]


@impl
def test_reset_row(cls: Any) -> None:
    table = cls(2, 2)
    step(table, [[1, 2], [3, 4]], [5, 6])
    table.reset_row(1)
    assert table.slot_tokens.tolist() == [[1, 2], [-1, -1]]
    assert table.lru_order.tolist()[1] == [0, 1]
    assert table.row_requests.tolist() == [5, -1]
    # The same request comes back: row 1 was forgotten, so everything misses again.
    result = step(table, [[1, 2], [3, 4]], [5, 6])
    assert result.miss_counts.tolist() == [0, 2]
    with pytest.raises(ResidencyInputError, match=r"row must be in \[0, 2\), got 2"):
        table.reset_row(2)


def test_load_row_restores_a_saved_state_exactly() -> None:
    original = ReferenceResidency(2, 4)
    step(original, [[5, 9, 2, -1], [1, 2, 3, 4]], [7, 8], states=[FIRST, FIRST])
    step(original, [[9, 11, 6, -1], [4, 3, 2, 1]], [7, 8])
    restored = ReferenceResidency(2, 4)
    restored.load_row(0, original.slot_tokens[0], original.lru_order[0], 7)
    restored.load_row(1, original.slot_tokens[1], original.lru_order[1], 8)
    want, got = (step(table, [[2, 13, 5, 9], [7, 1, -1, -1]], [7, 8])
                 for table in (original, restored))
    for field in RESULT_FIELDS:
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert torch.equal(restored.slot_tokens, original.slot_tokens)
    assert torch.equal(restored.lru_order, original.lru_order)
    assert torch.equal(restored.row_requests, original.row_requests)


@pytest.mark.parametrize(("tokens", "order", "match"), [
    ([1, 2, 3], [0, 1, 2, 3], r"slot_tokens must be a tensor of shape \[4\]"),
    ([1, 2, 3, 4], [0, 1, 2, 2], "permutation of the slot ids 0..3"),
    ([1, 2, 2, -1], [0, 1, 2, 3], "each at most once"),
    ([1, -5, 2, -1], [0, 1, 2, 3], "tokens >= 0"),
])
def test_load_row_refuses_a_state_the_rules_could_not_produce(tokens, order, match) -> None:
    table = ReferenceResidency(1, 4)
    with pytest.raises(ResidencyInputError, match=match):
        table.load_row(0, t64(tokens), t64(order), 0)
    assert table.slot_tokens.tolist() == [[-1] * 4]  # unchanged
    with pytest.raises(ResidencyInputError, match="row must be in"):
        table.load_row(1, t64([-1] * 4), t64([0, 1, 2, 3]), 0)


@impl
def test_non_contiguous_inputs(cls: Any) -> None:
    table = cls(2, 4)
    wide = t64([[5, 0, 3, 0, 5, 0], [7, 0, -1, 0, 8, 0]])
    result = table.update(wide[:, ::2], t64([1, 1, 2, 2])[::2], t64([9, 9, 9, 9])[::2])
    assert result.slots.tolist() == [[0, 1, 0], [0, -1, 1]]
    assert table.slot_tokens.tolist() == [[5, 3, -1, -1], [7, 8, -1, -1]]


@impl
def test_large_positions_grow_the_table(cls: Any) -> None:
    table = cls(1, 4, max_seq_len=300_000)
    step(table, [[5, 70_000]], [1])
    result = step(table, [[299_999, 70_000, 5]], [1])
    assert result.slots.tolist() == [[2, 1, 0]]
    assert table.slot_tokens.tolist() == [[5, 70_000, 299_999, -1]]


@impl
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(topk=t64([[1, 2], [3, 4]]).short()),
     "topk must have dtype torch.int32 or torch.int64, got torch.int16"),
    (dict(topk=[[1, 2]]), "topk must be a torch.Tensor, got list"),
    (dict(topk=t64([1, 2])), r"topk must have shape \[2, K\]"),
    (dict(topk=t64([[1, 2]])), r"topk must have shape \[2, K\].*got \[1, 2\]"),
    (dict(topk=torch.zeros((2, 0), dtype=torch.int64)), "at least one column"),
    (dict(request_ids=t64([1])), r"request_ids must have shape \[2\]"),
    (dict(stable_lens=t64([1, -1])), "stable_lens must be >= 0"),
    (dict(states=t64([-1, 0])), r"states must hold only \[-3, -2, -1\]"),
    (dict(states=t64([-1, -1]).float()), "states must have dtype torch.int64"),
    (dict(seq_lens=t64([4])), r"seq_lens must have shape \[2\]"),
    (dict(topk=t64([[1, 64], [2, 3]])), "token position 64, at or beyond max_seq_len=64"),
])
def test_bad_input_gets_a_clear_error_and_changes_nothing(cls: Any, kwargs: dict[str, Any],
                                                          message: str) -> None:
    table = cls(2, 4, max_seq_len=64)
    args: dict[str, Any] = dict(topk=t64([[1, 2], [3, 4]]), request_ids=t64([0, 0]),
                                stable_lens=t64([8, 8]), states=None)
    args.update(kwargs)
    with pytest.raises(ResidencyInputError, match=message):
        table.update(args["topk"], args["request_ids"], args["stable_lens"], args["states"],
                     seq_lens=args.get("seq_lens"))
    assert table.slot_tokens.tolist() == [[-1] * 4] * 2


def _buffers(rows: int, width: int) -> ResidencyResult:
    return ResidencyResult(slots=torch.full((rows, width), 7, dtype=torch.int32),
                           miss_counts=torch.full((rows,), 7, dtype=torch.int32),
                           miss_tokens=torch.full((rows, width), 7, dtype=torch.int32),
                           miss_slots=torch.full((rows, width), 7, dtype=torch.int32))


@impl
def test_out_buffers_receive_the_result_a_fresh_update_returns(cls: Any) -> None:
    fresh, into = cls(2, 6, max_seq_len=64), cls(2, 6, max_seq_len=64)
    out = _buffers(2, 5)
    calls = [([[1, 2, 3, -1, 2], [9, 8, 7, 6, 5]], [FIRST, NOT_OFFLOADED]),
             ([[4, 1, 5, 5, 63], [1, 2, 3, 4, 5]], [STEADY, FIRST]),
             ([[6, 7, 1, 2, -3], [5, 6, 1, 9, 8]], [STEADY, STEADY])]
    for topk, states in calls:
        args = (t64(topk), t64([0, 1]), t64([60, 60]), t64(states))
        expected = fresh.update(*args)
        assert into.update(*args, out=out) is out
        for name in RESULT_FIELDS:
            assert torch.equal(getattr(out, name), getattr(expected, name)), name
        assert torch.equal(into.slot_tokens, fresh.slot_tokens)
        assert torch.equal(into.lru_order, fresh.lru_order)


@impl
@pytest.mark.parametrize(("make", "message"), [
    (lambda b: "buffers", "out must be a ResidencyResult of buffers, got str"),
    (lambda b: ResidencyResult(b.slots, [0, 0], b.miss_tokens, b.miss_slots),
     "out.miss_counts must be a torch.Tensor, got list"),
    (lambda b: ResidencyResult(b.slots.long(), b.miss_counts, b.miss_tokens, b.miss_slots),
     r"out.slots must be int32 of shape \[2, 3\], got torch.int64"),
    (lambda b: ResidencyResult(b.slots, b.miss_counts, b.miss_tokens[:, :2], b.miss_slots),
     r"out.miss_tokens must be int32 of shape \[2, 3\], got torch.int32 \[2, 2\]"),
    (lambda b: ResidencyResult(b.slots, b.miss_counts, b.slots, b.miss_slots),
     "out.slots shares memory with out.miss_tokens"),
    (lambda b: ResidencyResult(b.slots, b.miss_slots[:, 0], b.miss_tokens, b.miss_slots),
     "out.miss_counts shares memory with out.miss_slots"),
])
def test_bad_out_buffers_are_refused_and_change_nothing(cls: Any, make: Any,
                                                        message: str) -> None:
    table = cls(2, 4, max_seq_len=64)
    step(table, [[1, 2, 3], [4, 5, 6]], [0, 0])
    before = table.slot_tokens, table.lru_order
    with pytest.raises(ResidencyInputError, match=message):
        table.update(t64([[7, 8, 9], [1, 2, 3]]), t64([0, 0]), t64([60, 60]),
                     out=make(_buffers(2, 3)))
    assert torch.equal(table.slot_tokens, before[0]) and torch.equal(table.lru_order, before[1])


@impl
def test_padding_beyond_seq_len_is_not_checked_against_max_seq_len(cls: Any) -> None:
    table = cls(1, 2, max_seq_len=64)
    result = step(table, [[1, 1000]], [0], seq_lens=[10])
    assert result.slots.tolist() == [[0, -1]]


@impl
@pytest.mark.parametrize(("rows", "capacity", "message"), [
    (0, 4, "rows must be an integer >= 1, got 0"),
    (1, 0, "capacity must be an integer >= 1, got 0"),
    (1, 2.5, "capacity must be an integer >= 1, got 2.5"),
    (True, 4, "rows must be an integer >= 1, got True"),
    (1, 2**20 + 1, r"capacity must be <= 2\*\*20 = 1048576 .* got 1048577"),
])
def test_bad_dimensions(cls: Any, rows: Any, capacity: Any, message: str) -> None:
    with pytest.raises(ResidencyInputError, match=message):
        cls(rows, capacity)


@impl
def test_max_seq_len_beyond_int32_results_is_refused(cls: Any) -> None:
    cls(1, 4, max_seq_len=2**31)
    with pytest.raises(ResidencyInputError,
                       match=r"max_seq_len must be <= 2\*\*31 = 2147483648 .*got 2147483649"):
        cls(1, 4, max_seq_len=2**31 + 1)


@impl
def test_int32_topk_gives_the_same_result_as_int64(cls: Any) -> None:
    wide, narrow = cls(2, 4, max_seq_len=2**31), cls(2, 4, max_seq_len=2**31)
    calls = [([[1, 2, 3], [2**31 - 1, -1, 5]], [FIRST, FIRST]),
             ([[4, 2, -7], [5, 6, 2**31 - 1]], [STEADY, STEADY]),
             ([[9, 8, 1], [7, 5, 6]], [STEADY, NOT_OFFLOADED])]
    for topk, states in calls:
        args = (t64([0, 1]), t64([2**31, 2**31]), t64(states))
        assert_same(wide.update(t64(topk), *args), narrow.update(t64(topk).int(), *args))
        assert torch.equal(wide.slot_tokens, narrow.slot_tokens)


# ------------------------------------------------------------------- random traces, invariants


def assert_same(a: ResidencyResult, b: ResidencyResult) -> None:
    for field in RESULT_FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype == torch.int32, field
        assert torch.equal(x, y), f"{field}: {x.tolist()} != {y.tolist()}"


def assert_same_state(a: Any, b: Any) -> None:
    for field in ("slot_tokens", "lru_order", "row_requests"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.dtype == y.dtype == torch.int64, field
        assert torch.equal(x, y), f"{field}: {x.tolist()} != {y.tolist()}"


@st.composite
def traces(draw: st.DrawFn) -> dict[str, Any]:
    rows = draw(st.integers(1, 3))
    capacity = draw(st.integers(1, 6))
    width = draw(st.integers(1, 8))
    top = draw(st.integers(1, 14))
    token = st.integers(-2, top)
    steps = []
    for _ in range(draw(st.integers(1, 7))):
        steps.append(dict(
            topk=draw(st.lists(st.lists(token, min_size=width, max_size=width),
                               min_size=rows, max_size=rows)),
            requests=draw(st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=rows,
                                   max_size=rows)),
            stable=draw(st.lists(st.integers(0, top + 1), min_size=rows, max_size=rows)),
            states=draw(st.lists(st.sampled_from([STEADY] * 6 + [FIRST, NOT_OFFLOADED]),
                                 min_size=rows, max_size=rows)),
            seq_lens=draw(st.none() | st.lists(st.integers(0, top + 2), min_size=rows,
                                               max_size=rows)),
        ))
    return dict(rows=rows, capacity=capacity, steps=steps, max_seq_len=top + 1)


def check_invariants(before_tokens: list[list[int]], before_requests: list[int],
                     after: Any, s: dict[str, Any], result: ResidencyResult) -> None:
    tokens_after = after.slot_tokens.tolist()
    for r, row in enumerate(s["topk"]):
        slots = result.slots[r].tolist()
        limit = s["seq_lens"][r] if s["seq_lens"] is not None else float("inf")
        valid = [0 <= t < limit for t in row]
        assert sorted(after.lru_order[r].tolist()) == list(range(len(tokens_after[r])))
        held = [t for t in tokens_after[r] if t >= 0]
        assert len(held) == len(set(held)), "a token is resident in two slots"
        if s["states"][r] == NOT_OFFLOADED:
            assert slots == [t if ok else -1 for t, ok in zip(row, valid, strict=True)]
            assert int(result.miss_counts[r]) == 0
            assert tokens_after[r] == before_tokens[r]
            continue
        selected = {t for t, ok in zip(row, valid, strict=True) if ok}
        # Every selected token is resident exactly once, and its slot is what we were told.
        for t, ok, slot in zip(row, valid, slots, strict=True):
            if ok:
                assert tokens_after[r].count(t) == 1 and tokens_after[r][slot] == t
            else:
                assert slot == -1
        # Distinct tokens get distinct slots.
        slot_of = {t: slot for t, ok, slot in zip(row, valid, slots, strict=True) if ok}
        assert len(set(slot_of.values())) == len(slot_of)
        # What was usable before the step: same request, not reset, below the stable length.
        kept = s["requests"][r] == before_requests[r] and s["states"][r] == STEADY
        usable = {t: i for i, t in enumerate(before_tokens[r])
                  if kept and 0 <= t < s["stable"][r]}
        # No slot holding a current top-k token was evicted: hits keep their slot.
        for t in selected & usable.keys():
            assert slot_of[t] == usable[t]
        # The misses are exactly the selected tokens that were not usable before.
        miss_tokens, miss_slots = misses(result, r)
        assert len(miss_tokens) == len(set(miss_tokens))
        assert set(miss_tokens) == selected - usable.keys()
        assert [slot_of[t] for t in miss_tokens] == miss_slots
        first_positions = {}
        for j, t in enumerate(row):
            if valid[j]:
                first_positions.setdefault(t, j)
        if s["states"][r] == FIRST:
            assert miss_tokens == sorted(selected) and miss_slots == list(range(len(selected)))
        else:
            assert miss_tokens == sorted(miss_tokens, key=first_positions.__getitem__)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_vectorised_equals_reference_and_invariants_hold(trace: dict[str, Any]) -> None:
    ref = ReferenceResidency(trace["rows"], trace["capacity"], max_seq_len=trace["max_seq_len"])
    vec = ResidencyTable(trace["rows"], trace["capacity"], max_seq_len=trace["max_seq_len"])
    for s in trace["steps"]:
        before_tokens, before_requests = ref.slot_tokens.tolist(), ref.row_requests.tolist()
        try:
            expected = step(ref, s["topk"], s["requests"], s["stable"], s["states"],
                            s["seq_lens"])
        except ResidencyOverflowError as error:
            with pytest.raises(ResidencyOverflowError) as raised:
                step(vec, s["topk"], s["requests"], s["stable"], s["states"], s["seq_lens"])
            assert str(raised.value) == str(error)
            assert ref.slot_tokens.tolist() == before_tokens
            assert_same_state(vec, ref)
            continue
        actual = step(vec, s["topk"], s["requests"], s["stable"], s["states"], s["seq_lens"])
        assert_same(actual, expected)
        assert_same_state(vec, ref)
        check_invariants(before_tokens, before_requests, ref, s, expected)


def test_vectorised_equals_reference_on_a_realistic_trace() -> None:
    """Wider than hypothesis draws: 4 rows, C=256, K=64 with MTP-style concatenation."""
    gen = torch.Generator().manual_seed(3)
    rows, capacity, width, positions = 4, 256, 128, 2000
    ref, vec = ReferenceResidency(rows, capacity), ResidencyTable(rows, capacity)
    current = torch.randint(0, positions, (rows, width), generator=gen)
    requests = t64([0, 1, 2, 3])
    for i in range(30):
        keep = torch.rand((rows, width), generator=gen) < 0.85
        current = torch.where(keep, current,
                              torch.randint(-1, positions, (rows, width), generator=gen))
        if i == 15:
            requests = t64([0, 5, 2, 3])
        stable = torch.full((rows,), positions - 10 + i % 7, dtype=torch.int64)
        states = t64([FIRST if i == 0 else STEADY] * rows)
        assert_same(vec.update(current, requests, stable, states),
                    ref.update(current, requests, stable, states))
        assert_same_state(vec, ref)


@pytest.mark.parametrize(("capacity", "width"), [
    (16_383, 64),  # the largest capacity with int16 LRU arithmetic
    (20_000, 64),  # int16 map, int32 LRU arithmetic
    (40_000, 64),  # int32 map
    (8, 32_767),  # too many columns for int16 markers: the map widens
])
def test_wide_and_large_configurations_agree_with_reference(capacity: int, width: int) -> None:
    gen = torch.Generator().manual_seed(capacity + width)
    rows, positions = 2, 50_000
    ref, vec = ReferenceResidency(rows, capacity), ResidencyTable(rows, capacity)
    requests = t64([1, 2])
    for i in range(3):
        # At most 8 distinct tokens per row (<= capacity), repeated, then padding.
        topk = torch.full((rows, width), -1, dtype=torch.int64)
        picks = torch.randint(0, positions, (rows, 8), generator=gen)
        topk[:, :64] = picks[:, torch.randint(0, 8, (64,), generator=gen)]
        stable = torch.full((rows,), positions, dtype=torch.int64)
        states = t64([FIRST if i == 0 else STEADY] * rows)
        assert_same(vec.update(topk, requests, stable, states),
                    ref.update(topk, requests, stable, states))
        assert_same_state(vec, ref)


# ----------------------------------------------------------------------------------- Belady


def brute_force_min_misses(trace: Sequence[Sequence[int]], capacity: int) -> int:
    """Fewest misses over every possible choice of what to keep after each step."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for raw in trace:
        selected = {t for t in raw if t >= 0}
        following: dict[frozenset[int], int] = {}
        for resident, cost in best.items():
            total = cost + len(selected - resident)
            optional = sorted(resident - selected)
            for n in range(min(capacity - len(selected), len(optional)) + 1):
                for keep in combinations(optional, n):
                    state = frozenset(selected | set(keep))
                    following[state] = min(following.get(state, total), total)
        best = following
    return min(best.values())


def lru_misses(trace: Sequence[Sequence[int]], capacity: int) -> int:
    table = ReferenceResidency(1, capacity)
    width = max([1, *(len(s) for s in trace)])
    total = 0
    for selected in trace:
        padded = list(selected) + [-1] * (width - len(selected))
        total += int(step(table, [padded], [0]).miss_counts[0])
    return total


def test_belady_on_the_textbook_reference_string() -> None:
    string = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]
    trace = [[t] for t in string]
    assert belady_min_misses(trace, 3) == 9
    assert lru_misses(trace, 3) == 12


def test_belady_sets_padding_and_duplicates() -> None:
    # Capacity 2: at step 1 evicting 1 (next use step 4) beats evicting 2 (next use step 2).
    assert belady_min_misses([[1, 2], [3, -1, 3], [2], [3], [1]], 2) == 4
    assert belady_min_misses([[1, 2], [3, -1, 3], [2], [2]], 2) == 3
    assert belady_min_misses([], 4) == 0


def test_belady_bad_input() -> None:
    with pytest.raises(ResidencyOverflowError, match="step 1: row 0 selects 3 distinct"):
        belady_min_misses([[1], [1, 2, 3, 3]], 2)
    with pytest.raises(ResidencyInputError, match="capacity must be an integer >= 1, got 0"):
        belady_min_misses([[1]], 0)


@st.composite
def small_traces(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    capacity = draw(st.integers(1, 4))
    width = draw(st.integers(1, capacity + 1))
    step_tokens = st.lists(st.integers(-1, 5), min_size=width, max_size=width).filter(
        lambda s: len({t for t in s if t >= 0}) <= capacity)
    return draw(st.lists(step_tokens, min_size=0, max_size=7)), capacity


@settings(max_examples=150, deadline=None)
@given(small_traces())
def test_belady_is_optimal_and_never_worse_than_lru(case: tuple[list[list[int]], int]) -> None:
    trace, capacity = case
    optimum = belady_min_misses(trace, capacity)
    assert optimum == brute_force_min_misses(trace, capacity)
    assert optimum <= lru_misses(trace, capacity)
