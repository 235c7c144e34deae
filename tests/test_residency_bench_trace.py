"""The residency benchmark's synthetic decode trace: the properties its numbers rely on.

The hit rate's denominator and the side-by-side check against upstream's LRU (which gives a
repeated token a slot per position) both assume every row's top-k holds distinct tokens; the
trace also has to keep about ``KEEP`` of each row from one step to the next.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvo_tools.bench.residency import KEEP, TOP_K, make_trace


@pytest.mark.parametrize(("rows", "seq_len", "seed"), [(4, 4096, 1), (2, 32768, 7), (1, 2100, 3)])
def test_every_step_keeps_tokens_distinct_and_most_of_the_last_one(
        rows: int, seq_len: int, seed: int) -> None:
    trace = make_trace(rows, seq_len, steps=30, seed=seed)
    assert len(trace) == 31
    for step in trace:
        assert step.shape == (rows, TOP_K)
        assert int(step.min()) >= 0 and int(step.max()) < seq_len
        ordered = step.sort(dim=1).values
        assert not bool((ordered[:, 1:] == ordered[:, :-1]).any()), "a row holds a token twice"
    kept = [(after == before).float().mean().item() for before, after in itertools.pairwise(trace)]
    assert abs(sum(kept) / len(kept) - KEEP) < 0.03


def test_a_dense_sequence_still_gets_distinct_tokens() -> None:
    # 2100 positions for 2048 picks: nearly every redraw collides at first, the loop must
    # still end with no repeats (the case that once let a kept token and its fresh twin stay).
    trace = make_trace(3, 2100, steps=20, seed=11)
    for step in trace:
        assert all(torch.unique(row).numel() == TOP_K for row in step)
