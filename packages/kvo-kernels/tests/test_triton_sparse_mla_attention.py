"""sparse_mla_attention_triton against the reference.

Tolerances (stated): fp32 inputs |diff| <= 1e-5 (fp32 rounding of a different summation order).
bf16/fp16 outputs are rounded to the input dtype, so a 1-ulp flip is allowed: 1e-2 (bf16) and
2e-3 (fp16) absolute + relative; on a GPU the probabilities also enter the value product in the
input dtype, which stays within the same bound.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvo_triton_cases import DEVICES, randn, shapes_for

from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.reference import primitives as ref
from kvo_kernels.triton import sparse_mla_attention_triton

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _inputs(g: torch.Generator, rows: int, heads: int, latent: int, rope: int, capacity: int,
            dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    return (randn(g, rows, heads, latent, dtype=dtype, device=device, scale=0.5),
            randn(g, rows, heads, rope, dtype=dtype, device=device, scale=0.5),
            randn(g, capacity, latent, dtype=dtype, device=device),
            randn(g, capacity, rope, dtype=dtype, device=device))


def _check(query: torch.Tensor, query_rope: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor,
           slots: torch.Tensor, scale: float) -> torch.Tensor:
    actual = sparse_mla_attention_triton(query, query_rope, kv, k_rope, slots, scale)
    expected = ref.sparse_mla_attention(query, query_rope, kv, k_rope, slots, scale)
    assert actual.dtype == query.dtype and actual.shape == query.shape
    tol = TOLERANCE[query.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)
    return actual


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_attention_matches_the_reference(device: str, dtype: torch.dtype) -> None:
    s = shapes_for(device)
    g = torch.Generator().manual_seed(5)
    query, query_rope, kv, k_rope = _inputs(g, s.rows, s.heads, s.latent, s.rope, s.capacity,
                                            dtype, device)
    # Each row selects top_k distinct slots; ~10% padding (-1) at the end, as top-k pads.
    slots = torch.stack([torch.randperm(s.capacity, generator=g)[:s.top_k]
                         for _ in range(s.rows)])
    slots[:, s.top_k - s.top_k // 10:] = -1
    slots[s.rows - 1] = -1                      # a row with nothing selected gives zeros
    slots[0, 1] = slots[0, 0]                   # a slot listed twice counts twice
    out = _check(query, query_rope, kv, k_rope, slots.to(device), (s.latent + s.rope) ** -0.5)
    assert not out[-1].any()
    assert out[0].abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_equals_dense_attention_over_the_selected_rows(device: str) -> None:
    """Attention over hot-buffer slots = dense attention over the same rows, copied out."""
    s = shapes_for(device)
    g = torch.Generator().manual_seed(9)
    query, query_rope, kv, k_rope = _inputs(g, 1, s.heads, s.latent, s.rope, s.capacity,
                                            torch.float32, device)
    slots = torch.randperm(s.capacity, generator=g)[:s.top_k].to(device)[None, :]
    keys = torch.cat([kv, k_rope], dim=1)[slots[0]]                       # [K, Dl + Dr]
    logits = torch.cat([query, query_rope], dim=2)[0] @ keys.T * 0.1     # [N, K]
    dense = (torch.softmax(logits, dim=-1) @ kv[slots[0]])[None]
    actual = sparse_mla_attention_triton(query, query_rope, kv, k_rope, slots, 0.1)
    torch.testing.assert_close(actual, dense, rtol=1e-5, atol=1e-5)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 6), heads=st.integers(1, 9), latent=st.integers(1, 70),
       rope=st.integers(1, 20), capacity=st.integers(1, 60), width=st.integers(1, 140),
       dtype=st.sampled_from(list(TOLERANCE)), int32_slots=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_random_shapes_on_the_interpreter(rows: int, heads: int, latent: int, rope: int,
                                          capacity: int, width: int, dtype: torch.dtype,
                                          int32_slots: bool, seed: int) -> None:
    if DEVICES[0] != "cpu":
        pytest.skip("the kernels were compiled for the GPU (TRITON_INTERPRET is off)")
    g = torch.Generator().manual_seed(seed)
    tensors = _inputs(g, rows, heads, latent, rope, capacity, dtype, "cpu")
    slots = torch.randint(-1, capacity, (rows, width), generator=g)
    _check(*tensors, slots.to(torch.int32) if int32_slots else slots, 0.3)


def test_bad_arguments_name_the_argument() -> None:
    query, query_rope = torch.zeros(2, 3, 8), torch.zeros(2, 3, 4)
    kv, k_rope = torch.zeros(5, 8), torch.zeros(5, 4)
    slots = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(KernelArgumentError, match="slots"):
        sparse_mla_attention_triton(query, query_rope, kv, k_rope, slots + 5, 1.0)
    with pytest.raises(KernelArgumentError, match="slots"):
        sparse_mla_attention_triton(query, query_rope, kv, k_rope, slots - 2, 1.0)
    with pytest.raises(KernelArgumentError, match="k_rope"):
        sparse_mla_attention_triton(query, query_rope, kv, torch.zeros(6, 4), slots, 1.0)
    with pytest.raises(KernelArgumentError, match="kv"):
        sparse_mla_attention_triton(query, query_rope, torch.zeros(5, 7), k_rope, slots, 1.0)
    with pytest.raises(KernelArgumentError, match="scale"):
        sparse_mla_attention_triton(query, query_rope, kv, k_rope, slots, float("nan"))
    with pytest.raises(KernelArgumentError, match="slots has dtype float32"):
        sparse_mla_attention_triton(query, query_rope, kv, k_rope, slots.float(), 1.0)
