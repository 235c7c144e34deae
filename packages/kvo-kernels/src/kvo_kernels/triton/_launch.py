"""What every Triton wrapper needs before a launch: where it may run, and block sizes.

Triton programs run on a GPU, or on the CPU only in Triton's interpreter, which must be switched
on (``TRITON_INTERPRET=1``) before ``triton.jit`` decorates the kernels, i.e. before this package
is imported. The flag is read once here, at import, for the same reason.
"""

from __future__ import annotations

import os

import torch

from kvo_kernels.errors import KernelUnsupportedError

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""The kernels were decorated in interpreter mode (CPU tensors only, numpy semantics)."""

MIN_DOT = 16
"""tl.dot needs every block dimension >= 16 on GPUs; smaller operands are padded by masking."""


def check_launchable(name: str, tensor: torch.Tensor) -> None:
    """Refuse a device the kernels cannot run on here, naming the argument and the fix."""
    if tensor.device.type == "cpu":
        if not INTERPRETING:
            raise KernelUnsupportedError(
                f"{name} is on cpu: Triton kernels run on the CPU only in Triton's interpreter; "
                "set TRITON_INTERPRET=1 before anything imports kvo_kernels.triton")
        return
    if INTERPRETING:
        raise KernelUnsupportedError(
            f"{name} is on {tensor.device}, but the kernels were built for Triton's CPU "
            "interpreter (TRITON_INTERPRET=1); unset it to run on the device")


def block(size: int, minimum: int = 1, maximum: int | None = None) -> int:
    """The power of two >= size (at least ``minimum``, at most ``maximum``)."""
    value = max(minimum, 1 << max(0, int(size) - 1).bit_length())
    return min(value, maximum) if maximum is not None else value


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether operands are converted to fp32 before ``tl.dot``.

    The interpreter computes bf16 products wrong without an error, so there everything is fp32.
    On a GPU, bf16/fp16 operands go to the tensor cores as they are (exact products, fp32
    accumulation); fp32 inputs stay fp32 with IEEE precision (no silent TF32 rounding).
    """
    return INTERPRETING or dtype == torch.float32
