"""NativeResidencyTable (C++/OpenMP) against kvo-core's residency: slot for slot, bit for bit.

Every step compares all four outputs and the whole state (slot tokens, LRU order, row requests)
with ``ReferenceResidency`` (the readable rules) and ``ResidencyTable`` (the vectorised one).
The first test in a session builds the extension (about a minute on two cores; cached after).
"""

from __future__ import annotations

import logging
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvo_core.residency import (
    ReferenceResidency,
    RequestState,
    ResidencyInputError,
    ResidencyOverflowError,
    ResidencyResult,
    ResidencyTable,
)
from kvo_kernels import native_build
from kvo_kernels.native_residency import NO_ENTRY, TOMBSTONE, NativeResidencyTable, pack

NOT_OFFLOADED, FIRST_OFFLOAD, STEADY = (int(s) for s in (
    RequestState.NOT_OFFLOADED, RequestState.FIRST_OFFLOAD, RequestState.STEADY))
OUTPUTS = ("slots", "miss_counts", "miss_tokens", "miss_slots")
STATE = ("slot_tokens", "lru_order", "row_requests")
Table = ReferenceResidency | ResidencyTable | NativeResidencyTable


def _i64(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _assert_same(expected: ResidencyResult, actual: ResidencyResult, where: str) -> None:
    for name in OUTPUTS:
        want, got = getattr(expected, name), getattr(actual, name)
        assert got.dtype == torch.int32, f"{where}: {name} dtype {got.dtype}"
        assert torch.equal(want, got), f"{where}: {name}\nwant {want}\ngot  {got}"


def _assert_same_state(expected: Table, actual: Table, where: str) -> None:
    for name in STATE:
        want, got = getattr(expected, name), getattr(actual, name)
        assert torch.equal(want, got), f"{where}: {name}\nwant {want}\ngot  {got}"


def _step_all(tables: list[Table], where: str, *args: torch.Tensor | None,
              seq_lens: torch.Tensor | None = None) -> ResidencyResult | None:
    """One update on every table: same result, or the same error with every table unchanged."""
    reference, *others = tables
    try:
        expected = reference.update(*args, seq_lens=seq_lens)  # type: ignore[arg-type]
    except ResidencyOverflowError as error:
        for table in others:
            with pytest.raises(ResidencyOverflowError) as raised:
                table.update(*args, seq_lens=seq_lens)  # type: ignore[arg-type]
            assert str(raised.value) == str(error), where
            _assert_same_state(reference, table, where)
        return None
    for table in others:
        _assert_same(expected, table.update(*args, seq_lens=seq_lens),  # type: ignore[arg-type]
                     f"{where} ({type(table).__name__})")
        _assert_same_state(reference, table, f"{where} ({type(table).__name__})")
    return expected


@st.composite
def traces(draw: st.DrawFn) -> dict[str, object]:
    """Small random multi-step traces: padding, repeats, request changes, speculative drops,
    every request state, seq_lens, and top-k rows wider than the capacity (MTP)."""
    rows = draw(st.integers(1, 4), label="rows")
    capacity = draw(st.integers(1, 10), label="capacity")
    width = draw(st.integers(1, 12), label="width")
    seq = draw(st.integers(1, 24), label="token space")
    token = st.integers(-3, seq + 2)
    steps = []
    for _ in range(draw(st.integers(1, 7), label="steps")):
        steps.append({
            "topk": draw(st.lists(st.lists(token, min_size=width, max_size=width),
                                  min_size=rows, max_size=rows)),
            "requests": draw(st.lists(st.sampled_from([0, 0, 0, 1, 2, -1]),
                                      min_size=rows, max_size=rows)),
            "stable": draw(st.lists(st.integers(0, seq + 3), min_size=rows, max_size=rows)),
            "states": draw(st.one_of(st.none(), st.lists(
                st.sampled_from([STEADY, STEADY, STEADY, FIRST_OFFLOAD, NOT_OFFLOADED]),
                min_size=rows, max_size=rows))),
            "seq_lens": draw(st.one_of(st.none(), st.lists(
                st.integers(0, seq + 3), min_size=rows, max_size=rows))),
        })
    int32 = draw(st.booleans(), label="int32 top-k")
    return {"rows": rows, "capacity": capacity, "steps": steps, "int32": int32}


@settings(max_examples=120, deadline=None)
@given(trace=traces())
def test_random_traces_match_the_reference_bit_for_bit(trace: dict) -> None:
    rows, capacity = trace["rows"], trace["capacity"]
    tables: list[Table] = [ReferenceResidency(rows, capacity), ResidencyTable(rows, capacity),
                           NativeResidencyTable(rows, capacity)]
    for i, step in enumerate(trace["steps"]):
        states = None if step["states"] is None else _i64(step["states"])
        seq_lens = None if step["seq_lens"] is None else _i64(step["seq_lens"])
        topk = _i64(step["topk"])
        _step_all(tables, f"step {i}", topk.int() if trace["int32"] else topk,
                  _i64(step["requests"]), _i64(step["stable"]), states, seq_lens=seq_lens)


def _buffers(rows: int, width: int) -> ResidencyResult:
    return ResidencyResult(*(torch.full(shape, 7, dtype=torch.int32)
                             for shape in ((rows, width), (rows,), (rows, width), (rows, width))))


@settings(max_examples=60, deadline=None)
@given(trace=traces())
def test_out_buffers_receive_what_a_fresh_update_returns(trace: dict) -> None:
    """Every implementation, updated into buffers reused across steps, twin of a fresh one."""
    rows, capacity = trace["rows"], trace["capacity"]
    for cls in (ReferenceResidency, ResidencyTable, NativeResidencyTable):
        fresh, into = cls(rows, capacity), cls(rows, capacity)
        buffers: dict[int, ResidencyResult] = {}
        for i, step in enumerate(trace["steps"]):
            topk = _i64(step["topk"])
            args = (topk, _i64(step["requests"]), _i64(step["stable"]),
                    None if step["states"] is None else _i64(step["states"]))
            seq_lens = None if step["seq_lens"] is None else _i64(step["seq_lens"])
            out = buffers.setdefault(topk.shape[1], _buffers(rows, topk.shape[1]))
            try:
                expected = fresh.update(*args, seq_lens=seq_lens)
            except ResidencyOverflowError:
                with pytest.raises(ResidencyOverflowError):
                    into.update(*args, seq_lens=seq_lens, out=out)
            else:
                assert into.update(*args, seq_lens=seq_lens, out=out) is out
                _assert_same(expected, out, f"step {i} ({cls.__name__})")
            _assert_same_state(fresh, into, f"step {i} ({cls.__name__})")


Replacement = Callable[[NativeResidencyTable, dict, ResidencyResult], object]


def _native_out_cases() -> list[tuple[str, Replacement, str]]:
    """(field of out to replace, its replacement from (table, call, buffers), error)."""
    return [
        ("slots", lambda n, c, b: c["topk"], "out.slots shares memory with topk"),
        ("miss_tokens", lambda n, c, b: n._tokens.view(torch.int32)[:, :4],
         "out.miss_tokens shares memory with slot_tokens"),
        ("miss_slots", lambda n, c, b: b.slots, "out.slots shares memory with out.miss_slots"),
        ("slots", lambda n, c, b: torch.zeros(1, 8, dtype=torch.int32)[:, ::2],
         "out.slots must be contiguous"),
        ("miss_counts", lambda n, c, b: torch.zeros(2, dtype=torch.int32),
         r"out.miss_counts must have shape \[1\], got \[2\]"),
        ("slots", lambda n, c, b: torch.zeros(1, 4, dtype=torch.int64), "out.slots must be int32"),
        ("slots", lambda n, c, b: [[0] * 4], "out.slots must be a torch.Tensor, got list"),
        ("", lambda n, c, b: "out", "out must be a ResidencyResult of buffers, got str"),
    ]


@pytest.mark.parametrize(("field", "replacement", "message"), _native_out_cases())
def test_bad_out_buffers_are_refused_with_the_buffer_named(
        field: str, replacement: Replacement, message: str) -> None:
    native = NativeResidencyTable(1, 4)
    call = {"topk": _i64([[1, 2, 3, 4]]), "request_ids": _i64([0]), "stable_lens": _i64([9])}
    native.update(**call)
    before = {name: getattr(native, name) for name in STATE}
    call["topk"] = _i64([[5, 2, 6, 1]]).int()  # int32 like the buffers: may share memory
    buffers = _buffers(1, 4)
    value = replacement(native, call, buffers)
    out = attrs.evolve(buffers, **{field: value}) if field else value
    with pytest.raises(ResidencyInputError, match=message):
        native.update(**call, out=out)
    for name in STATE:
        assert torch.equal(getattr(native, name), before[name])


def _overlapping_trace(rows: int, width: int, seq: int, steps: int, overlap: float,
                       rng: random.Random) -> list[list[list[int]]]:
    """Decode-like top-k: each step keeps ~overlap of the previous selection."""
    current = [rng.sample(range(seq), width) for _ in range(rows)]
    trace = [current]
    for _ in range(steps - 1):
        nxt = []
        for row in current:
            kept = rng.sample(row, int(width * overlap))
            fresh = [t for t in rng.sample(range(seq), 2 * width) if t not in set(kept)]
            nxt.append(kept + fresh[:width - len(kept)])
        trace.append(nxt)
        current = nxt
    return trace


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(9, 96, 40, 400), (9, 1024, 1000, 4000)],
                         ids=["small", "wide"])
