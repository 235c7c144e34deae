"""kvo::sparse_copy's C++ host implementation (``implementation="native"`` on CPU tensors):
bit-exact against the reference on random cases, the same refusals, nothing written on one.

Its first use in a session may build kvo's native ops (about a minute on two cores)."""

from __future__ import annotations

import pytest
import torch

from kvo_kernels import dispatch, ops
from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.reference import primitives as ref


def _native_copy(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                 dst_rows: torch.Tensor) -> None:
    ops.sparse_copy(src, dst, src_rows, dst_rows, implementation="native")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", range(4))
def test_native_copy_equals_the_reference(dtype: torch.dtype, index_dtype: torch.dtype,
                                          seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rows, width = 97, (3, 5) if seed % 2 else (576,)
    src = (torch.randn(rows, *width, generator=gen) * 50).to(dtype)
    before = (torch.randn(40, *width, generator=gen) * 50).to(dtype)
    count = int(torch.randint(0, 41, (1,), generator=gen))
    src_rows = torch.randint(0, rows, (count,), generator=gen).to(index_dtype)  # repeats allowed
    dst_rows = torch.randperm(40, generator=gen)[:count].to(index_dtype)
    expected, actual = before.clone(), before.clone()
    ref.sparse_copy(src, expected, src_rows, dst_rows)
    _native_copy(src, actual, src_rows, dst_rows)
    assert torch.equal(actual, expected)


def test_native_copy_reads_and_writes_strided_rows() -> None:
    """Rows of a view whose row stride is not the row size (a layer of a larger pool)."""
    pool = torch.arange(6 * 10, dtype=torch.float32).view(6, 10)
    src, dst = pool[:, 2:6], torch.zeros(8, 2, 4)[:, 1]
    _native_copy(src, dst, torch.tensor([5, 1]), torch.tensor([0, 7]))
    assert torch.equal(dst[0], pool[5, 2:6]) and torch.equal(dst[7], pool[1, 2:6])
    assert int((dst != 0).any(dim=1).sum()) == 2


@pytest.mark.parametrize(("src_rows", "dst_rows", "named"), [
    ([3], [0], "src_rows"), ([-1], [0], "src_rows"), ([0], [2], "dst_rows"),
    ([0, 1], [1, 1], "dst_rows"), ([0, 1], [1], "dst_rows")])
def test_native_copy_refuses_what_the_reference_refuses_before_writing(
        src_rows: list[int], dst_rows: list[int], named: str) -> None:
    src, dst = torch.ones(3, 2), torch.zeros(2, 2)
    with pytest.raises(KernelArgumentError, match=named):
        _native_copy(src, dst, torch.tensor(src_rows), torch.tensor(dst_rows))
    assert torch.equal(dst, torch.zeros(2, 2))


def test_native_copy_refuses_mismatched_rows_and_dtypes() -> None:
    with pytest.raises(KernelArgumentError, match="row shape"):
        _native_copy(torch.ones(3, 2), torch.zeros(2, 3), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(KernelArgumentError, match="dtype"):
        _native_copy(torch.ones(3, 2), torch.zeros(2, 2, dtype=torch.float64),
                     torch.tensor([0]), torch.tensor([0]))


def test_native_is_chosen_only_when_forced_on_cpu() -> None:
    assert dispatch.select("sparse_copy", "cpu", choice="auto").implementation == "reference"
    forced = dispatch.select("sparse_copy", "cpu", choice="native")
    assert forced.implementation == "native" and forced.native_op is not None
