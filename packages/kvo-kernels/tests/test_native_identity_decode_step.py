"""identity_decode_step: a decode step of NOT_OFFLOADED rows in one C++ call (rules in
``csrc/row_identity.h``; kvo-vllm checks it against its NumPy path end to end in
``test_dsa_offload_not_offloaded.py``). Here: the copies, state and answer on a hand-made
step, a row out of the steady state, and refusals that change nothing.

Its first use in a session may build kvo's native ops (about a minute on two cores)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.host_identity import identity_decode_step_host

BLOCK, CAPACITY, WIDTH, MAX_ROWS, K = 4, 8, 3, 3, 4


def _case(index_dtype: torch.dtype = torch.int64) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "pool": torch.randn(10 * BLOCK, WIDTH, generator=gen),
        "hot": torch.randn(MAX_ROWS * CAPACITY, WIDTH, generator=gen),
        "block_table": torch.tensor([[2, 7, 0], [5, 1, 0]], dtype=index_dtype),
        "seq_lens": torch.tensor([6, 3], dtype=index_dtype),
        "serials": torch.tensor([11, 12]),
        "held": torch.tensor([11, 12, 13]),
        "filled": torch.tensor([5, 2, 4]),
        "topk": torch.tensor([[5, 0, -1, 3], [2, -1, -1, 1]], dtype=index_dtype),
        "hot_slots": torch.full((2, K), 99, dtype=torch.int64),
        "valid": torch.zeros(2, K, dtype=torch.bool),
    }


def _run(case: dict[str, Any], rows: int = 2) -> tuple[int, int] | None:
    return identity_decode_step_host(**case, rows=rows, block_size=BLOCK, capacity=CAPACITY)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_copies_the_new_rows_and_answers_the_hot_slots(index_dtype: torch.dtype) -> None:
    case = _case(index_dtype)
    hot = case["hot"].clone()
    assert _run(case) == (5, 9)
    # Row 0's position 5 is in block 7 (slot 29), row 1's position 2 in block 5 (slot 22).
    hot[0 * CAPACITY + 5] = case["pool"][7 * BLOCK + 1]
    hot[1 * CAPACITY + 2] = case["pool"][5 * BLOCK + 2]
    assert torch.equal(case["hot"], hot)
    assert case["filled"].tolist() == [6, 3, 4]
    assert case["held"].tolist() == [11, 12, -1]     # rows past the batch hold nothing now
    assert case["hot_slots"].tolist() == [[5, 0, -1, 3], [10, -1, -1, 9]]
    assert case["valid"].tolist() == [[True, True, False, True], [True, False, False, True]]


@pytest.mark.parametrize("field, value", [("serials", torch.tensor([11, 99])),
                                          ("filled", torch.tensor([5, 1, 4]))])
def test_a_row_out_of_the_steady_state_changes_nothing(field: str, value: torch.Tensor
                                                       ) -> None:
    case = _case()
    case[field] = value
    before = {name: t.clone() for name, t in case.items()}
    assert _run(case) is None
    for name, tensor in before.items():
        assert torch.equal(case[name], tensor), name


@pytest.mark.parametrize("field, value, words", [
    ("topk", torch.tensor([[6, 0, -1, 3], [2, -1, -1, 1]]), r"topk\[0\]\[0\] = 6 is not a"),
    ("block_table", torch.tensor([[2, 70, 0], [5, 1, 0]]), "in block 70, outside the pool"),
    ("seq_lens", torch.tensor([9, 3]), "seq_len 9; a NOT_OFFLOADED row holds 1 to 8"),
    ("hot_slots", torch.zeros(2, K, dtype=torch.int32), "hot_slots must be a contiguous int64"),
    ("held", torch.tensor([11, 12, 13], dtype=torch.int32), "held must be a contiguous int64"),
])
def test_a_refused_call_changes_nothing(field: str, value: torch.Tensor, words: str) -> None:
    case = _case()
    case[field] = value
    if field == "seq_lens":
        case["filled"] = torch.tensor([8, 2, 4])
    before = {name: t.clone() for name, t in case.items()}
    with pytest.raises(KernelArgumentError, match=words):
        _run(case)
    for name, tensor in before.items():
        assert torch.equal(case[name], tensor), name
