# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels: @triton.jit is untyped and kernel parameters are pointers and constexprs.)
"""``sparse_copy_triton``: ``dst[dst_rows[i]] = src[src_rows[i]]`` as one Triton launch.

The miss rows of a decode step are scattered over the host pool and land scattered in the hot
buffer; one program moves a tile of (rows x elements). Rows are moved as raw bits (the tensors
are viewed as same-width integers), so the copy is bit-exact for every dtype, and the
interpreter's bf16 arithmetic never touches the data.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.reference.primitives import check_sparse_copy_args
from kvo_kernels.triton._launch import INTERPRETING, block, check_launchable

_BITS_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TILE_ELEMENTS = 16384 if INTERPRETING else 4096
"""Elements per program: large in the interpreter (each program costs ~0.25 ms there), small
enough on a GPU to stay in registers."""


@triton.jit
def _sparse_copy_kernel(src_ptr, dst_ptr, src_rows_ptr, dst_rows_ptr, num_rows, row_numel,
                        src_row_stride, dst_row_stride,
                        BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    row_block = tl.program_id(0)
    col_block = tl.program_id(1)
    rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = (col_block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)).to(tl.int64)
    row_ok = rows < num_rows
    src_index = tl.load(src_rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    dst_index = tl.load(dst_rows_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    mask = row_ok[:, None] & (cols[None, :] < row_numel)
    values = tl.load(src_ptr + src_index[:, None] * src_row_stride + cols[None, :], mask=mask)
    tl.store(dst_ptr + dst_index[:, None] * dst_row_stride + cols[None, :], values, mask=mask)


def _row_view(name: str, value: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor as [rows, row_numel] same-width integers, and its row stride (in elements).

    Each row must be one contiguous run (any row stride), as pool and hot-buffer rows are.
    """
    bits = _BITS_BY_SIZE.get(value.element_size())
    if bits is None:
        raise KernelArgumentError(
            f"{name} has dtype {value.dtype} ({value.element_size()} bytes per element); "
            "allowed: element sizes 1, 2, 4, 8")
    row_shape = value.shape[1:]
    expected = 1
    for size, stride in zip(reversed(row_shape), reversed(value.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            raise KernelArgumentError(
                f"{name} rows are not contiguous (strides {tuple(value.stride())} for shape "
                f"{tuple(value.shape)}); each row must be one contiguous run")
        expected *= size
    row_numel = math.prod(row_shape)
    flat = value.view(bits).as_strided((value.shape[0], row_numel), (value.stride(0), 1))
    return flat, value.stride(0)


def sparse_copy_triton(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                       dst_rows: torch.Tensor) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` in place, bit-exact; see the reference.

    src [S, ...], dst [D, ...] with the same row shape and dtype, on one device; indices [M]
    int32/int64, bounds-checked, ``dst_rows`` without repeats.
    """
    check_sparse_copy_args(src, dst, src_rows, dst_rows, one_device=True)
    check_launchable("src", src)
    count = src_rows.shape[0]
    if count == 0 or src.numel() == 0:
        return
    src_flat, src_stride = _row_view("src", src)
    dst_flat, dst_stride = _row_view("dst", dst)
    row_numel = src_flat.shape[1]
    block_cols = block(row_numel, maximum=_TILE_ELEMENTS)
    block_rows = block(count, maximum=max(1, _TILE_ELEMENTS // block_cols))
    grid = (triton.cdiv(count, block_rows), triton.cdiv(row_numel, block_cols))
    _sparse_copy_kernel[grid](src_flat, dst_flat, src_rows.contiguous(), dst_rows.contiguous(),
                              count, row_numel, src_stride, dst_stride,
                              BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols)
