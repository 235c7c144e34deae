# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels: @triton.jit is untyped and kernel parameters are pointers and constexprs.)
"""``indexer_scores_triton``: lightning-indexer scores ``sum_h w[t,h] * relu(q[t,h] . k[s])``.

One program scores a block of keys for a block of query rows: the (row, head) pairs form the M
side of one ``tl.dot`` over the head dimension (in chunks), then ReLU and the weighted sum over
heads. Accumulation is
fp32; see ``_launch.dot_in_fp32`` for the operand precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvo_kernels import _checks as check
from kvo_kernels.triton._launch import INTERPRETING, MIN_DOT, block, check_launchable, dot_in_fp32


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, k_ptr, out_ptr, num_rows, heads, num_keys, dim,
                           stride_qt, stride_qh, stride_qd, stride_wt, stride_wh,
                           stride_ks, stride_kd, stride_ot, stride_os,
                           BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                           CAST_FP32: tl.constexpr):
    # The (row, head) pairs of BLOCK_T rows are the M side of one dot: [T*H, D] x [D, S].
    pair = tl.arange(0, BLOCK_T * BLOCK_H)
    t = tl.program_id(0) * BLOCK_T + pair // BLOCK_H
    head = pair % BLOCK_H
    pair_ok = (t < num_rows) & (head < heads)
    t64 = t.to(tl.int64)
    keys = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    key_ok = keys < num_keys
    d = tl.arange(0, BLOCK_D)
    dots = tl.zeros([BLOCK_T * BLOCK_H, BLOCK_S], dtype=tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        dims = d0 + d
        dim_ok = dims < dim
        q = tl.load(q_ptr + t64[:, None] * stride_qt + head[:, None] * stride_qh
                    + dims[None, :] * stride_qd,
                    mask=pair_ok[:, None] & dim_ok[None, :], other=0.0)        # [T*H, D]
        k = tl.load(k_ptr + keys[None, :].to(tl.int64) * stride_ks + dims[:, None] * stride_kd,
                    mask=key_ok[None, :] & dim_ok[:, None], other=0.0)         # [D, S]
        if CAST_FP32:
            q = q.to(tl.float32)
            k = k.to(tl.float32)
        dots = tl.dot(q, k, dots, input_precision="ieee")
    w = tl.load(w_ptr + t64 * stride_wt + head * stride_wh, mask=pair_ok, other=0.0)
    weighted = tl.maximum(dots, 0.0) * w.to(tl.float32)[:, None]
    score = tl.sum(tl.reshape(weighted, [BLOCK_T, BLOCK_H, BLOCK_S]), axis=1)  # [T, S]
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_ot + keys[None, :] * stride_os, score,
             mask=(rows < num_rows)[:, None] & key_ok[None, :])


def indexer_scores_triton(query: torch.Tensor, weights: torch.Tensor,
                          keys: torch.Tensor) -> torch.Tensor:
    """Scores [T, S] float32 from query [T, H, D], weights [T, H], keys [S, D]; see the reference.

    Agrees with ``reference.indexer_scores`` to fp32 rounding (summation order differs).
    """
    check.ndim("query", query, 3, "[T, H, D]")
    check.ndim("weights", weights, 2, "[T, H]")
    check.ndim("keys", keys, 2, "[S, D]")
    for name, value in (("query", query), ("weights", weights), ("keys", keys)):
        check.dtype(name, value, check.FLOAT_DTYPES)
    check.same_device("query", query, weights=weights, keys=keys)
    check.dim_size("weights", weights, 0, query.shape[0], "query.shape[0] (T)")
    check.dim_size("weights", weights, 1, query.shape[1], "query.shape[1] (H)")
    check.dim_size("keys", keys, 1, query.shape[2], "query.shape[2] (D)")
    check_launchable("query", query)
    rows, heads, dim = query.shape
    num_keys = keys.shape[0]
    out = torch.empty((rows, num_keys), dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    if keys.dtype != query.dtype:  # tl.dot takes one operand dtype; fp32 loses nothing
        query, keys = query.float(), keys.float()
    block_h = block(heads, MIN_DOT)
    block_d = block(dim, MIN_DOT, 128)
    block_s = block(num_keys, MIN_DOT, 512 if INTERPRETING else 64)
    # The interpreter pays per operation, not per element: batch many rows into one program.
    block_t = block(rows, 1, max(1, 4096 // block_h)) if INTERPRETING else 1
    grid = (triton.cdiv(rows, block_t), triton.cdiv(num_keys, block_s))
    _indexer_scores_kernel[grid](
        query, weights, keys, out, rows, heads, num_keys, dim,
        *query.stride(), *weights.stride(), *keys.stride(), *out.stride(),
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_D=block_d,
        CAST_FP32=dot_in_fp32(query.dtype))
    return out
