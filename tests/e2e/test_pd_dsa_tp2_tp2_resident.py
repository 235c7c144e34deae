"""End to end: a TP 2 prefill of the DSA model feeds a TP 2 decode in kvo's RESIDENT mode.

Each decode rank keeps the main KV in its own vLLM MLA cache, so each pulls every main block
and every indexer block of its contribution group (prefill rank r -> decode rank r). Reference:
the same decode answering the prompt itself. Mooncake: loopback-only network namespace.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import _engines as e2e
import pytest

pytestmark = [e2e.NEEDS_NETNS, e2e.HEAVY_TP2_PD]

NUM_LAYERS = 2
INDEX_TOPK = 32
BLOCK_SIZE = 64
MAX_TOKENS = 5
DEADLINE_S = 60.0
ROW_BYTES = (512 + 64) * 4  # MLA latent + rope, float32
INDEXER_ROW_BYTES = 128 * 2  # bf16 indexer keys


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[e2e.PDDeployment]:
    with e2e.pd_dsa_deployment(
            tmp_path_factory.mktemp("pd-dsa-tp2-tp2-resident"), num_layers=NUM_LAYERS,
            index_topk=INDEX_TOPK, block_size=BLOCK_SIZE, max_num_seqs=2, max_model_len=1024,
            deadline_s=DEADLINE_S, prefill_tp=2, decode_tp=2,
            decode_mode="resident") as running:
        yield running


def _complete(url: str, prompt: str) -> Any:
    from kvo_tools.pd.client import complete, completion_body

    return complete(url, completion_body(prompt, MAX_TOKENS, stream=False, chat=False),
                    timeout_s=300)


def test_tp2_prefill_feeds_a_resident_tp2_decode(deployment: e2e.PDDeployment) -> None:
    """Answers equal the decode's own exactly; per request every rank pulled every full prompt
    block's main KV (its own cache) and indexer keys."""
    from kvo_tools.pd.prompts import tagged_prompt
    from kvo_tools.pd.stats import decode_stats, settled_decode_stats

    for tag, length in [("november", 257), ("oscar", 200)]:
        prompt = tagged_prompt(tag, length)
        want = _complete(deployment.decode, prompt)
        assert want.ok, (tag, want.error)
        before = [decode_stats(deployment.rank_stats_file(r)) for r in range(2)]
        got = _complete(deployment.proxy, prompt)
        assert got.ok, (tag, got.error)
        assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs), tag
        after = [settled_decode_stats(deployment.rank_stats_file(r),
                                      before[r].get("received", 0) + before[r].get("failed", 0)
                                      + 1) for r in range(2)]
        full = (length - 1) // BLOCK_SIZE * NUM_LAYERS
        for rank in range(2):
            b, a = before[rank], after[rank]
            assert not a["main_into_host_pool"]
            assert a["received"] - b.get("received", 0) == 1, (tag, rank, a)
            grew = {p: a["per_part"][p]["bytes"] - b.get("per_part", {}).get(p, {}).get(
                "bytes", 0) for p in ("kv", "idx")}
            assert grew == {"kv": full * BLOCK_SIZE * ROW_BYTES,
                            "idx": full * BLOCK_SIZE * INDEXER_ROW_BYTES}, (tag, rank, grew)
