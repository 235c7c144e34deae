"""row_serials: the offload path's request serials of batch rows in C++ (rules in
``csrc/row_identity.h``; kvo-vllm checks it call by call against its NumPy ``RowIdentity``).
Here: the rules on a hand-made history, and refusals that change nothing.

Its first use in a session may build kvo's native ops (about a minute on two cores)."""

from __future__ import annotations

import pytest
import torch

from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.host_identity import RowSerialsState, row_serials_host

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
