"""indexer_scores_triton against the reference.

Tolerance: both compute in fp32 from the same input values (bf16/fp16 products are exact in
fp32), so they differ only by summation order: |diff| <= 1e-5 * (1 + max |score|) per entry.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvo_triton_cases import DEVICES, randn, shapes_for

from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.reference import primitives as ref
from kvo_kernels.triton import indexer_scores_triton

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _assert_scores_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    bound = 1e-5 * (1.0 + float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=bound)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_scores_match_the_reference(device: str, dtype: torch.dtype) -> None:
    s = shapes_for(device)
    g = torch.Generator().manual_seed(11)
    query = randn(g, s.rows, s.indexer_heads, s.indexer_dim, dtype=dtype, device=device)
    weights = randn(g, s.rows, s.indexer_heads, dtype=dtype, device=device)
    keys = randn(g, s.keys, s.indexer_dim, dtype=dtype, device=device)
    expected = ref.indexer_scores(query, weights, keys)
    actual = indexer_scores_triton(query, weights, keys)
    _assert_scores_close(actual, expected)
    # The top-k the scores feed: a token may only differ where its score is within the
    # tolerance of the k-th best (a near-tie that rounding can flip).
    k = min(s.top_k, s.keys)
    lengths = torch.full((s.rows,), s.keys, dtype=torch.int64, device=device)
    chosen = ref.topk_indices(actual, k, lengths)
    wanted = ref.topk_indices(expected, k, lengths)
    kth = expected.gather(1, wanted[:, -1:])
    swapped = torch.stack([~torch.isin(c, w) for c, w in zip(chosen, wanted, strict=True)])
    slack = 2e-5 * (1.0 + float(expected.abs().max()))
    near_tie = (expected.gather(1, chosen) - kth).abs() <= slack
    assert bool((~swapped | near_tie).all())


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 9), heads=st.integers(1, 20), dim=st.integers(1, 200),
       keys=st.integers(1, 300), dtype=st.sampled_from(FLOATS), seed=st.integers(0, 2**31 - 1))
def test_random_shapes_on_the_interpreter(rows: int, heads: int, dim: int, keys: int,
                                          dtype: torch.dtype, seed: int) -> None:
    if DEVICES[0] != "cpu":
        pytest.skip("the kernels were compiled for the GPU (TRITON_INTERPRET is off)")
    g = torch.Generator().manual_seed(seed)
    query = randn(g, rows, heads, dim, dtype=dtype, device="cpu")
    weights = randn(g, rows, heads, dtype=dtype, device="cpu")
    key_rows = randn(g, keys, dim, dtype=dtype, device="cpu")
    _assert_scores_close(indexer_scores_triton(query, weights, key_rows),
                         ref.indexer_scores(query, weights, key_rows))


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_and_strided_inputs(device: str) -> None:
    g = torch.Generator().manual_seed(3)
    query = randn(g, 4, 6, 2, 32, dtype=torch.bfloat16, device=device)[:, :, 0]  # strided
    weights = randn(g, 4, 6, dtype=torch.float16, device=device)
    keys = randn(g, 80, 32, dtype=torch.float32, device=device)[::2]              # strided
    _assert_scores_close(indexer_scores_triton(query, weights, keys),
                         ref.indexer_scores(query, weights, keys))


def test_bad_arguments_name_the_argument() -> None:
    query = torch.zeros(2, 3, 8)
    with pytest.raises(KernelArgumentError, match="weights"):
        indexer_scores_triton(query, torch.zeros(2, 4), torch.zeros(5, 8))
    with pytest.raises(KernelArgumentError, match="keys"):
        indexer_scores_triton(query, torch.zeros(2, 3), torch.zeros(5, 7))
    with pytest.raises(KernelArgumentError, match="query has dtype int32"):
        indexer_scores_triton(query.int(), torch.zeros(2, 3), torch.zeros(5, 8))
    with pytest.raises(KernelArgumentError, match="query must have 3 dimensions"):
        indexer_scores_triton(query[0], torch.zeros(2, 3), torch.zeros(5, 8))
