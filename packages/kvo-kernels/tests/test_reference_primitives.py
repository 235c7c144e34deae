"""The reference primitives against explicit per-element definitions and hand-worked cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvo_kernels import ops
from kvo_kernels.errors import KernelArgumentError
from kvo_kernels.reference.primitives import (
    hadamard_matrix,
    hadamard_quant_int8,
    indexer_scores,
    sparse_copy,
    sparse_mla_attention,
    sparse_mla_attention_over_keys,
    topk_indices,
)


def test_indexer_scores_match_the_definition() -> None:
    g = torch.Generator().manual_seed(1)
    query, weights, keys = (torch.randn(3, 4, 8, generator=g), torch.randn(3, 4, generator=g),
                            torch.randn(5, 8, generator=g))
    got = indexer_scores(query.bfloat16(), weights, keys.bfloat16())
    q, k = query.bfloat16().float(), keys.bfloat16().float()
    for t in range(3):
        for s in range(5):
            want = sum(float(weights[t, h]) * max(0.0, float(q[t, h] @ k[s])) for h in range(4))
            assert got[t, s].item() == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert got.dtype == torch.float32


def test_topk_breaks_ties_by_lower_index_and_pads() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0],
                           [5.0, 5.0, 5.0, 5.0, 5.0],
                           [0.0, float("nan"), 1.0, 0.0, 9.0]])
    got = topk_indices(scores, 4, torch.tensor([5, 2, 4]))
    assert got.tolist() == [[1, 2, 4, 3],        # three 3.0 ties in index order
                            [0, 1, -1, -1],      # only two visible tokens
                            [2, 0, 3, 1]]        # 9.0 is past the visible length; NaN last


def test_topk_wider_than_the_keys() -> None:
    got = topk_indices(torch.tensor([[0.5, 2.0]]), 4, torch.tensor([2]))
    assert got.tolist() == [[1, 0, -1, -1]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-3, 3), min_size=1, max_size=12), st.integers(0, 14), st.data())
def test_topk_is_the_sorted_prefix(values: list[int], k: int, data: st.DataObject) -> None:
    length = data.draw(st.integers(0, len(values)))
    got = topk_indices(torch.tensor([values], dtype=torch.float32), k,
                       torch.tensor([length]))[0].tolist()
    ranked = sorted(range(length), key=lambda i: (-values[i], i))[:k]
    assert got == ranked + [-1] * (k - len(ranked))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(40, 300), st.integers(1, 12), st.data())
def test_topk_of_long_rows_is_the_sorted_prefix(rows: int, tokens: int, k: int,
                                                data: st.DataObject) -> None:
    """Rows much longer than k take the top-k path (not a whole-row sort): same indices in
    the same order, ties (few distinct values), NaN, -inf and short visible lengths included."""
    pool = [-2.0, -1.0, 0.0, 1.0, 2.0, float("nan"), -math.inf, math.inf]
    values = [data.draw(st.lists(st.sampled_from(pool), min_size=tokens, max_size=tokens))
              for _ in range(rows)]
    lengths = [data.draw(st.integers(0, tokens)) for _ in range(rows)]
    got = topk_indices(torch.tensor(values), k, torch.tensor(lengths)).tolist()
    for row, length, picked in zip(values, lengths, got, strict=True):
        ranked = [-math.inf if math.isnan(v) else v for v in row]
        order = sorted(range(length), key=lambda i: (-ranked[i], i))[:k]
        assert picked == order + [-1] * (k - len(order))


def _attention_by_hand(q, qr, kv, kr, slots, scale):  # type: ignore[no-untyped-def]
    out = torch.zeros(q.shape)
    for t in range(q.shape[0]):
        chosen = [s for s in slots[t].tolist() if s >= 0]
        for n in range(q.shape[1]):
            if not chosen:
                continue
            logits = [scale * float(q[t, n] @ kv[s] + qr[t, n] @ kr[s]) for s in chosen]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            out[t, n] = sum(w / total * kv[s] for w, s in zip(weights, chosen, strict=True))
    return out


def test_sparse_mla_attention_matches_the_definition() -> None:
    g = torch.Generator().manual_seed(2)
    q, qr = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 4, generator=g)
    kv, kr = torch.randn(7, 16, generator=g), torch.randn(7, 4, generator=g)
    slots = torch.tensor([[0, 6, 3, -1], [-1, -1, -1, -1], [2, 2, 5, 1]])
    got = sparse_mla_attention(q, qr, kv, kr, slots, 0.3)
    want = _attention_by_hand(q, qr, kv, kr, slots, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], torch.zeros(2, 16))  # no valid slot: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_gathered_keys_is_the_same_bits_as_over_the_cache(
        dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 16, generator=g).to(dtype)
    qr = torch.randn(3, 2, 4, generator=g).to(dtype)
    cache = torch.randn(9, 20, generator=g).to(dtype)     # latent 16 + rope 4, interleaved
    slots = torch.tensor([[0, 8, 3, -1], [-1, -1, -1, -1], [2, 2, 5, 1]])
    want = sparse_mla_attention(q, qr, cache[:, :16], cache[:, 16:], slots, 0.3)
    rows = cache[slots.clamp(min=0)]                      # [T, K, 20]
    got = sparse_mla_attention_over_keys(q, qr, rows[..., :16].contiguous(),
                                         rows[..., 16:].contiguous(), slots >= 0, 0.3)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("keys_latent", torch.zeros(3, 4, 32)[:, :, :16],
     r"keys_latent must be a contiguous \[3, 4, 16\]"),
    ("keys_rope", torch.zeros(3, 5, 4), r"keys_rope must be a contiguous \[3, 4, 4\]"),
    ("valid", torch.ones(3, 4, dtype=torch.int64), "valid"),
    ("query", torch.zeros(2, 2, 16), "query"),
])
def test_attention_over_gathered_keys_refuses_mismatched_shapes(field: str, value: torch.Tensor,
                                                                 words: str) -> None:
    args = {"query": torch.zeros(3, 2, 16), "query_rope": torch.zeros(3, 2, 4),
            "keys_latent": torch.zeros(3, 4, 16), "keys_rope": torch.zeros(3, 4, 4),
            "valid": torch.ones(3, 4, dtype=torch.bool), field: value}
    with pytest.raises(KernelArgumentError, match=words):
        sparse_mla_attention_over_keys(**args, scale=0.3)


def test_sparse_mla_attention_keeps_the_query_dtype() -> None:
    q = torch.randn(1, 1, 8).bfloat16()
    out = sparse_mla_attention(q, torch.randn(1, 1, 2).bfloat16(), torch.randn(3, 8).bfloat16(),
                               torch.randn(3, 2).bfloat16(), torch.tensor([[0, 2]]), 1.0)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float32])
def test_sparse_copy_copies_rows_exactly(dtype: torch.dtype) -> None:
    src = torch.arange(24).reshape(6, 2, 2).to(dtype)
    dst = torch.zeros(4, 2, 2, dtype=dtype)
    sparse_copy(src, dst, torch.tensor([5, 0, 3]), torch.tensor([1, 3, 0], dtype=torch.int32))
    assert torch.equal(dst[1], src[5]) and torch.equal(dst[3], src[0])
    assert torch.equal(dst[0], src[3]) and torch.equal(dst[2], torch.zeros(2, 2, dtype=dtype))


def test_sparse_copy_op_and_empty_lists() -> None:
    src, dst = torch.ones(3, 4), torch.zeros(2, 4)
    ops.sparse_copy(src, dst, torch.tensor([], dtype=torch.int64),
                    torch.tensor([], dtype=torch.int64))
    assert torch.equal(dst, torch.zeros(2, 4))
    ops.sparse_copy(src, dst, torch.tensor([2]), torch.tensor([1]))
    assert torch.equal(dst[1], torch.ones(4))


@pytest.mark.parametrize(("src_rows", "dst_rows", "named"), [
    ([3], [0], "src_rows"), ([-1], [0], "src_rows"), ([0], [2], "dst_rows"),
    ([0, 1], [1, 1], "dst_rows")])
def test_sparse_copy_rejects_bad_rows_before_writing(src_rows: list[int], dst_rows: list[int],
                                                     named: str) -> None:
    src, dst = torch.ones(3, 2), torch.zeros(2, 2)
    with pytest.raises(KernelArgumentError, match=named):
        sparse_copy(src, dst, torch.tensor(src_rows), torch.tensor(dst_rows))
    assert torch.equal(dst, torch.zeros(2, 2))


def test_hadamard_matrix_is_orthogonal() -> None:
    h = hadamard_matrix(64)
    torch.testing.assert_close(h @ h.T, torch.eye(64), rtol=0, atol=1e-6)
    with pytest.raises(KernelArgumentError, match="power of two"):
        hadamard_matrix(48)


def test_hadamard_quant_int8_round_trip() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 128, generator=g)
    x[0, 0, 7] = 40.0  # an outlier: the rotation spreads it across the row
    q, scale = hadamard_quant_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16
    assert q.shape == x.shape and scale.shape == (5, 3, 1)
    assert int(q.abs().max()) == 127
    restored = (q.float() * scale.float()) @ hadamard_matrix(128).T
    # Per element the error is at most half a quantisation step (scale / 2), rotated back.
    err = (restored - x).norm(dim=-1) / x.norm(dim=-1)
    assert float(err.max()) < 0.02
    q_op, scale_op = ops.hadamard_quant_int8(x)
    assert torch.equal(q_op, q) and torch.equal(scale_op, scale)


def test_hadamard_quant_int8_zero_row_and_bad_input() -> None:
    q, scale = hadamard_quant_int8(torch.zeros(2, 8))
    assert torch.equal(q, torch.zeros(2, 8, dtype=torch.int8))
    assert torch.equal(scale, torch.zeros(2, 1, dtype=torch.float16))
    with pytest.raises(KernelArgumentError, match="x contains inf or NaN"):
        hadamard_quant_int8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(KernelArgumentError, match="x has dtype int32"):
        hadamard_quant_int8(torch.ones(2, 4, dtype=torch.int32))


@pytest.mark.parametrize(("call", "named"), [
    (lambda: indexer_scores(torch.ones(2, 3, 4), torch.ones(2, 2), torch.ones(5, 4)),
     "weights.shape"),
    (lambda: indexer_scores(torch.ones(2, 3, 4), torch.ones(2, 3), torch.ones(5, 3)),
     "keys.shape"),
    (lambda: topk_indices(torch.ones(2, 3), 2, torch.tensor([1, 4])), "valid_lengths"),
    (lambda: topk_indices(torch.ones(2, 3), -1, torch.tensor([1, 1])), "k must"),
    (lambda: sparse_mla_attention(torch.ones(1, 1, 4), torch.ones(1, 1, 2), torch.ones(3, 4),
                                  torch.ones(3, 2), torch.tensor([[3]]), 1.0), "slots"),
    (lambda: sparse_mla_attention(torch.ones(1, 1, 4), torch.ones(1, 1, 2), torch.ones(3, 4),
                                  torch.ones(3, 2), torch.tensor([[0]]), float("nan")), "scale"),
    (lambda: sparse_copy(torch.ones(3, 2), torch.zeros(2, 3), torch.tensor([0]),
                         torch.tensor([0])), "row shape"),
])
def test_primitives_name_the_bad_argument(call, named: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KernelArgumentError, match=named):
        call()


def test_nan_ties_with_minus_inf_and_plus_inf_stays_best() -> None:
    """A NaN counts as -inf (documented), so it ties with a real -inf and the lower index wins;
    +inf and -inf keep their values (torch.nan_to_num alone would turn them into the largest
    and smallest finite floats, ranking a real -inf above every NaN)."""
    scores = torch.tensor([[1.0, -math.inf, math.nan, math.inf, -math.inf, 2.0]])
    got = topk_indices(scores, 6, torch.tensor([6])).tolist()
    assert got == [[3, 5, 0, 1, 2, 4]]
