"""kvo::sparse_copy_gather: the decode step's miss copies and its gather of the selected rows in
one pass. The C++ host op (``implementation="native"``) is bit-exact against the reference
(sparse_copy, then ``dst[gather_rows]``) on random cases, including rows copied and gathered
at once, gathered twice and copied but not gathered, and refuses what the reference refuses
with nothing written.

Its first use in a session may build kvo's native ops (about a minute on two cores)."""

from __future__ import annotations

import pytest
import torch

from kvo_kernels import dispatch, ops
from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.reference import primitives as ref


def _native(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor,
            gather_rows: torch.Tensor, out: torch.Tensor) -> None:
    ops.sparse_copy_gather(src, dst, src_rows, dst_rows, gather_rows, out,
                           implementation="native")


def _case(seed: int, dtype: torch.dtype, index_dtype: torch.dtype, rows: int, hot: int,
          copies: int, gathered: int, width: tuple[int, ...]
          ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    src = (torch.randn(rows, *width, generator=gen) * 50).to(dtype)
    dst = (torch.randn(hot, *width, generator=gen) * 50).to(dtype)
    src_rows = torch.randint(0, rows, (copies,), generator=gen).to(index_dtype)
    dst_rows = torch.randperm(hot, generator=gen)[:copies].to(index_dtype)
    # Gather mostly copied rows (a decode step's misses) plus other hot rows, some twice.
    pool = torch.cat([dst_rows.to(torch.int64), torch.randint(0, hot, (hot,), generator=gen)])
    gather_rows = pool[torch.randint(0, pool.numel(), (gathered,), generator=gen)]
    out = torch.full((gathered, *width), 7, dtype=dtype)
    return src, dst, src_rows, dst_rows, gather_rows.to(index_dtype), out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", range(4))
def test_native_copy_gather_equals_the_reference(dtype: torch.dtype, index_dtype: torch.dtype,
                                                 seed: int) -> None:
    width = (3, 5) if seed % 2 else (576,)
    copies, gathered = (0, 30) if seed == 3 else (25 + seed, 40)
    src, dst, src_rows, dst_rows, gather_rows, out = _case(
        seed, dtype, index_dtype, rows=97, hot=64, copies=copies, gathered=gathered,
        width=width)
    dst_ref, out_ref = dst.clone(), out.clone()
    ref.sparse_copy_gather(src, dst_ref, src_rows, dst_rows, gather_rows, out_ref)
    _native(src, dst, src_rows, dst_rows, gather_rows, out)
    assert torch.equal(dst, dst_ref) and torch.equal(out, out_ref)
    assert torch.equal(dst[dst_rows.long()], src[src_rows.long()])   # the copies landed


def test_native_copy_gather_over_threads_equals_the_reference() -> None:
    """Above 16 MiB moved the op copies, then gathers, each over threads."""
    src, dst, src_rows, dst_rows, gather_rows, out = _case(
        5, torch.float32, torch.int64, rows=6000, hot=4096, copies=4000, gathered=4096,
        width=(576,))
    assert (src_rows.numel() + out.shape[0]) * 576 * 4 > 16 << 20
    dst_ref, out_ref = dst.clone(), out.clone()
    ref.sparse_copy_gather(src, dst_ref, src_rows, dst_rows, gather_rows, out_ref)
    _native(src, dst, src_rows, dst_rows, gather_rows, out)
    assert torch.equal(dst, dst_ref) and torch.equal(out, out_ref)


def test_native_copy_gather_reads_and_writes_strided_rows() -> None:
    pool = torch.arange(6 * 10, dtype=torch.float32).view(6, 10)
    src, dst = pool[:, 2:6], torch.zeros(8, 2, 4)[:, 1]
    out = torch.zeros(3, 3, 4)[:, 2]
    _native(src, dst, torch.tensor([5, 1]), torch.tensor([0, 7]), torch.tensor([7, 3, 0]), out)
    assert torch.equal(dst[0], pool[5, 2:6]) and torch.equal(dst[7], pool[1, 2:6])
    assert torch.equal(out, torch.stack([pool[1, 2:6], torch.zeros(4), pool[5, 2:6]]))


@pytest.mark.parametrize(("src_rows", "dst_rows", "gather_rows", "out_rows", "named"), [
    ([3], [0], [0], 1, "src_rows"), ([0], [2], [0], 1, "dst_rows"),
    ([0, 1], [1, 1], [0], 1, "dst_rows"), ([0, 1], [1], [0], 1, "dst_rows"),
    ([0], [0], [2], 1, "gather_rows"), ([0], [0], [-1], 1, "gather_rows"),
    ([0], [0], [0, 1], 1, "out")])
def test_native_copy_gather_refuses_what_the_reference_refuses_before_writing(
        src_rows: list[int], dst_rows: list[int], gather_rows: list[int], out_rows: int,
        named: str) -> None:
    for implementation in ("reference", "native"):
        src, dst, out = torch.ones(3, 2), torch.zeros(2, 2), torch.zeros(out_rows, 2)
        with pytest.raises(KernelArgumentError, match=named):
            ops.sparse_copy_gather(src, dst, torch.tensor(src_rows), torch.tensor(dst_rows),
                                   torch.tensor(gather_rows), out,
                                   implementation=implementation)
        assert torch.equal(dst, torch.zeros(2, 2)) and torch.equal(out, torch.zeros(out_rows, 2))


def test_native_copy_gather_refuses_mismatched_rows_dtypes_and_aliasing() -> None:
    one, zero = torch.tensor([0]), torch.tensor([0])
    with pytest.raises(KernelArgumentError, match="row shape"):
        _native(torch.ones(3, 2), torch.zeros(2, 2), one, zero, zero, torch.zeros(1, 3))
    with pytest.raises(KernelArgumentError, match="dtype"):
        _native(torch.ones(3, 2), torch.zeros(2, 2), one, zero, zero,
                torch.zeros(1, 2, dtype=torch.float64))
    dst = torch.zeros(4, 2)
    with pytest.raises(KernelArgumentError, match="overlaps dst"):
        _native(torch.ones(3, 2), dst, one, zero, zero, dst[3:])
    assert torch.equal(dst, torch.zeros(4, 2))


def test_native_copy_gather_is_chosen_only_when_forced_on_cpu() -> None:
    auto = dispatch.select("sparse_copy_gather", "cpu", choice="auto")
    assert auto.implementation == "reference"
    forced = dispatch.select("sparse_copy_gather", "cpu", choice="native")
    assert forced.implementation == "native" and forced.native_op is not None
