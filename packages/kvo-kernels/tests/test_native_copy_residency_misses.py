"""copy_residency_misses: a residency update's miss copies told straight from its result and
vLLM's block table. Bit-exact against building the index arrays in Python and running the
reference ``sparse_copy``; refuses bad indices with nothing written.

Its first use in a session may build kvo's native ops (about a minute on two cores)."""

from __future__ import annotations

import pytest
import torch

from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.host_copy import copy_residency_misses_host
from kvo_kernels.reference import primitives as ref

BLOCK, CAPACITY, WIDTH = 4, 8, 6


def _case(seed: int, rows: int, index_dtype: torch.dtype, width: int = WIDTH
          ) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_row, pool_blocks = 5, 3 + rows * 5
    table = torch.stack([torch.randperm(pool_blocks, generator=gen)[:blocks_per_row]
                         for _ in range(rows)])
    counts = torch.randint(0, CAPACITY + 1, (rows,), generator=gen)
    tokens = torch.full((rows, CAPACITY), -1, dtype=torch.int64)
    slots = torch.full((rows, CAPACITY), -1, dtype=torch.int64)
    for r in range(rows):
        n = int(counts[r])
        tokens[r, :n] = torch.randperm(blocks_per_row * BLOCK, generator=gen)[:n]
        slots[r, :n] = torch.randperm(CAPACITY, generator=gen)[:n]
    return {"pool": torch.randn(pool_blocks * BLOCK, width, generator=gen),
            "hot": torch.randn(rows * CAPACITY + 3, width, generator=gen),
            "table": table.to(index_dtype), "counts": counts.to(index_dtype),
            "tokens": tokens.to(index_dtype), "slots": slots.to(index_dtype)}


def _python_copies(case: dict[str, torch.Tensor], rows: int) -> tuple[list[int], list[int]]:
    src, dst = [], []
    for r in range(rows):
        for i in range(int(case["counts"][r])):
            token = int(case["tokens"][r, i])
            src.append(int(case["table"][r, token // BLOCK]) * BLOCK + token % BLOCK)
            dst.append(r * CAPACITY + int(case["slots"][r, i]))
    return src, dst


def _run(case: dict[str, torch.Tensor], rows: int) -> int:
    return copy_residency_misses_host(case["pool"], case["hot"], case["table"], case["counts"],
                                      case["tokens"], case["slots"], rows=rows,
                                      block_size=BLOCK, capacity=CAPACITY)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", range(6))
def test_the_copies_equal_the_reference_sparse_copy(index_dtype: torch.dtype, seed: int) -> None:
    rows = 1 + seed % 4
    case = _case(seed, rows, index_dtype)
    expected = case["hot"].clone()
    src, dst = _python_copies(case, rows)
    ref.sparse_copy(case["pool"], expected, torch.tensor(src, dtype=torch.int64),
                    torch.tensor(dst, dtype=torch.int64))
    assert _run(case, rows) == len(src)
    assert torch.equal(case["hot"], expected)


def test_a_copy_split_over_threads_equals_the_reference_sparse_copy() -> None:
    """Rows of 16 KiB: the op hands chunks of 64 KiB to PyTorch's threads (4 rows each)."""
    rows = 4
    case = _case(7, rows, torch.int64, width=4096)
    case["counts"].fill_(CAPACITY)   # every row misses its whole capacity: 32 copies
    for r in range(rows):
        case["tokens"][r] = torch.randperm(5 * BLOCK)[:CAPACITY]
        case["slots"][r] = torch.randperm(CAPACITY)
    expected = case["hot"].clone()
    src, dst = _python_copies(case, rows)
    ref.sparse_copy(case["pool"], expected, torch.tensor(src, dtype=torch.int64),
                    torch.tensor(dst, dtype=torch.int64))
    assert _run(case, rows) == len(src) == rows * CAPACITY
    assert torch.equal(case["hot"], expected)


def test_only_the_named_rows_are_read() -> None:
    """Rows past ``rows`` (and entries past a row's count) are not copied."""
    case = _case(1, 3, torch.int64)
    before = case["hot"].clone()
    src, dst = _python_copies(case, 2)
    assert _run(case, 2) == len(src)
    untouched = torch.ones(before.shape[0], dtype=torch.bool)
    untouched[torch.tensor(dst, dtype=torch.int64)] = False
    assert torch.equal(case["hot"][untouched], before[untouched])


@pytest.mark.parametrize(("field", "row", "value", "message"), [
    ("tokens", (0, 0), 5 * BLOCK, "outside the block table"),
    ("tokens", (0, 0), -2, "outside the block table"),
    ("slots", (0, 0), CAPACITY, r"miss_slots\[0\]\[0\] = 8 is outside \[0, 8\)"),
    ("table", (0, 0), 10_000, "outside the pool"),
    ("counts", (0,), CAPACITY + 1, r"miss_counts\[0\] = 9 is outside \[0, 8\]"),
])
def test_a_bad_index_is_refused_naming_it_and_nothing_is_written(
        field: str, row: tuple[int, ...], value: int, message: str) -> None:
    case = _case(2, 2, torch.int64)
    case["counts"][0] = 3
    case["tokens"][0, :3] = torch.tensor([0, 1, 2])
    case["slots"][0, :3] = torch.tensor([0, 1, 2])
    if field == "table":
        case["table"][0, :] = 10_000
    else:
        case[field][row] = value
    before = case["hot"].clone()
    with pytest.raises(KernelArgumentError, match=message):
        _run(case, 2)
    assert torch.equal(case["hot"], before)


def test_a_hot_slot_named_twice_is_refused() -> None:
    case = _case(3, 1, torch.int64)
    case["counts"][0] = 2
    case["tokens"][0, :2] = torch.tensor([0, 1])
    case["slots"][0, :2] = torch.tensor([4, 4])
    before = case["hot"].clone()
    with pytest.raises(KernelArgumentError, match="hot slot 4 of row 0 is named twice"):
        _run(case, 1)
    assert torch.equal(case["hot"], before)


def test_too_few_hot_rows_or_a_dtype_mismatch_is_refused() -> None:
    case = _case(4, 2, torch.int64)
    with pytest.raises(KernelArgumentError, match="need 24 hot rows, hot has 19"):
        copy_residency_misses_host(case["pool"], case["hot"], case["table"], case["counts"],
                                   case["tokens"], case["slots"], rows=2, block_size=BLOCK,
                                   capacity=12)
    with pytest.raises(KernelArgumentError, match="hot dtype"):
        copy_residency_misses_host(case["pool"], case["hot"].double(), case["table"],
                                   case["counts"], case["tokens"], case["slots"], rows=2,
                                   block_size=BLOCK, capacity=CAPACITY)
