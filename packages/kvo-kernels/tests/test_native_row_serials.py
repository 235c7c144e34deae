"""row_serials: the offload path's request serials of batch rows in C++ (rules in
``csrc/row_identity.h``; kvo-vllm checks it call by call against its NumPy ``RowIdentity``).
Here: the rules on a hand-made history, and refusals that change nothing.

Its first use in a session may build kvo's native ops (about a minute on two cores)."""

from __future__ import annotations

import pytest
import torch

from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.host_identity import RowSerialsState, pool_write_rows_host, row_serials_host

BLOCK, MAX_ROWS, MAX_BLOCKS, NUM_BLOCKS = 4, 3, 5, 16


def _state() -> RowSerialsState:
    return RowSerialsState(
        versions=torch.zeros(NUM_BLOCKS, dtype=torch.int64),
        recorded_blocks=torch.full((MAX_ROWS, MAX_BLOCKS), -1, dtype=torch.int64),
        recorded_versions=torch.full((MAX_ROWS, MAX_BLOCKS), -1, dtype=torch.int64),
        covered=torch.zeros(MAX_ROWS, dtype=torch.int64),
        serials=torch.full((MAX_ROWS,), -1, dtype=torch.int64),
        next_serial=torch.zeros(1, dtype=torch.int64))


def _call(state: RowSerialsState, table: list[list[int]], lens: list[int],
          queries: list[int], dtype: torch.dtype = torch.int64) -> list[int]:
    rows = len(lens)
    row_serials_host(state, torch.tensor(table, dtype=dtype), torch.tensor(lens, dtype=dtype),
                     torch.tensor(queries, dtype=dtype), rows=rows, block_size=BLOCK)
    return state.serials[:rows].tolist()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_rows_keep_their_serial_until_their_blocks_change(dtype: torch.dtype) -> None:
    state = _state()
    table = [[3, 7, 0, 0, 0], [5, 0, 0, 0, 0]]
    # First call: no row has recorded blocks, both get fresh serials in row order.
    assert _call(state, table, [6, 2], [6, 2], dtype) == [0, 1]
    assert state.covered[:2].tolist() == [2, 1]
    assert state.recorded_blocks[0].tolist() == [3, 7, -1, -1, -1]
    # Decode: same blocks, a stable prefix inside them: both keep.
    assert _call(state, table, [7, 3], [1, 1], dtype) == [0, 1]
    # Row 0's block 7 is rewritten from its first row (a new owner): row 0 is new, row 1 keeps.
    state.versions[7] = 1
    assert _call(state, table, [8, 4], [1, 1], dtype) == [2, 1]
    # The rows swap places (a finished request condenses the batch): both are new there.
    assert _call(state, [table[1], table[0]], [5, 9], [1, 1], dtype) == [3, 4]
    # A row whose whole sequence is this call's (a prefill from position 0) is always new.
    assert _call(state, [table[1], table[0]], [6, 10], [6, 1], dtype) == [5, 4]
    assert int(state.next_serial[0]) == 6


def test_a_refused_call_changes_nothing() -> None:
    state = _state()
    _call(state, [[3, 7, 0, 0, 0]], [6], [6])
    before = {name: getattr(state, name).clone() for name in (
        "versions", "recorded_blocks", "recorded_versions", "covered", "serials",
        "next_serial")}
    table = torch.tensor([[3, 7, 0, 0, 0], [NUM_BLOCKS, 0, 0, 0, 0]])
    with pytest.raises(KernelArgumentError, match=r"block_table\[1\]\[0\] = 16 is outside"):
        row_serials_host(state, table, torch.tensor([7, 1]), torch.tensor([1, 1]), rows=2,
                         block_size=BLOCK)
    with pytest.raises(KernelArgumentError, match="4 batch rows, at most 3"):
        row_serials_host(state, torch.zeros(4, 5, dtype=torch.int64),
                         torch.ones(4, dtype=torch.int64), torch.ones(4, dtype=torch.int64),
                         rows=4, block_size=BLOCK)
    with pytest.raises(KernelArgumentError, match="query_len -1"):
        row_serials_host(state, table[:1], torch.tensor([7]), torch.tensor([-1]), rows=1,
                         block_size=BLOCK)
    with pytest.raises(KernelArgumentError, match="must be int32 or int64"):
        row_serials_host(state, table.float(), torch.tensor([7]), torch.tensor([1]), rows=1,
                         block_size=BLOCK)
    bad = RowSerialsState(**{**{name: getattr(state, name) for name in before},
                             "covered": torch.zeros(MAX_ROWS, dtype=torch.int32)})
    with pytest.raises(KernelArgumentError, match="covered must be a contiguous int64"):
        row_serials_host(bad, table[:1], torch.tensor([7]), torch.tensor([1]), rows=1,
                         block_size=BLOCK)
    for name, tensor in before.items():
        assert torch.equal(getattr(state, name), tensor), name


def test_pool_write_rows_writes_notes_first_rows_and_refuses_cleanly() -> None:
    pool = torch.zeros(NUM_BLOCKS * BLOCK, 2)
    versions = torch.zeros(NUM_BLOCKS, dtype=torch.int64)
    counter = torch.zeros(1, dtype=torch.int64)
    rows = torch.arange(6.0).view(3, 2)
    # slot 9 is inside block 2, -1 is skipped, 12 is block 3's first row
    assert pool_write_rows_host(pool, rows, torch.tensor([9, -1, 12]), versions, counter,
                                block_size=BLOCK) == 2
    assert pool[9].tolist() == [0.0, 1.0] and pool[12].tolist() == [4.0, 5.0]
    assert int(counter[0]) == 1 and versions.tolist() == [0, 0, 0, 1] + [0] * 12
    assert pool_write_rows_host(pool, rows[:1], torch.tensor([13]), versions, counter,
                                block_size=BLOCK) == 1
    assert int(counter[0]) == 1          # no first row written: no new version
    before = (pool.clone(), versions.clone(), counter.clone())
    with pytest.raises(KernelArgumentError, match=r"slots\[1\] = 64 is outside the pool"):
        pool_write_rows_host(pool, rows[:2], torch.tensor([0, 64]), versions, counter,
                             block_size=BLOCK)
    with pytest.raises(KernelArgumentError, match="do not match the pool's rows"):
        pool_write_rows_host(pool, rows.double(), torch.tensor([0, 1, 2]), versions, counter,
                             block_size=BLOCK)
    assert torch.equal(pool, before[0]) and torch.equal(versions, before[1])
    assert torch.equal(counter, before[2])
