"""End to end: a TP 2 prefill of the DSA model feeds a TP 2 decode in kvo's RESIDENT mode.

Each decode rank keeps the main KV in its own vLLM MLA cache, so each pulls every main block
and every indexer block of its contribution group (prefill rank r -> decode rank r). Reference:
the same decode answering the prompt itself. Mooncake: loopback-only network namespace.
"""

from __future__ import annotations

from collections.abc import Iterator

import _engines as e2e
import pytest

pytestmark = [e2e.NEEDS_NETNS, e2e.HEAVY_TP2_PD]

NUM_LAYERS = 2
INDEX_TOPK = 32
BLOCK_SIZE = 64
MAX_TOKENS = 5
DEADLINE_S = 60.0
ROW_BYTES = e2e.DSA_MAIN_ROW_VALUES * 4  # float32


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[e2e.PDDeployment]:
    with e2e.pd_dsa_deployment(
            tmp_path_factory.mktemp("pd-dsa-tp2-tp2-resident"), num_layers=NUM_LAYERS,
            index_topk=INDEX_TOPK, block_size=BLOCK_SIZE, max_num_seqs=2, max_model_len=1024,
            deadline_s=DEADLINE_S, prefill_tp=2, decode_tp=2,
            decode_mode="resident") as running:
        yield running


def test_tp2_prefill_feeds_a_resident_tp2_decode(deployment: e2e.PDDeployment) -> None:
    """Answers equal the decode's own exactly; per request every rank pulled every full prompt
    block's main KV (its own cache) and indexer keys."""
    from kvo_tools.pd.prompts import tagged_prompt
    from kvo_tools.pd.stats import decode_stats, settled_decode_stats

    for tag, length in [("november", 257), ("oscar", 200)]:
        prompt = tagged_prompt(tag, length)
        want = e2e.answers_of(deployment.decode, {tag: prompt}, MAX_TOKENS)
        before = [decode_stats(deployment.rank_stats_file(r)) for r in range(2)]
        assert e2e.answers_of(deployment.proxy, {tag: prompt}, MAX_TOKENS) == want, tag
        after = [settled_decode_stats(deployment.rank_stats_file(r),
                                      e2e.ended_pulls(before[r]) + 1) for r in range(2)]
        full = (length - 1) // BLOCK_SIZE * NUM_LAYERS
        for rank in range(2):
            b, a = before[rank], after[rank]
            assert not a["main_into_host_pool"]
            assert a["received"] - b.get("received", 0) == 1, (tag, rank, a)
            grew = e2e.pulled_bytes(b, a)
            assert grew == {"kv": full * BLOCK_SIZE * ROW_BYTES,
                            "idx": full * BLOCK_SIZE * e2e.DSA_INDEXER_ROW_BYTES}, (tag, rank, grew)
