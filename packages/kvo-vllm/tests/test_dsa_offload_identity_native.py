"""RowIdentity with kvo-kernels' C++ ``row_serials`` equals its NumPy reference call by call:
the same serials and the same recorded state, over random histories of block writes, decode
steps, joins, swaps, rewritten blocks, forgotten rows and prefills."""

from __future__ import annotations

import random

import pytest
import torch

from kvo_kernels.host_identity import pool_write_rows_host
from kvo_vllm.dsa.offload_identity import RowIdentity

BS, MAX_ROWS, MAX_BLOCKS, NUM_BLOCKS = 4, 4, 6, 20


def _pair() -> tuple[RowIdentity, RowIdentity]:
    args = dict(max_rows=MAX_ROWS, num_blocks=NUM_BLOCKS, block_size=BS,
                max_blocks_per_row=MAX_BLOCKS)
    return RowIdentity(**args, native=False), RowIdentity(**args, native=True)


def _same_state(a: RowIdentity, b: RowIdentity) -> None:
    for name in ("versions", "recorded_blocks", "recorded_versions", "covered", "serials",
                 "next_serial"):
        assert torch.equal(getattr(a.state, name), getattr(b.state, name)), name


@pytest.mark.parametrize("seed", range(8))
def test_native_serials_equal_the_numpy_reference(seed: int) -> None:
    rng = random.Random(seed)
    numpy_rows, native_rows = _pair()
    table = [[rng.randrange(NUM_BLOCKS) for _ in range(MAX_BLOCKS)] for _ in range(MAX_ROWS)]
    lens = [rng.randrange(1, MAX_BLOCKS * BS) for _ in range(MAX_ROWS)]
    row_calls = 0
    for _ in range(300):
        rows = rng.randrange(1, MAX_ROWS + 1) if rng.random() < 0.1 else MAX_ROWS
        event = rng.random()
        if event < 0.1:      # a block re-filled from its first row (a new owner)
            slots = torch.tensor([rng.randrange(NUM_BLOCKS) * BS])
        elif event < 0.2:    # rows swap places
            i, j = rng.randrange(MAX_ROWS), rng.randrange(MAX_ROWS)
            table[i], table[j], lens[i], lens[j] = table[j], table[i], lens[j], lens[i]
            slots = torch.tensor([-1])
        elif event < 0.3:    # a row gets another block id somewhere
            table[rng.randrange(MAX_ROWS)][rng.randrange(MAX_BLOCKS)] = rng.randrange(
                NUM_BLOCKS)
            slots = torch.tensor([-1])
        else:                # mostly: a write inside the blocks, not at a first row
            slots = torch.tensor([rng.randrange(NUM_BLOCKS) * BS + rng.randrange(1, BS),
                                  -1])
        for ident in (numpy_rows, native_rows):
            ident.note_writes(slots)
        queries = [1 if rng.random() < 0.8 else rng.randrange(0, lens[r] + 1)
                   for r in range(rows)]
        lens = [min(n + 1, MAX_BLOCKS * BS) for n in lens]
        dtype = torch.int32 if rng.random() < 0.5 else torch.int64
        args = (torch.tensor(table[:rows], dtype=dtype), torch.tensor(lens[:rows]),
                torch.tensor(queries))
        want = numpy_rows.serials(*args)
        got = native_rows.serials(*args)
        assert torch.equal(got, want)
        _same_state(numpy_rows, native_rows)
        row_calls += rows
        if rng.random() < 0.05:
            mask = torch.tensor([rng.random() < 0.5 for _ in range(rows)])
            for ident in (numpy_rows, native_rows):
                ident.forget(mask)
        if rng.random() < 0.05:   # a request finished: a fresh short one in its row
            r = rng.randrange(MAX_ROWS)
            table[r] = [rng.randrange(NUM_BLOCKS) for _ in range(MAX_BLOCKS)]
            lens[r] = rng.randrange(1, 2 * BS)
    fresh = int(numpy_rows.state.next_serial[0])
    assert 0.05 * row_calls < fresh < 0.7 * row_calls   # both keeping and renewing exercised


@pytest.mark.parametrize("seed", range(4))
def test_native_pool_write_notes_the_same_block_versions(seed: int) -> None:
    """kvo-kernels' pool_write_rows (the manager's write with the native ops) writes the rows
    and renews the same block versions, with the same counter, as note_writes."""
    rng = random.Random(seed)
    numpy_rows, native_rows = _pair()
    pool = torch.zeros(NUM_BLOCKS * BS, 3)
    want = torch.zeros_like(pool)
    for _ in range(50):
        count = rng.randrange(1, 6)
        picks = [rng.choice([-1, rng.randrange(NUM_BLOCKS) * BS,
                             rng.randrange(NUM_BLOCKS * BS)]) for _ in range(count)]
        slots = torch.tensor([p for i, p in enumerate(picks)     # vLLM: no slot twice
                              if p < 0 or p not in picks[:i]])
        count = int(slots.numel())
        rows = torch.randn(count, 3)
        numpy_rows.note_writes(slots)
        keep = slots >= 0
        want[slots[keep]] = rows[keep]
        written = pool_write_rows_host(pool, rows, slots, native_rows.state.versions,
                                       native_rows.write_counter, block_size=BS)
        assert written == int(keep.sum())
        assert torch.equal(pool, want)
        _same_state(numpy_rows, native_rows)
        assert torch.equal(native_rows.write_counter, numpy_rows.write_counter)
