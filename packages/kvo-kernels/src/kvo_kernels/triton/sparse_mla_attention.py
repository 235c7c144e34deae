# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels: @triton.jit is untyped and kernel parameters are pointers and constexprs.)
"""``sparse_mla_attention_triton``: MLA attention of each query row over its selected cache rows.

Keys are ``concat(kv, k_rope)`` and values are ``kv`` (the latent is shared by all heads), so a
program gathers BLOCK_K selected rows of each of its query rows once and uses them for a block
of heads: logits
``scale * (q . kv + q_rope . k_rope)``, an online (streaming) softmax in fp32, and the weighted
sum of the same rows. Slots of -1 are skipped; a row without any valid slot gives zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvo_kernels.reference.primitives import check_sparse_mla_attention_args
from kvo_kernels.triton._launch import INTERPRETING, MIN_DOT, block, check_launchable, dot_in_fp32


@triton.jit
def _sparse_mla_kernel(q_ptr, qr_ptr, kv_ptr, kr_ptr, slots_ptr, out_ptr,
                       num_rows, heads, width, latent, rope, scale,
                       stride_qt, stride_qn, stride_qd, stride_rt, stride_rn, stride_rd,
                       stride_kvc, stride_kvd, stride_krc, stride_krd, stride_st, stride_sk,
                       stride_ot, stride_on, stride_od,
                       BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_DL: tl.constexpr, BLOCK_DR: tl.constexpr,
                       CAST_FP32: tl.constexpr):
    # Blocks are [rows, heads, ...]: each row has its own selected cache rows, so the dots are
    # batched over rows (BLOCK_T is 1 on a GPU; the interpreter batches many rows per program).
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_rows
    t64 = t.to(tl.int64)
    head = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    dl = tl.arange(0, BLOCK_DL)
    dr = tl.arange(0, BLOCK_DR)
    row_head_ok = t_ok[:, None, None] & (head < heads)[None, :, None]
    q = tl.load(q_ptr + t64[:, None, None] * stride_qt + head[None, :, None] * stride_qn
                + dl[None, None, :] * stride_qd,
                mask=row_head_ok & (dl < latent)[None, None, :], other=0.0)     # [T, N, DL]
    qr = tl.load(qr_ptr + t64[:, None, None] * stride_rt + head[None, :, None] * stride_rn
                 + dr[None, None, :] * stride_rd,
                 mask=row_head_ok & (dr < rope)[None, None, :], other=0.0)      # [T, N, DR]
    if CAST_FP32:
        q = q.to(tl.float32)
        qr = qr.to(tl.float32)
    m_i = tl.full([BLOCK_T, BLOCK_N], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_N, BLOCK_DL], dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        slot = tl.load(slots_ptr + t64[:, None] * stride_st + ks[None, :] * stride_sk,
                       mask=t_ok[:, None] & (ks < width)[None, :], other=-1).to(tl.int64)
        valid = slot >= 0                                                       # [T, K]
        safe = tl.where(valid, slot, 0)
        kv = tl.load(kv_ptr + safe[:, :, None] * stride_kvc + dl[None, None, :] * stride_kvd,
                     mask=valid[:, :, None] & (dl < latent)[None, None, :], other=0.0)
        kr = tl.load(kr_ptr + safe[:, :, None] * stride_krc + dr[None, None, :] * stride_krd,
                     mask=valid[:, :, None] & (dr < rope)[None, None, :], other=0.0)
        if CAST_FP32:
            kv = kv.to(tl.float32)                                              # [T, K, DL]
            kr = kr.to(tl.float32)                                              # [T, K, DR]
        logits = tl.dot(q, tl.permute(kv, (0, 2, 1)), input_precision="ieee")
        logits = tl.dot(qr, tl.permute(kr, (0, 2, 1)), logits, input_precision="ieee")
        logits = tl.where(valid[:, None, :], logits * scale, float("-inf"))    # [T, N, K]
        m_new = tl.maximum(m_i, tl.max(logits, axis=2))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(logits - m_new[:, :, None])
        l_i = l_i * alpha + tl.sum(p, axis=2)
        acc = tl.dot(p.to(kv.dtype), kv, acc * alpha[:, :, None], input_precision="ieee")
        m_i = m_new
    denominator = tl.where(l_i > 0.0, l_i, 1.0)
    out = tl.where(l_i[:, :, None] > 0.0, acc / denominator[:, :, None], 0.0)
    tl.store(out_ptr + t64[:, None, None] * stride_ot + head[None, :, None] * stride_on
             + dl[None, None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty),
             mask=row_head_ok & (dl < latent)[None, None, :])


def sparse_mla_attention_triton(query: torch.Tensor, query_rope: torch.Tensor, kv: torch.Tensor,
                                k_rope: torch.Tensor, slots: torch.Tensor,
                                scale: float) -> torch.Tensor:
    """Sparse MLA attention [T, N, Dl] in query's dtype; arguments as the reference's.

    query [T, N, Dl], query_rope [T, N, Dr], kv [C, Dl], k_rope [C, Dr], slots [T, K] int32/64
    (-1 = skip, others bounds-checked). Agrees with ``reference.sparse_mla_attention`` within
    fp32 rounding for fp32 inputs; with bf16/fp16 inputs on a GPU the probabilities enter the
    value product in the input dtype (as in flash attention).
    """
    check_sparse_mla_attention_args(query, query_rope, kv, k_rope, slots, scale)
    rows, heads, latent = query.shape
    check_launchable("query", query)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    width = slots.shape[1]
    if width == 0:
        return out.zero_()
    # tl.dot takes one operand dtype: a mixed call computes in fp32 (what the reference does).
    if len({query.dtype, query_rope.dtype, kv.dtype, k_rope.dtype}) > 1:
        query, query_rope, kv, k_rope = (x.float() for x in (query, query_rope, kv, k_rope))
    block_n = block(heads, MIN_DOT, 64 if INTERPRETING else 16)
    block_k = block(width, MIN_DOT, 128 if INTERPRETING else 32)
    # The interpreter pays per operation, not per element: batch rows into one program.
    block_t = block(rows, 1, 16) if INTERPRETING else 1
    grid = (triton.cdiv(rows, block_t), triton.cdiv(heads, block_n))
    _sparse_mla_kernel[grid](
        query, query_rope, kv, k_rope, slots, out,
        rows, heads, width, latent, query_rope.shape[2], float(scale),
        *query.stride(), *query_rope.stride(), *kv.stride(), *k_rope.stride(), *slots.stride(),
        *out.stride(),
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_DL=block(latent, MIN_DOT), BLOCK_DR=block(query_rope.shape[2], MIN_DOT),
        CAST_FP32=dot_in_fp32(query.dtype))
    return out
