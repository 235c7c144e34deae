"""The reference primitives: the semantics every other implementation is tested against.

Plain PyTorch, fp32 math, no tricks. Each function validates its arguments first and raises
``KernelArgumentError`` naming the bad one, so a wrong index never reads outside a tensor.
"""

from __future__ import annotations

import math

import torch

from kvo_kernels import _checks as check
from kvo_kernels.errors import KernelArgumentError


def indexer_scores(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores ``score[t, s] = sum_h weights[t, h] * relu(query[t, h] . keys[s])``.

    query [T, H, D], weights [T, H], keys [S, D] (one key per token, shared by the heads).
    Computed in fp32 whatever the input dtype; returns [T, S] float32.
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
    dots = torch.einsum("thd,sd->ths", query.float(), keys.float())
    return torch.einsum("th,ths->ts", weights.float(), torch.relu(dots))


def topk_indices(scores: torch.Tensor, k: int, valid_lengths: torch.Tensor) -> torch.Tensor:
    """The ``k`` best token indices per row, best first; [T, k] int64.

    Only indices ``< valid_lengths[t]`` compete. Ties go to the LOWER token index (a stable
    descending sort), so every implementation picks the same set. A NaN score counts as -inf.
    Positions past ``min(k, valid_lengths[t])`` are -1 (padding).
    """
    check.ndim("scores", scores, 2, "[T, S]")
    check.dtype("scores", scores, check.FLOAT_DTYPES)
    check.positive("k", k, allow_zero=True)
    check.ndim("valid_lengths", valid_lengths, 1, "[T]")
    check.dtype("valid_lengths", valid_lengths, check.INDEX_DTYPES)
    check.dim_size("valid_lengths", valid_lengths, 0, scores.shape[0], "scores.shape[0] (T)")
    check.same_device("scores", scores, valid_lengths=valid_lengths)
    rows, tokens = scores.shape
    check.index_range("valid_lengths", valid_lengths, 0, tokens + 1)
    lengths = valid_lengths.to(torch.int64)
    ranked = torch.nan_to_num(scores.float(), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    if k > tokens:  # pad so that a k larger than the key count still yields [T, k]
        ranked = torch.nn.functional.pad(ranked, (0, k - tokens), value=-math.inf)
    positions = torch.arange(ranked.shape[1], device=scores.device)
    ranked = ranked.masked_fill(positions[None, :] >= lengths[:, None], -math.inf)
    # Stable + descending: equal scores keep ascending index order, and every valid index
    # precedes every masked one because the valid indices form a prefix.
    order = _stable_descending_prefix(ranked, k)
    keep = torch.arange(k, device=scores.device)[None, :] < lengths[:, None]
    return torch.where(keep, order, torch.full_like(order, -1)).reshape(rows, k)


def _stable_descending_prefix(ranked: torch.Tensor, k: int) -> torch.Tensor:
    """The first ``k`` indices per row of a stable descending sort of ``ranked`` [T, S] (no NaN),
    without sorting whole rows when k is much smaller than S (a prefill chunk's 512 rows of a
    32K context: the full sort cost twice the scores). The k-th best value is exact whatever
    the tie order; every value above it is taken, then its ties by ascending index, and only
    those k are sorted (stable, descending): the same indices in the same order."""
    rows, tokens = ranked.shape
    if k == 0 or 8 * k >= tokens:
        return torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, :k]
    kth = torch.topk(ranked, k, dim=1).values[:, -1:]
    above = ranked > kth
    ties = ranked == kth
    room = k - above.sum(dim=1, keepdim=True)
    chosen = above | (ties & (ties.cumsum(dim=1, dtype=torch.int32) <= room))
    index = chosen.nonzero()[:, 1].view(rows, k)   # k per row, ascending
    order = torch.sort(ranked.gather(1, index), dim=1, descending=True, stable=True).indices
    return index.gather(1, order)


def sparse_mla_attention(query: torch.Tensor, query_rope: torch.Tensor, kv: torch.Tensor,
                         k_rope: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Sparse MLA attention of each query row over the cache rows named in ``slots``.

    query [T, N, Dl], query_rope [T, N, Dr], kv [C, Dl], k_rope [C, Dr], slots [T, K] (-1 skip).
    Keys are ``concat(kv, k_rope)``, values are ``kv`` (MLA latent attention, shared by the N
    heads). Logits are ``scale * (q . kv + q_rope . k_rope)``, softmax in fp32 over the valid
    entries of the row (a slot listed twice counts twice). A row with no valid slot yields zeros.
    Output [T, N, Dl] in query's dtype.
    """
    check_sparse_mla_attention_args(query, query_rope, kv, k_rope, slots, scale)

    valid = slots >= 0                                        # [T, K]
    safe = slots.clamp(min=0).to(torch.int64)
    # Gathered, then widened: a cache larger than T x K rows (a hot buffer) is not converted
    # whole; the values are the same either way. index_select: the rows of ``kv[safe]``, in
    # 0.6-0.8x its time on CPU.
    rows = safe.reshape(-1)
    keys_latent = kv.index_select(0, rows).view(*safe.shape, kv.shape[1])  # [T, K, Dl]
    keys_rope = k_rope.index_select(0, rows).view(*safe.shape, k_rope.shape[1])
    return _attend_keys(query, query_rope, keys_latent, keys_rope, valid, scale)


def sparse_mla_attention_over_keys(query: torch.Tensor, query_rope: torch.Tensor,
                                   keys_latent: torch.Tensor, keys_rope: torch.Tensor,
                                   valid: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`sparse_mla_attention` over keys the caller gathered: token t's k-th key is
    ``keys_latent[t, k]`` / ``keys_rope[t, k]`` ([T, K, Dl] / [T, K, Dr], contiguous),
    counted where ``valid[t, k]``; rows where it is False must be finite (they are masked).

    The same arithmetic, so the same bits as ``sparse_mla_attention`` over a cache holding
    those rows. For a caller whose rows live in two caches (kvo-vllm's offload path in a step
    mixing prefill rows, read from the host pool, and decode rows, read from the hot
    buffer): one gather into these tensors instead of a gathered copy that the attention
    then gathers again.
    """
    check.ndim("query", query, 3, "[T, N, Dl]")
    check.ndim("query_rope", query_rope, 3, "[T, N, Dr]")
    check.ndim("keys_latent", keys_latent, 3, "[T, K, Dl]")
    check.ndim("keys_rope", keys_rope, 3, "[T, K, Dr]")
    check.ndim("valid", valid, 2, "[T, K]")
    for name, value in (("query", query), ("query_rope", query_rope),
                        ("keys_latent", keys_latent), ("keys_rope", keys_rope)):
        check.dtype(name, value, check.FLOAT_DTYPES)
    check.dtype("valid", valid, (torch.bool,))
    check.same_device("query", query, query_rope=query_rope, keys_latent=keys_latent,
                      keys_rope=keys_rope, valid=valid)
    rows, top_k = valid.shape
    for name, value, last in (("keys_latent", keys_latent, query.shape[2]),
                              ("keys_rope", keys_rope, query_rope.shape[2])):
        if tuple(value.shape) != (rows, top_k, last) or not value.is_contiguous():
            raise KernelArgumentError(f"{name} must be a contiguous [{rows}, {top_k}, {last}] "
                                      f"tensor (valid's T and K, the query's width), got "
                                      f"{tuple(value.shape)}")
    check.dim_size("query", query, 0, rows, "valid.shape[0] (T)")
    check.dim_size("query_rope", query_rope, 0, rows, "valid.shape[0] (T)")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isfinite(scale):
        raise KernelArgumentError(f"scale must be a finite float, got {scale!r}")
    return _attend_keys(query, query_rope, keys_latent, keys_rope, valid, scale)


def _attend_keys(query: torch.Tensor, query_rope: torch.Tensor, keys_latent: torch.Tensor,
                 keys_rope: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """The arithmetic of sparse MLA attention over gathered keys (checked by the callers)."""
    keys_latent = keys_latent.float()
    keys_rope = keys_rope.float()
    logits = (torch.einsum("tnd,tkd->tnk", query.float(), keys_latent)
              + torch.einsum("tnd,tkd->tnk", query_rope.float(), keys_rope)) * float(scale)
    logits = logits.masked_fill(~valid[:, None, :], -math.inf)
    weights = torch.softmax(logits, dim=-1)
    weights = torch.where(valid.any(dim=1)[:, None, None], weights, torch.zeros_like(weights))
    return torch.einsum("tnk,tkd->tnd", weights, keys_latent).to(query.dtype)


def sparse_copy(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                dst_rows: torch.Tensor) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for every i, in place; any dtype, host <-> device.

    Rows are the first dimension; the trailing shapes and dtypes must match. Every index is
    bounds-checked before anything is written, and ``dst_rows`` must not repeat (a repeated
    destination would make the result depend on copy order).
    """
    check_sparse_copy_args(src, dst, src_rows, dst_rows, one_device=False)
    if src_rows.numel() == 0:
        return
    rows = src[src_rows.to(torch.int64)].to(dst.device)
    dst.index_copy_(0, dst_rows.to(torch.int64), rows)


def sparse_copy_gather(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                       dst_rows: torch.Tensor, gather_rows: torch.Tensor,
                       out: torch.Tensor) -> None:
    """``sparse_copy(src, dst, src_rows, dst_rows)``, then ``out[k] = dst[gather_rows[k]]``.

    The offload decode step: copy the misses into the hot buffer, then read every selected
    row for attention (misses and hits alike) from it. ``out`` [N, *row] must not share
    memory with ``src`` or ``dst``; a refused call writes neither ``dst`` nor ``out``.
    """
    check_sparse_copy_gather_args(src, dst, src_rows, dst_rows, gather_rows, out)
    sparse_copy(src, dst, src_rows, dst_rows)
    out.copy_(dst[gather_rows.to(torch.int64)])


def hadamard_matrix(size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix [size, size] float32 (orthogonal: H @ H.T = I)."""
    check.positive("size", size)
    if size & (size - 1):
        raise KernelArgumentError(f"Hadamard size must be a power of two, got {size}")
    matrix = torch.ones(1, 1, dtype=torch.float32, device=device)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / math.sqrt(size)


def hadamard_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the last dimension by the normalised Hadamard matrix, then quantise to int8.

    Symmetric per row: ``scale = max|rotated| / 127`` stored as fp16, and
    ``q = round(rotated / scale)`` clamped to [-127, 127] using that fp16 scale, so
    ``q * scale`` is the dequantised rotated row. The rotation spreads outliers across the row,
    which is why C8 top-k stays close to the unquantised one. Returns (int8 [..., D],
    fp16 [..., 1]); an all-zero row gets scale 0 and zeros.
    """
    check.tensor("x", x)
    if x.dim() < 1:
        raise KernelArgumentError("x must have a last dimension to rotate, got a 0-d tensor")
    check.dtype("x", x, check.FLOAT_DTYPES)
    rotated = x.float() @ hadamard_matrix(x.shape[-1], x.device)
    amax = rotated.abs().amax(dim=-1, keepdim=True)
    if not bool(torch.isfinite(amax).all()):
        raise KernelArgumentError("x contains inf or NaN; int8 quantisation needs finite values")
    largest = float(amax.max()) if amax.numel() else 0.0
    if largest / 127.0 > torch.finfo(torch.float16).max:
        raise KernelArgumentError("x is too large for an fp16 quantisation scale")
    scale = (amax / 127.0).to(torch.float16)
    scale32 = scale.float()
    safe = torch.where(scale32 > 0, scale32, torch.ones_like(scale32))
    quantised = torch.round(rotated / safe).clamp(-127, 127)
    quantised = torch.where(scale32 > 0, quantised, torch.zeros_like(quantised))
    return quantised.to(torch.int8), scale


def check_sparse_mla_attention_args(query: torch.Tensor, query_rope: torch.Tensor,
                                    kv: torch.Tensor, k_rope: torch.Tensor, slots: torch.Tensor,
                                    scale: float) -> None:
    """The argument checks of ``sparse_mla_attention``, shared by every implementation of it."""
    check.ndim("query", query, 3, "[T, N, Dl]")
    check.ndim("query_rope", query_rope, 3, "[T, N, Dr]")
    check.ndim("kv", kv, 2, "[C, Dl]")
    check.ndim("k_rope", k_rope, 2, "[C, Dr]")
    check.ndim("slots", slots, 2, "[T, K]")
    for name, value in (("query", query), ("query_rope", query_rope), ("kv", kv),
                        ("k_rope", k_rope)):
        check.dtype(name, value, check.FLOAT_DTYPES)
    check.dtype("slots", slots, check.INDEX_DTYPES)
    check.same_device("query", query, query_rope=query_rope, kv=kv, k_rope=k_rope, slots=slots)
    rows, heads, latent = query.shape
    check.dim_size("query_rope", query_rope, 0, rows, "query.shape[0] (T)")
    check.dim_size("query_rope", query_rope, 1, heads, "query.shape[1] (N)")
    check.dim_size("kv", kv, 1, latent, "query.shape[2] (Dl)")
    check.dim_size("k_rope", k_rope, 0, kv.shape[0], "kv.shape[0] (C)")
    check.dim_size("k_rope", k_rope, 1, query_rope.shape[2], "query_rope.shape[2] (Dr)")
    check.dim_size("slots", slots, 0, rows, "query.shape[0] (T)")
    check.index_range("slots", slots, 0, kv.shape[0], allow_pad=True)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isfinite(scale):
        raise KernelArgumentError(f"scale must be a finite float, got {scale!r}")


def check_sparse_copy_args(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                           dst_rows: torch.Tensor, *, one_device: bool) -> None:
    """The argument checks of ``sparse_copy``, shared by every implementation of it.

    ``one_device``: all four tensors on one device (a kernel); else src and dst may differ
    (the reference copies host <-> device).
    """
    check.tensor("src", src)
    check.tensor("dst", dst)
    check.ndim("src_rows", src_rows, 1, "[M]")
    check.ndim("dst_rows", dst_rows, 1, "[M]")
    check.dtype("src_rows", src_rows, check.INDEX_DTYPES)
    check.dtype("dst_rows", dst_rows, check.INDEX_DTYPES)
    if src.dim() < 1 or dst.dim() < 1:
        raise KernelArgumentError("src and dst must have a row dimension (at least 1-D)")
    if src.shape[1:] != dst.shape[1:]:
        raise KernelArgumentError(
            f"dst row shape {tuple(dst.shape[1:])} differs from src row shape "
            f"{tuple(src.shape[1:])}")
    if src.dtype != dst.dtype:
        raise KernelArgumentError(f"dst dtype {dst.dtype} differs from src dtype {src.dtype}")
    check.dim_size("dst_rows", dst_rows, 0, src_rows.shape[0], "src_rows.shape[0] (M)")
    if one_device:
        check.same_device("src", src, dst=dst, src_rows=src_rows, dst_rows=dst_rows)
    else:
        check.same_device("src", src, src_rows=src_rows)
        check.same_device("dst", dst, dst_rows=dst_rows)
    check.index_range("src_rows", src_rows, 0, src.shape[0])
    check.index_range("dst_rows", dst_rows, 0, dst.shape[0])
    if torch.unique(dst_rows).numel() != dst_rows.numel():
        raise KernelArgumentError("dst_rows repeats a destination row; each must appear once")


def check_sparse_copy_gather_args(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                                  dst_rows: torch.Tensor, gather_rows: torch.Tensor,
                                  out: torch.Tensor) -> None:
    """The argument checks of ``sparse_copy_gather`` (all six tensors on one device)."""
    check_sparse_copy_args(src, dst, src_rows, dst_rows, one_device=True)
    check.tensor("out", out)
    check.ndim("gather_rows", gather_rows, 1, "[N]")
    check.dtype("gather_rows", gather_rows, check.INDEX_DTYPES)
    if out.dim() < 1 or out.shape[1:] != dst.shape[1:]:
        raise KernelArgumentError(
            f"out row shape {tuple(out.shape[1:])} differs from dst row shape "
            f"{tuple(dst.shape[1:])}")
    if out.dtype != dst.dtype:
        raise KernelArgumentError(f"out dtype {out.dtype} differs from dst dtype {dst.dtype}")
    check.dim_size("out", out, 0, gather_rows.shape[0], "gather_rows.shape[0] (N)")
    check.same_device("dst", dst, gather_rows=gather_rows, out=out)
    check.index_range("gather_rows", gather_rows, 0, dst.shape[0])
    for name, other in (("src", src), ("dst", dst)):
        if _shares_memory(out, other):
            raise KernelArgumentError(
                f"out overlaps {name} in memory; it must be a separate tensor")


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges ``a`` and ``b`` may touch intersect (same device)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1
