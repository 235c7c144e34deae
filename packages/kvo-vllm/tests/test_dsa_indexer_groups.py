"""The indexer scores a mixed step's requests in groups: a prefill chunk apart from the
decodes it would otherwise pad to its length, short steps and decode steps in one group."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_dsa_indexer import DIM, TOP_K, _batch, _fill

from kvo_vllm.dsa import indexer_groups
from kvo_vllm.dsa.indexer import select_topk
from kvo_vllm.dsa.indexer_cache import IndexerKeyLayout, with_groups
from kvo_vllm.dsa.indexer_groups import build_groups, request_groups


def _partition(groups: list[np.ndarray], rows: int) -> list[list[int]]:
    flat = sorted(int(r) for group in groups for r in group)
    assert flat == list(range(rows))  # every row once
    assert all(list(group) == sorted(group) for group in groups)
    return [group.tolist() for group in groups]


def test_a_prefill_chunk_is_scored_apart_from_the_decodes_beside_it() -> None:
    queries = np.array([1, 1, 512, 1, 1, 1, 1, 1])
    seqs = np.array([32768, 32700, 16384, 32768, 32000, 32768, 32768, 32100])
    groups = request_groups(queries, seqs)
    assert groups is not None
    assert _partition(groups, 8) == [[2], [0, 1, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize(("queries", "seqs"), [
    ([1] * 8, [32768] * 8),                 # a decode step: one group
    ([1, 1, 2, 1], [32768, 30000, 32768, 32000]),   # decodes and an MTP row of similar length
    ([64, 1, 1], [200, 300, 250]),           # a short step: the padding is below MIN_WASTE
    ([512], [1024]),                         # one request
])
def test_steps_without_much_padding_stay_one_group(queries: list[int], seqs: list[int]) -> None:
    assert request_groups(np.array(queries), np.array(seqs)) is None


def test_decodes_of_very_different_lengths_split_with_bounded_padding() -> None:
    queries = np.ones(8, dtype=np.int64)
    seqs = np.array([1 << 20, 4096, 1 << 20, 4000, 1 << 20, 4096, 3000, 4096])
    groups = request_groups(queries, seqs)
    assert groups is not None
    parts = _partition(groups, 8)
    assert [0, 2, 4] in [[r for r in part if seqs[r] == 1 << 20] for part in parts]
    for part in parts:
        real = int((queries[part] * seqs[part]).sum())
        waste = len(part) * int(queries[part].max()) * int(seqs[part].max()) - real
        assert waste <= max(real // 2, indexer_groups.MIN_WASTE)
    assert len(parts) == 2  # the long three (+ at most one short), then the short rest


def test_groups_name_their_tokens_and_local_request_indices() -> None:
    token_request = torch.tensor([0, 1, 1, 1, 2])   # request 1 prefills 3 tokens
    groups = build_groups(token_request, np.array([1, 3, 1]), np.array([5000, 600, 5000]))
    assert groups is None  # below MIN_WASTE
    indexer_groups_min = indexer_groups.MIN_WASTE
    try:
        indexer_groups.MIN_WASTE = 0
        groups = build_groups(token_request, np.array([1, 3, 1]), np.array([5000, 600, 5000]))
    finally:
        indexer_groups.MIN_WASTE = indexer_groups_min
    assert groups is not None
    by_rows = {tuple(g.rows.tolist()): g for g in groups}
    assert set(by_rows) == {(1,), (0, 2)}
    assert by_rows[(1,)].tokens.tolist() == [1, 2, 3]
    assert by_rows[(1,)].token_request.tolist() == [0, 0, 0]
    assert (by_rows[(1,)].max_query_len, by_rows[(1,)].max_seq_len) == (3, 600)
    assert by_rows[(0, 2)].tokens.tolist() == [0, 4]
    assert by_rows[(0, 2)].token_request.tolist() == [0, 1]


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="query_lens and seq_lens"):
        request_groups(np.array([1, 2]), np.array([3]))


def test_grouped_selection_is_the_ungrouped_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scored in groups, every token gets the selection it gets in one padded block (the
    scores' operands are the same; only the padding differs)."""
    seq_lens, query_lens = [70, 9, 33, 100, 64], [1, 9, 1, 40, 1]
    layout = IndexerKeyLayout(DIM, "bfloat16")
    keys, query, weights, metadata = _batch(seq_lens, query_lens, seed=5)
    cache = _fill(layout, keys, metadata)
    whole = select_topk(query, weights, cache, layout, metadata, TOP_K)
    monkeypatch.setattr(indexer_groups, "MIN_WASTE", 0)
    groups = build_groups(metadata.token_request, np.array(query_lens), np.array(seq_lens))
    assert groups is not None and len(groups) >= 2
    grouped = select_topk(query, weights, cache, layout, with_groups(metadata, groups), TOP_K)
    assert torch.equal(grouped, whole)
