"""Boundary checks shared by every op: each failure names the argument and what is allowed.

They run before any indexing so that bad metadata raises instead of reading or writing out of
bounds. Index checks read the index tensor's min/max (one small host sync); that is the price of
never touching memory outside a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvo_kernels.errors import KernelArgumentError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def ndim(name: str, value: torch.Tensor, dims: int, layout: str) -> None:
    tensor(name, value)
    if value.dim() != dims:
        raise KernelArgumentError(
            f"{name} must have {dims} dimensions {layout}, got shape {tuple(value.shape)}")


def dtype(name: str, value: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if value.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise KernelArgumentError(
            f"{name} has dtype {str(value.dtype).removeprefix('torch.')}; allowed: {names}")


def dim_size(name: str, value: torch.Tensor, dim: int, expected: int, what: str) -> None:
    if value.shape[dim] != expected:
        raise KernelArgumentError(
            f"{name}.shape[{dim}] is {value.shape[dim]} but must equal {what} ({expected}); "
            f"shape {tuple(value.shape)}")


def same_device(reference_name: str, reference: torch.Tensor,
                **others: torch.Tensor) -> None:
    for name, value in others.items():
        if value.device != reference.device:
            raise KernelArgumentError(
                f"{name} is on {value.device} but {reference_name} is on {reference.device}; "
                "all tensors of this op must be on one device")


def index_range(name: str, value: torch.Tensor, low: int, high: int,
                allow_pad: bool = False) -> None:
    """Every entry in [low, high), or -1 where padding is allowed."""
    if value.numel() == 0:
        return
    smallest_any, largest_any = (int(bound) for bound in torch.aminmax(value))
    if largest_any < high and (smallest_any >= low or (allow_pad and low == 0
                                                       and smallest_any == -1)):
        return  # one pass; with low 0, -1 is the only value below low that may appear
    entries = value[value != -1] if allow_pad else value
    if entries.numel() == 0:
        return
    smallest, largest = int(entries.min()), int(entries.max())
    if smallest < low or largest >= high:
        pad = " or -1 (padding)" if allow_pad else ""
        raise KernelArgumentError(
            f"{name} has entries in [{smallest}, {largest}]; allowed: [{low}, {high}){pad}")


def positive(name: str, value: int, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KernelArgumentError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise KernelArgumentError(f"{name} must be {bound}, got {value}")
