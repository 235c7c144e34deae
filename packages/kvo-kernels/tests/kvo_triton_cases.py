"""Shared set-up of the Triton tests: which devices run, at which shapes.

On the CPU the kernels run in Triton's interpreter (``conftest.py`` switches it on), which costs
~0.25 ms per program, so shapes are small; on a CUDA device the same tests run at production
shapes (top-k 2048, 64 indexer heads, latent 512 + rope 64, 8 requests x 4 query rows).
"""

from __future__ import annotations

import attrs
import pytest
import torch

triton_kernels = pytest.importorskip(
    "kvo_kernels.triton", reason="Triton is not installed (pip install 'kvo-kernels[triton]')")


@attrs.frozen
class Shapes:
    rows: int            # query rows T
    heads: int           # attention heads N
    indexer_heads: int   # indexer heads H
    indexer_dim: int     # indexer head dim D
    keys: int            # cached tokens S scored by the indexer
    latent: int          # Dl
    rope: int            # Dr
    capacity: int        # hot-buffer rows C
    top_k: int           # K


# Deliberately not powers of two on the CPU, so every mask in the kernels is exercised.
SMALL = Shapes(rows=5, heads=5, indexer_heads=3, indexer_dim=40, keys=70, latent=40, rope=12,
               capacity=53, top_k=37)
PRODUCTION = Shapes(rows=32, heads=128, indexer_heads=64, indexer_dim=128, keys=32768,
                    latent=512, rope=64, capacity=8192, top_k=2048)


def _device_param(name: str) -> object:
    if name == "cpu" and not triton_kernels.INTERPRETING:
        reason = "the kernels were compiled for the GPU (TRITON_INTERPRET is off on this machine)"
        return pytest.param("cpu", marks=pytest.mark.skip(reason=reason))
    if name == "cuda" and not torch.cuda.is_available():
        return pytest.param("cuda", marks=pytest.mark.skip(reason="no CUDA device here"))
    if name == "cuda" and triton_kernels.INTERPRETING:
        reason = "TRITON_INTERPRET=1 forces the interpreter, which runs CPU tensors only"
        return pytest.param("cuda", marks=pytest.mark.skip(reason=reason))
    return name


DEVICES = [_device_param("cpu"), _device_param("cuda")]


def shapes_for(device: str) -> Shapes:
    return SMALL if device == "cpu" else PRODUCTION


def randn(generator: torch.Generator, *shape: int, dtype: torch.dtype, device: str,
          scale: float = 1.0) -> torch.Tensor:
    """Random normal values made on the CPU (reproducible), then moved."""
    return (torch.randn(*shape, generator=generator) * scale).to(dtype=dtype, device=device)
