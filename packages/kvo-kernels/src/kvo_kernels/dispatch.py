"""Which implementation runs an op: chosen by the tensors' device, or forced.

Automatic choice:
- NPU tensors: the native Ascend op when vllm-ascend registered it
  (``torch.ops._C_ascend.npu_fused_*``), else Triton (triton-ascend) when importable, else the
  reference;
- CUDA tensors: Triton when importable, else the reference;
- anything else (CPU): the reference. kvo's own C++ host ops of ``sparse_copy`` and
  ``sparse_copy_gather`` (``kvo_kernels.host_copy``) run CPU tensors when ``native`` is forced;
  they are not chosen automatically, since their first use may compile kvo's native ops.

Forcing, strongest first: the ``implementation=`` argument of a wrapper (or the
``use_implementation`` context), then the ``KVO_KERNELS_IMPL`` environment variable; values
``auto``, ``reference``, ``triton``, ``native``. Forcing Triton on CPU needs Triton's
interpreter (``TRITON_INTERPRET=1`` before anything imports triton). The native lookup is
injectable (``native_lookup=`` / ``set_native_lookup``), so the selection is testable
without Ascend.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator

import attrs
import torch

from kvo_kernels.errors import KernelArgumentError, KernelUnsupportedError

ENV_VAR = "KVO_KERNELS_IMPL"
CHOICES = ("auto", "reference", "triton", "native")
NATIVE_OPS = {
    "lightning_indexer_manage": "npu_fused_lightning_indexer_manage",
    "quant_lightning_indexer_manage": "npu_fused_quant_lightning_indexer_manage",
    "scatter_copy_sparse_flash_attention": "npu_fused_scatter_copy_sparse_flash_attention",
}
TRITON_OPS = frozenset({"lightning_indexer_manage", "quant_lightning_indexer_manage",
                        "scatter_copy_sparse_flash_attention", "sparse_copy"})
HOST_NATIVE_OPS = frozenset({"sparse_copy", "sparse_copy_gather"})
"""Ops with a C++ implementation of kvo's own for CPU tensors (``native`` forced)."""
OPS = frozenset({*NATIVE_OPS, *TRITON_OPS, *HOST_NATIVE_OPS, "hadamard_quant_int8"})
NPU_DEVICE_TYPES = frozenset({"npu", "privateuseone"})

NativeLookup = Callable[[str], Callable[..., object] | None]
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvo_forced", default=None)


def torch_ops_native_lookup(name: str) -> Callable[..., object] | None:
    """``torch.ops._C_ascend.<name>`` when registered (vllm-ascend's extension), else None."""
    try:
        return getattr(torch.ops._C_ascend, name)  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):
        return None


_native_lookup: NativeLookup = torch_ops_native_lookup


def set_native_lookup(lookup: NativeLookup) -> NativeLookup:
    """Replace how native ops are found (tests); returns the previous lookup."""
    global _native_lookup
    previous, _native_lookup = _native_lookup, lookup
    return previous


@functools.cache
def triton_available() -> bool:
    """Whether Triton is importable; looked up once per process, because ``select`` runs on
    every op call and a module search stats the file system (~3 ms each on a busy host)."""
    return importlib.util.find_spec("triton") is not None


@attrs.frozen
class Selection:
    implementation: str           # "reference" | "triton" | "native"
    reason: str
    native_op: Callable[..., object] | None = None


def _check_choice(name: str, value: str) -> str:
    if value not in CHOICES:
        raise KernelArgumentError(f"{name} is {value!r}; allowed: {', '.join(CHOICES)}")
    return value


@contextlib.contextmanager
def use_implementation(choice: str | None) -> Iterator[None]:
    """Force an implementation inside the block (None leaves the current choice)."""
    if choice is None:
        yield
        return
    token = _forced.set(_check_choice("implementation", choice))
    try:
        yield
    finally:
        _forced.reset(token)


def forced_choice() -> str:
    """The forced implementation: context first, then the environment, else ``auto``."""
    context = _forced.get()
    if context is not None:
        return context
    return _check_choice(ENV_VAR, os.environ.get(ENV_VAR, "auto").strip().lower() or "auto")


def select(op: str, device_type: str, *, choice: str | None = None,
           native_lookup: NativeLookup | None = None,
           triton_importable: bool | None = None) -> Selection:
    """Pick the implementation of ``op`` for tensors on ``device_type`` (module docstring)."""
    if op not in OPS:
        raise KernelArgumentError(f"unknown op {op!r}; known: {', '.join(sorted(OPS))}")
    choice = _check_choice("implementation", choice) if choice is not None else forced_choice()
    lookup = native_lookup or _native_lookup
    has_triton = triton_available() if triton_importable is None else triton_importable
    native = lookup(NATIVE_OPS[op]) if op in NATIVE_OPS else None
    on_npu = device_type in NPU_DEVICE_TYPES

    if choice == "reference":
        return Selection("reference", "forced")
    if choice == "native":
        if device_type == "cpu" and op in HOST_NATIVE_OPS:
            from kvo_kernels import host_copy
            host_op = (host_copy.sparse_copy_host if op == "sparse_copy"
                       else host_copy.sparse_copy_gather_host)
            return Selection("native", "forced, kvo's C++ host op", host_op)
        if native is None:
            raise KernelUnsupportedError(
                f"native implementation of {op} forced, but "
                f"torch.ops._C_ascend.{NATIVE_OPS.get(op, '<none>')} is not registered "
                "(it comes with a vllm-ascend build that includes the fused offload ops)")
        if not on_npu:
            raise KernelUnsupportedError(
                f"native implementation of {op} forced for {device_type} tensors; "
                "the _C_ascend ops run on NPU tensors only")
        return Selection("native", "forced", native)
    if choice == "triton":
        if op not in TRITON_OPS:
            return Selection("reference", f"forced triton, but {op} has no Triton kernel")
        _require_triton(op, device_type, has_triton)
        return Selection("triton", "forced")
    # auto
    if on_npu and native is not None:
        return Selection("native", f"torch.ops._C_ascend.{NATIVE_OPS[op]} is registered", native)
    if (on_npu or device_type == "cuda") and op in TRITON_OPS and has_triton:
        return Selection("triton", f"{device_type} tensors and triton is importable")
    return Selection("reference", f"{device_type} tensors")


def _require_triton(op: str, device_type: str, has_triton: bool) -> None:
    if not has_triton:
        raise KernelUnsupportedError(
            f"Triton forced for {op}, but triton is not installed "
            "(pip install 'kvo-kernels[triton]')")
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise KernelUnsupportedError(
            f"Triton forced for {op} on CPU tensors: set TRITON_INTERPRET=1 before Python "
            "imports triton (Triton runs on CPU only in its interpreter)")
