"""sparse_copy_triton against the reference: bit-exact for every dtype, same errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvo_triton_cases import DEVICES, shapes_for

from kvo_kernels.errors import KernelArgumentError, KernelUnsupportedError
from kvo_kernels.reference import primitives as ref
from kvo_kernels.triton import _launch, sparse_copy_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool]


def _random_rows(generator: torch.Generator, rows: int, row_shape: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor:
    """Random bit patterns (NaNs and all) so that any conversion would show."""
    raw = torch.randint(-128, 128, (rows, *row_shape, torch.empty((), dtype=dtype).element_size()),
                        generator=generator, dtype=torch.int8)
    return raw.view(dtype).reshape(rows, *row_shape) if dtype != torch.bool else raw[..., 0] > 0


def _bytes(a: torch.Tensor) -> torch.Tensor:
    dense = torch.empty(a.shape, dtype=a.dtype, device=a.device).copy_(a)  # fresh strides
    return dense.reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _copy_both(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
               dst_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    expected, actual = dst.clone(), dst.clone()
    ref.sparse_copy(src, expected, src_rows, dst_rows)
    sparse_copy_triton(src, actual, src_rows, dst_rows)
    return expected, actual


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_miss_rows_copied_bit_exactly(device: str, dtype: torch.dtype) -> None:
    shapes = shapes_for(device)
    g = torch.Generator().manual_seed(7)
    row_shape = (1, shapes.latent + shapes.rope)  # one MLA cache row: latent + rope
    src = _random_rows(g, shapes.keys, row_shape, dtype).to(device)
    dst = _random_rows(g, shapes.capacity, row_shape, dtype).to(device)
    misses = max(1, shapes.top_k * 15 // 100)
    src_rows = torch.randperm(shapes.keys, generator=g)[:misses].to(device)
    dst_rows = torch.randperm(shapes.capacity, generator=g)[:misses].to(device)
    expected, actual = _copy_both(src, dst, src_rows, dst_rows)
    assert _same_bits(actual, expected)
    assert not _same_bits(actual, dst)  # the copy did change the destination


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_random_shapes_strides_and_index_dtypes(device: str, data: st.DataObject) -> None:
    src_count = data.draw(st.integers(1, 40), label="src rows")
    dst_count = data.draw(st.integers(1, 40), label="dst rows")
    row_shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=0, max_size=2),
                                label="row shape"))
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    count = data.draw(st.integers(0, min(src_count, dst_count)), label="copies")
    index_dtype = data.draw(st.sampled_from([torch.int32, torch.int64]), label="index dtype")
    row_step = data.draw(st.integers(1, 3), label="row stride multiple")
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    # Rows of a strided view (every row_step-th row of a bigger tensor) stay contiguous runs.
    src = _random_rows(g, src_count * row_step, row_shape, dtype).to(device)[::row_step]
    dst_base = _random_rows(g, dst_count * row_step, row_shape, dtype).to(device)
    dst = dst_base[::row_step]
    src_rows = torch.randint(0, src_count, (count,), generator=g).to(index_dtype).to(device)
    dst_rows = torch.randperm(dst_count, generator=g)[:count].to(index_dtype).to(device)
    expected = dst.clone()
    ref.sparse_copy(src, expected, src_rows, dst_rows)
    untouched = dst_base.clone()
    sparse_copy_triton(src, dst, src_rows, dst_rows)
    assert _same_bits(dst, expected)
    if row_step > 1:  # the rows between the view's rows were not written
        assert _same_bits(dst_base[1::row_step], untouched[1::row_step])


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_name_the_argument(device: str) -> None:
    src = torch.zeros(4, 3, device=device)
    dst = torch.zeros(5, 3, device=device)
    rows = torch.tensor([0, 1], device=device)
    with pytest.raises(KernelArgumentError, match="src_rows"):
        sparse_copy_triton(src, dst, torch.tensor([0, 4], device=device), rows)
    with pytest.raises(KernelArgumentError, match="dst_rows"):
        sparse_copy_triton(src, dst, rows, torch.tensor([5, 0], device=device))
    with pytest.raises(KernelArgumentError, match="repeats"):
        sparse_copy_triton(src, dst, rows, torch.tensor([1, 1], device=device))
    with pytest.raises(KernelArgumentError, match="dtype"):
        sparse_copy_triton(src, dst.half(), rows, rows)
    with pytest.raises(KernelArgumentError, match="row shape"):
        sparse_copy_triton(src, torch.zeros(5, 4, device=device), rows, rows)
    with pytest.raises(KernelArgumentError, match="src_rows has dtype float32"):
        sparse_copy_triton(src, dst, rows.float(), rows)
    with pytest.raises(KernelArgumentError, match="dst rows are not contiguous"):
        sparse_copy_triton(src, torch.zeros(3, 5, device=device).t(), rows, rows)
    # Nothing was written by any of the refused calls.
    assert not dst.any()


def test_empty_copy_is_a_no_op() -> None:
    dst = torch.ones(3, 2)
    empty = torch.empty(0, dtype=torch.int64)
    sparse_copy_triton(torch.zeros(2, 2), dst, empty, empty)
    assert torch.equal(dst, torch.ones(3, 2))


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "INTERPRETING", False)
    rows = torch.tensor([0])
    with pytest.raises(KernelUnsupportedError, match="TRITON_INTERPRET=1"):
        sparse_copy_triton(torch.zeros(2, 2), torch.zeros(2, 2), rows, rows)