def test_decode_like_trace_with_many_rows(threads: int, shape: tuple[int, ...]) -> None:
    """Bigger rows over OpenMP threads; requests change and speculative suffixes drop. The
    small step (360 entries) runs on the calling thread whatever the threads; the wide one
    (9000 >= the op's 8192) goes over threads when there are two."""
    rows, capacity, width, seq = shape
    rng = random.Random(threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tables: list[Table] = [ReferenceResidency(rows, capacity),
                               ResidencyTable(rows, capacity),
                               NativeResidencyTable(rows, capacity)]
        requests = list(range(rows))
        hits = 0
        for i, topk in enumerate(_overlapping_trace(rows, width, seq, 14, 0.85, rng)):
            if i == 6:
                requests[2] = 100          # a new request takes row 2
            stable = [seq - (20 if i == 9 and r % 3 == 0 else 0) for r in range(rows)]
            states = [FIRST_OFFLOAD if i == 0 else STEADY] * rows
            result = _step_all(tables, f"step {i}", _i64(topk), _i64(requests), _i64(stable),
                               _i64(states))
            assert result is not None
            if i > 0:
                hits += int((rows * width) - result.miss_counts.sum())
        assert hits > 0.5 * 13 * rows * width  # the trace really re-selects resident tokens
    finally:
        torch.set_num_threads(previous)


def test_long_trace_on_small_rows() -> None:
    """Many steps on tiny rows: every slot is evicted and refilled many times over."""
    rng = random.Random(4)
    tables: list[Table] = [ReferenceResidency(3, 6), NativeResidencyTable(3, 6)]
    for i in range(150):
        topk = [[rng.randrange(-1, 14) for _ in range(4)] for _ in range(3)]
        requests = [0, i // 50, 0]
        stable = [14 if i % 17 else 9, 14, 14]
        _step_all(tables, f"step {i}", _i64(topk), _i64(requests), _i64(stable))


def test_far_token_positions_mixed_with_near_ones() -> None:
    """Positions 8M apart in one row (nothing may be sized by the largest token)."""
    far = 1 << 23
    tables: list[Table] = [ReferenceResidency(2, 5, max_seq_len=1 << 30),
                           NativeResidencyTable(2, 5, max_seq_len=1 << 30)]
    steps = [([[1, 2, 3], [4, 5, 6]], [0, 0]),
             ([[2, far, 3], [4, 5, far + 1]], [0, 0]),
             ([[far, 1, far + 2], [far + 1, 6, 7]], [0, 0]),
             ([[far + 3, 2, 1], [5, 4, 8]], [0, 0]),
             ([[1, 2, 9], [4, 5, 6]], [1, 0])]                   # row 0: a new request
    for i, (topk, requests) in enumerate(steps):
        _step_all(tables, f"step {i}", _i64(topk), _i64(requests), _i64([1 << 30, 1 << 30]))
    # A speculative drop that removes the far tokens.
    _step_all(tables, "drop", _i64([[1, 2, 3], [4, far + 1, 6]]), _i64([1, 0]),
              _i64([1 << 30, far]))


def test_token_positions_up_to_the_int32_limit() -> None:
    base = 2**31 - 40
    reference = ReferenceResidency(2, 4, max_seq_len=2**31)
    native = NativeResidencyTable(2, 4, max_seq_len=2**31)
    tables: list[Table] = [reference, native]
    steps = [[[base, base + 7, -1], [2**31 - 1, 1, 2**30]],
             [[base + 9, base, base + 7], [2, 2**31 - 2, 1]],
             [[base + 1, base + 2, base + 3], [2**31 - 1, 2**30 + 2, 3]]]
    for i, topk in enumerate(steps):
        wide = _i64(topk)
        _step_all(tables, f"step {i}", wide.int() if i % 2 else wide, _i64([1, 2]),
                  _i64([2**31, 2**31]))
    assert int(native.slot_tokens.max()) == 2**31 - 1  # no truncation anywhere


def _assert_native_invariants(native: NativeResidencyTable, where: str) -> None:
    """The structure behind the API: the order lists every slot once (lru_order checks that),
    every entry of the window and of the live deep log carries its slot's current token, the
    window is padded past its length, and the drop bound covers every resident token."""
    order = native.lru_order
    assert sorted(order[0].tolist()) == list(range(native.capacity)), where
    tokens = native._tokens
    for r in range(native.rows):
        max_resident, window_len, head, tail = native._meta[r].tolist()
        width = native._deep.shape[1]
        deep = [native._deep[r, p % width].item() for p in range(head, tail)]
        window = native._window[r].tolist()
        entries = [e for e in deep if e != TOMBSTONE] + window[:window_len]
        assert [e & ((1 << 20) - 1) for e in entries] == order[r].tolist(), where
        for entry in entries:
            assert entry >> 20 == int(tokens[r, entry & ((1 << 20) - 1)]), where
        assert all(e == NO_ENTRY for e in window[window_len:]), where
        assert max_resident >= int(tokens[r].max()), where


def test_long_traces_wrap_and_compact_the_deep_log() -> None:
    """600 steps on tiny rows: the circular deep log wraps many times and is compacted, the
    window grows and shrinks, rows are reset, drop and change requests; slot for slot equal
    to the reference at every step, with the structure checked too."""
    rng = random.Random(11)
    rows, capacity = 2, 6
    reference = ReferenceResidency(rows, capacity, max_seq_len=1 << 31)
    native = NativeResidencyTable(rows, capacity, max_seq_len=1 << 31)
    tables: list[Table] = [reference, native]
    requests = [0, 0]
    far = (1 << 31) - 16
    for i in range(600):
        width = rng.randint(1, 7)
        def token() -> int:
            roll = rng.random()
            if roll < 0.1:
                return -1                       # padding
            if roll < 0.2:
                return far + rng.randrange(4)   # far positions
            return rng.randrange(14)
        topk = [[token() for _ in range(width)] for _ in range(rows)]
        if rng.random() < 0.05:
            requests[rng.randrange(rows)] += 1  # a new request takes a row
        if rng.random() < 0.03:
            row = rng.randrange(rows)
            reference.reset_row(row)
            native.reset_row(row)
        stable = [far + 8 if rng.random() > 0.15 else rng.randrange(16) for _ in range(rows)]
        states = [FIRST_OFFLOAD if rng.random() < 0.02 else STEADY for _ in range(rows)]
        seq_lens = None if rng.random() < 0.7 else _i64([rng.randrange(far + 8)
                                                          for _ in range(rows)])
        _step_all(tables, f"step {i}", _i64(topk), _i64(requests), _i64(stable),
                  _i64(states), seq_lens=seq_lens)
        _assert_native_invariants(native, f"step {i}")


def _tokens_sharing_a_window_index_cell(count: int) -> list[int]:
    """Tokens whose low 21 bits agree: one cell of the window index (residency_scan.h: the
    token's low bits) for any index of up to 2**21 cells (2C for the largest capacity)."""
    return [5 + (i << 21) for i in range(count)]


def test_tokens_sharing_a_window_index_cell() -> None:
    """Tokens sharing a cell of the window index: all but one of them are found through the
    row's slow path, with the same results."""
    tables: list[Table] = [ReferenceResidency(1, 8, max_seq_len=1 << 31),
                           NativeResidencyTable(1, 8, max_seq_len=1 << 31)]
    same_cell = _tokens_sharing_a_window_index_cell(6)
    steps = [same_cell[:4], same_cell[1:5], [same_cell[0], same_cell[5], 9, same_cell[2]],
             same_cell[::-1], [same_cell[3], same_cell[3], 7, same_cell[1]]]
    for i, topk in enumerate(steps):
        _step_all(tables, f"step {i}", _i64([topk]), _i64([0]), _i64([1 << 31]))
        _assert_native_invariants(tables[1], f"step {i}")  # type: ignore[arg-type]


def test_misses_beyond_the_deep_log_take_window_slots() -> None:
    """When the deep log holds fewer evictable slots than there are misses, the walk goes on
    into the window (its least recent part), skipping the hits there."""
    tables: list[Table] = [ReferenceResidency(1, 4), NativeResidencyTable(1, 4)]
    steps = [([[1, 2, 3]], FIRST_OFFLOAD),   # window: 1, 2, 3; deep log: one empty slot
             ([[4, 5, 2, 6]], STEADY),       # 3 misses: the empty slot, then 1 and 3
             ([[7, 8, 9, 10]], STEADY),      # everything misses
             ([[9, 11, 7, 12]], STEADY)]
    for i, (topk, state) in enumerate(steps):
        _step_all(tables, f"step {i}", _i64(topk), _i64([0]), _i64([99]), _i64([state]))
        _assert_native_invariants(tables[1], f"step {i}")  # type: ignore[arg-type]


def test_largest_token_positions_and_the_limits() -> None:
    top = (1 << 31) - 1
    tables: list[Table] = [ReferenceResidency(1, 4, max_seq_len=1 << 31),
                           NativeResidencyTable(1, 4, max_seq_len=1 << 31)]
    for i, topk in enumerate([[top, top - 1, 0], [top, 5, top - 2], [1, top - 1, top]]):
        _step_all(tables, f"step {i}", _i64([topk]).int(), _i64([0]), _i64([1 << 31]))
    with pytest.raises(ResidencyInputError, match="max_seq_len must be <= 2\\*\\*31"):
        NativeResidencyTable(1, 4, max_seq_len=(1 << 31) + 1)
    with pytest.raises(ResidencyInputError, match="capacity must be <= 2\\*\\*20 = 1048576"):
        NativeResidencyTable(1, (1 << 20) + 1)


@pytest.mark.skipif(os.environ.get("KVO_RESIDENCY_SCALAR") == "1",
                    reason="this run is already the portable path")
def test_the_portable_path_gives_the_same_results() -> None:
    """The AVX2 loops (where the CPU has AVX2) and the portable ones agree: the trace tests
    run again in a process that forces the portable loops."""
    env = {**os.environ, "KVO_RESIDENCY_SCALAR": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
         "-k", "random_traces or long_traces or window_index_cell or decode_like"],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " passed" in result.stdout


def test_first_offload_not_offloaded_and_request_change_by_hand() -> None:
    native = NativeResidencyTable(2, 4)
    # First offload: distinct tokens in ascending order take slots 0..n-1, all misses.
    first = native.update(_i64([[9, 3, 9, -1], [5, 1, 7, 2]]), _i64([7, 8]), _i64([10, 10]),
                          _i64([FIRST_OFFLOAD, NOT_OFFLOADED]))
    assert first.slots.tolist() == [[1, 0, 1, -1], [5, 1, 7, 2]]
    assert first.miss_counts.tolist() == [2, 0]
    assert first.miss_tokens.tolist() == [[3, 9, -1, -1], [-1] * 4]
    assert first.miss_slots.tolist() == [[0, 1, -1, -1], [-1] * 4]
    assert native.lru_order.tolist() == [[2, 3, 0, 1], [0, 1, 2, 3]]
    assert native.row_requests.tolist() == [7, -1]  # NOT_OFFLOADED leaves its row alone
    # Steady: 9 hits, 4 and 5 miss into the least recent free slots 2 and 3.
    steady = native.update(_i64([[4, 9, 5, 4], [0, 0, 0, 0]]), _i64([7, 8]), _i64([10, 10]))
    assert steady.slots[0].tolist() == [2, 1, 3, 2]
    assert steady.miss_tokens[0].tolist() == [4, 5, -1, -1]
    assert native.lru_order[0].tolist() == [0, 2, 3, 1]
    # Speculative drop: with stable length 5, tokens 5 and 9 are forgotten first; 3 still
    # hits, 5 misses into the least recent evictable slot (2, evicting 4).
    dropped = native.update(_i64([[5, 3, -1, -1], [0, 0, 0, 0]]), _i64([7, 8]), _i64([5, 10]))
    assert dropped.slots[0].tolist() == [2, 0, -1, -1]
    assert dropped.miss_tokens[0].tolist() == [5, -1, -1, -1]
    assert native.slot_tokens[0].tolist() == [3, -1, 5, -1]
    assert native.lru_order[0].tolist() == [3, 1, 2, 0]
    # A new request on row 0 resets it first: everything misses, from slot 0 on.
    changed = native.update(_i64([[9, 4, -1, -1], [0, 0, 0, 0]]), _i64([70, 8]), _i64([10, 10]))
    assert changed.miss_slots[0].tolist() == [0, 1, -1, -1]
    assert native.row_requests.tolist() == [70, 8]


def test_overflow_raises_and_changes_nothing() -> None:
    reference, native = ReferenceResidency(2, 3), NativeResidencyTable(2, 3)
    tables: list[Table] = [reference, native]
    _step_all(tables, "fill", _i64([[1, 2, 3], [4, 5, 6]]), _i64([0, 0]), _i64([99, 99]))
    # Row 1 selects 4 distinct tokens in a 6-wide (two query rows) selection: overflow.
    with pytest.raises(ResidencyOverflowError, match="row 1 selects 4 distinct tokens"):
        native.update(_i64([[1, 2, 1, 2, 1, 2], [4, 5, 6, 7, 4, 5]]), _i64([0, 0]),
                      _i64([99, 99]))
    _assert_same_state(reference, native, "after the refused update")
    # A wide row that repeats enough fits.
    _step_all(tables, "fits", _i64([[1, 2, 1, 2, 1, 2], [4, 5, 6, 4, 5, 6]]), _i64([0, 0]),
              _i64([99, 99]))


def _valid_call() -> dict[str, torch.Tensor]:
    return {"topk": _i64([[1, 2], [3, -1]]), "request_ids": _i64([0, 1]),
            "stable_lens": _i64([5, 5]), "states": _i64([STEADY, STEADY])}


@pytest.mark.parametrize(("change", "argument"), [
    (lambda c: c.update(topk=c["topk"].short()), "topk"),
    (lambda c: c.update(topk=c["topk"][:1]), "topk"),
    (lambda c: c.update(topk=torch.empty(2, 0, dtype=torch.int64)), "topk"),
    (lambda c: c.update(topk=[[1, 2], [3, 4]]), "topk"),
    (lambda c: c.update(topk=_i64([[1, 2], [3, 2**21]])), "max_seq_len"),
    (lambda c: c.update(request_ids=_i64([0, 1, 2])), "request_ids"),
    (lambda c: c.update(stable_lens=_i64([5, -1])), "stable_lens"),
    (lambda c: c.update(stable_lens=_i64([5.0, 1.0]).float()), "stable_lens"),
    (lambda c: c.update(states=_i64([STEADY, 0])), "states"),
    (lambda c: c.update(states=_i64([[STEADY, STEADY]])), "states"),
    (lambda c: c.update(seq_lens=_i64([4, -2])), "seq_lens"),
    (lambda c: c.update(seq_lens=_i64([4])), "seq_lens"),
])
def test_bad_input_is_refused_with_the_argument_named(
        change: Callable[[dict], None], argument: str) -> None:
    native = NativeResidencyTable(2, 4)
    native.update(**_valid_call())
    before = {name: getattr(native, name) for name in STATE}
    call: dict = _valid_call()
    call["seq_lens"] = None
    change(call)
    with pytest.raises(ResidencyInputError, match=argument):
        native.update(**call)
    for name in STATE:
        assert torch.equal(getattr(native, name), before[name])


def test_constructor_and_reset_row_validate() -> None:
    with pytest.raises(ResidencyInputError, match="capacity"):
        NativeResidencyTable(2, 0)
    with pytest.raises(ResidencyInputError, match="rows"):
        NativeResidencyTable(-1, 4)
    with pytest.raises(ResidencyInputError, match="device"):
        NativeResidencyTable(2, 4, device="meta")
    native = NativeResidencyTable(2, 4)
    native.update(_i64([[1, 2], [3, 4]]), _i64([5, 6]), _i64([9, 9]))
    with pytest.raises(ResidencyInputError, match="row"):
        native.reset_row(2)
    native.reset_row(1)
    assert native.slot_tokens[1].tolist() == [-1] * 4
    assert native.row_requests.tolist() == [5, -1]
    assert native.lru_order[1].tolist() == [0, 1, 2, 3]
    assert native.slot_tokens[0].tolist() != [-1] * 4


def _filled_native() -> NativeResidencyTable:
    """One row of 4 slots after two steps: tokens in the window and in the deep log."""
    native = NativeResidencyTable(1, 4)
    native.update(_i64([[1, 2]]), _i64([0]), _i64([9]))
    native.update(_i64([[3, 1]]), _i64([0]), _i64([9]))
    return native


def _corrupt_window_slot(native: NativeResidencyTable) -> None:
    native._window[0, 0] = int(pack(3, 7))  # slot 7 of a 4-slot row: past the row


def _corrupt_deep_slot(native: NativeResidencyTable) -> None:
    head = int(native._meta[0, 2])
    native._deep[0, head % native._deep.shape[1]] = int(pack(-1, 1 << 19))


def _corrupt_window_length(native: NativeResidencyTable) -> None:
    native._meta[0, 1] = 5  # longer than the row


def _corrupt_deep_bounds(native: NativeResidencyTable) -> None:
    native._meta[0, 3] = int(native._meta[0, 2]) + 100  # a log longer than its array


def _lose_the_deep_log(native: NativeResidencyTable) -> None:
    native._meta[0, 3] = native._meta[0, 2]  # too few slots left to evict


@pytest.mark.parametrize("corrupt", [_corrupt_window_slot, _corrupt_deep_slot,
                                     _corrupt_window_length, _corrupt_deep_bounds,
                                     _lose_the_deep_log])
def test_corrupt_state_is_refused_not_followed(corrupt: Callable[[NativeResidencyTable], None],
                                               ) -> None:
    """A state poked from outside is refused with the row untouched, never followed out of
    bounds; reading its LRU order names the row too; reset_row makes it usable again."""
    native = _filled_native()
    corrupt(native)
    before = {name: getattr(native, name).clone()
              for name in ("_tokens", "_window", "_deep", "_meta", "_requests")}
    with pytest.raises(ResidencyInputError, match=r"state of row 0 is corrupt"):
        native.update(_i64([[7, 8, 9, 10]]), _i64([0]), _i64([99]))
    for name, value in before.items():
        assert torch.equal(getattr(native, name), value), name
    with pytest.raises(ResidencyInputError, match=r"LRU order of row 0"):
        _ = native.lru_order
    native.reset_row(0)
    reference = ReferenceResidency(1, 4)
    _step_all([reference, native], "after reset", _i64([[7, 8, 9, 10]]), _i64([0]), _i64([99]))


def test_the_op_checks_its_own_arguments() -> None:
    native = NativeResidencyTable(1, 4)
    op = torch.ops.kvo.residency_update
    state = (native._tokens, native._window, native._deep, native._meta, native._requests)
    with pytest.raises(ValueError, match="topk must be int32 or int64, got Short"):
        op(*state, torch.zeros(1, 2, dtype=torch.int16), _i64([0]), _i64([1]), _i64([STEADY]),
           None, 16)
    with pytest.raises(ValueError, match="lru_window must have a power-of-two width"):
        op(native._tokens, native._window[:, :3].contiguous(), *state[2:], _i64([[1]]),
           _i64([0]), _i64([1]), _i64([STEADY]), None, 16)
    with pytest.raises(ValueError, match="row_meta must have shape"):
        op(*state[:3], native._meta[:, :2].contiguous(), native._requests, _i64([[1]]),
           _i64([0]), _i64([1]), _i64([STEADY]), None, 16)
    with pytest.raises(ValueError, match="stable_lens has 2 rows"):
        op(*state, _i64([[1]]), _i64([0]), _i64([1, 1]), _i64([STEADY]), None, 16)
    with pytest.raises(ValueError, match=r"max_seq_len must be in \[1, 2\*\*31\], got 2147483649"):
        op(*state, _i64([[1]]), _i64([0]), _i64([1]), _i64([STEADY]), None, (1 << 31) + 1)


def test_the_out_op_through_the_dispatcher_writes_what_the_allocating_one_returns() -> None:
    fresh, into = NativeResidencyTable(2, 4), NativeResidencyTable(2, 4)
    buffers = _buffers(2, 3)
    for topk in ([[1, 2, 3], [4, -1, 4]], [[3, 9, 1], [5, 6, 7]]):
        expected = fresh.update(_i64(topk), _i64([0, 1]), _i64([20, 20]))
        torch.ops.kvo.residency_update_out(
            into._tokens, into._window, into._deep, into._meta, into._requests, _i64(topk),
            _i64([0, 1]), _i64([20, 20]), _i64([STEADY, STEADY]), None, into._max_seq_len,
            buffers.slots, buffers.miss_counts, buffers.miss_tokens, buffers.miss_slots)
        _assert_same(expected, buffers, f"top-k {topk}")
        _assert_same_state(fresh, into, f"top-k {topk}")
    with pytest.raises(ValueError, match=r"out\.miss_counts must have shape"):
        torch.ops.kvo.residency_update_out(
            into._tokens, into._window, into._deep, into._meta, into._requests, _i64(topk),
            _i64([0, 1]), _i64([20, 20]), _i64([STEADY, STEADY]), None, into._max_seq_len,
            buffers.slots, buffers.miss_counts[:1], buffers.miss_tokens, buffers.miss_slots)


def test_missing_compiler_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CXX", "kvo-no-such-compiler")
    with pytest.raises(native_build.NativeBuildError, match="kvo-no-such-compiler"):
        native_build.compile_and_load("kvo_never_built", [tmp_path / "x.cpp"], tmp_path)


def test_build_failure_carries_the_compiler_output(tmp_path: Path) -> None:
    source = tmp_path / "broken.cpp"
    source.write_text("int kvo_broken() { return kvo_undeclared_name; }\n")
    with pytest.raises(native_build.NativeBuildError) as raised:
        native_build.compile_and_load("kvo_broken_probe", [source], tmp_path / "build")
    message = str(raised.value)
    assert "compiler output" in message and "kvo_undeclared_name" in message


def test_build_directory_and_name_track_versions(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setenv("KVO_TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = native_build.build_directory()
    assert directory.parent == tmp_path and torch.__version__.split("+")[0] in directory.name
    name = native_build.extension_name()
    assert name.startswith("kvo_native_ops_") and name == native_build.extension_name()


def test_a_failed_build_logs_its_start_and_is_not_retried_in_the_process(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One INFO line before compiling (what, where, how long); a failure is raised again to the
    next caller without a second compile (vLLM builds one table per layer)."""
    monkeypatch.setenv("KVO_TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "SOURCES", ("broken.cpp",))
    monkeypatch.setattr(native_build, "HEADERS", ())
    monkeypatch.setattr(native_build, "CSRC", tmp_path)
    (tmp_path / "broken.cpp").write_text("int kvo_broken() { return kvo_undeclared_name; }\n")
    monkeypatch.setattr(native_build, "_module", None)
    monkeypatch.setattr(native_build, "_failure", None)
    calls = []
    real = native_build.compile_and_load

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(native_build, "compile_and_load", counting)
    with caplog.at_level(logging.INFO, logger=native_build.log.name):
        with pytest.raises(native_build.NativeBuildError) as first:
            native_build.load_native_ops()
        with pytest.raises(native_build.NativeBuildError) as second:
            native_build.load_native_ops()
    assert second.value is first.value and len(calls) == 1
    started = [r.getMessage() for r in caplog.records
               if "compiling native host ops" in r.getMessage()]
    assert len(started) == 1 and str(tmp_path) in started[0]
    assert "kvo-build-native-ops" in started[0]
    assert not any("built in" in r.getMessage() for r in caplog.records)


def test_the_ahead_of_time_command_builds_into_the_cache_then_finds_it(tmp_path: Path) -> None:
    """``python -m kvo_kernels.native_build`` (the ``kvo-build-native-ops`` script) compiles
    into $KVO_TORCH_EXTENSIONS_DIR, logging the start and the result (time, path); a second run
    finds the build and compiles nothing."""
    env = {**os.environ, "KVO_TORCH_EXTENSIONS_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "kvo_kernels.native_build"]
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900,
                           check=False)
    assert first.returncode == 0, first.stderr
    library = Path(first.stdout.strip().rsplit(": ", 1)[1])
    assert library.is_file() and library.is_relative_to(tmp_path), first.stdout
    assert "kvo native ops built in" in first.stdout
    assert "INFO kvo: compiling native host ops" in first.stderr
    built = r"INFO kvo: native host ops \S+ built in [0-9.]+ s: " + re.escape(str(library))
    assert re.search(built, first.stderr), first.stderr
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    assert second.returncode == 0 and f"already built: {library}" in second.stdout
    assert "compiling" not in second.stderr
