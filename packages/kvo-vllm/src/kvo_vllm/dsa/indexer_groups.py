"""Which requests of a step the indexer scores together.

The indexer scores a group of requests as one padded ``[R, Q, H, S]`` block (R requests, the
group's longest query Q and longest sequence S). One group for a whole batch is right for a
decode step (every query is a row or two) but wasteful for a mixed one: a 512-token prefill
chunk beside seven one-token decodes pads every decode to 512 query rows, eight times the
scoring work the step needs. :func:`request_groups` splits a batch only where padding would
waste more than half of the real work (and more than a small fixed amount, so that short
steps stay one group and pay no extra call per group). It runs once per step, in the
indexer's metadata builder, never per layer.

The split depends only on the step's query and sequence lengths, so every run of the same
schedule scores the same groups (resident and offload modes alike).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

MIN_WASTE = 1 << 20
"""Padded (query row x key) pairs a group may waste whatever its real work (per head)."""


def request_groups(query_lens: np.ndarray, seq_lens: np.ndarray) -> list[np.ndarray] | None:
    """Batch rows to score together, each group ascending; None when the whole batch is one.

    ``query_lens`` and ``seq_lens`` [R] integers (a request's query tokens, its sequence length
    after this step). Requests are taken longest query first (then longest sequence), and a
    request joins the current group while the group's padding wastes at most
    ``max(real / 2, MIN_WASTE)`` (query row x key) pairs.
    """
    queries = np.asarray(query_lens, dtype=np.int64)
    seqs = np.asarray(seq_lens, dtype=np.int64)
    if queries.shape != seqs.shape or queries.ndim != 1:
        raise ValueError(f"query_lens and seq_lens must be [R] alike, got {queries.shape} and "
                         f"{seqs.shape}")
    if queries.size <= 1:
        return None
    real = int((queries * seqs).sum())
    padded = int(queries.size * queries.max() * seqs.max())
    if padded - real <= max(real // 2, MIN_WASTE):
        return None
    order = np.lexsort((-seqs, -queries))   # longest query first, then longest sequence
    groups: list[list[int]] = []
    group_q = group_s = group_real = 0
    for row in order.tolist():
        q, s = int(queries[row]), int(seqs[row])
        if groups:
            new_q, new_s = max(group_q, q), max(group_s, s)
            new_real = group_real + q * s
            waste = (len(groups[-1]) + 1) * new_q * new_s - new_real
            if waste <= max(new_real // 2, MIN_WASTE):
                groups[-1].append(row)
                group_q, group_s, group_real = new_q, new_s, new_real
                continue
        groups.append([row])
        group_q, group_s, group_real = q, s, q * s
    return [np.sort(np.asarray(rows, dtype=np.int64)) for rows in groups]


@attrs.frozen(eq=False)
class IndexerGroup:
    """One group of a step's requests, with what scoring it needs (built once per step)."""

    rows: torch.Tensor            # [G] int64 batch rows, ascending
    tokens: torch.Tensor          # [Tg] int64 the step's query tokens of these rows, ascending
    token_request: torch.Tensor   # [Tg] int64 each token's index into ``rows``
    max_query_len: int
    max_seq_len: int


def build_groups(token_request: torch.Tensor, query_lens: np.ndarray, seq_lens: np.ndarray
                 ) -> tuple[IndexerGroup, ...] | None:
    """:func:`request_groups` as :class:`IndexerGroup` s (None: the batch is one group)."""
    groups = request_groups(query_lens, seq_lens)
    if groups is None:
        return None
    requests = token_request.numpy()
    position_in_group = np.zeros(len(query_lens), dtype=np.int64)
    built = []
    for rows in groups:
        position_in_group[rows] = np.arange(rows.size)
        tokens = np.flatnonzero(np.isin(requests, rows))
        built.append(IndexerGroup(
            rows=torch.from_numpy(rows), tokens=torch.from_numpy(tokens),
            token_request=torch.from_numpy(position_in_group[requests[tokens]]),
            max_query_len=int(query_lens[rows].max()), max_seq_len=int(seq_lens[rows].max())))
    return tuple(built)
