"""End to end: P/D of the DSA model in bfloat16 (DeepSeek-V3.2's main-KV dtype), the decode
receiving the main KV into its bf16 host pool.

Real vLLM API servers (``--dtype bfloat16``) and the kvo proxy: a TP 1 prefill (kvo's sparse
backend, resident mode) with ``RemoteD2HConnector`` alone, and a decode in kvo's offload mode
with ``RemoteD2HConnector``. Reference: the decode answering the prompt itself; both engines
step through prompts in chunks of one block and requests go one at a time, so the P/D answer
must equal it exactly (tokens and logprobs). The bytes pulled are exact: every full prompt
block of every layer, main-KV rows of (512 + 64) bf16 values, indexer rows of 128 bf16 keys.

Mooncake's transfer engine listens on every interface, so this runs in a loopback-only network
namespace (``nox -s e2e`` does that; by hand see ``test_pd.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import _engines as e2e
import pytest

pytestmark = e2e.NEEDS_NETNS

NUM_LAYERS = 2
INDEX_TOPK = 32
BLOCK_SIZE = 64
MAX_TOKENS = 5
DEADLINE_S = 30.0
ROW_BYTES = e2e.DSA_MAIN_ROW_VALUES * 2  # bfloat16
BF16 = ["--dtype", "bfloat16"]   # after the cluster's own --dtype: the last one wins


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[e2e.PDDeployment]:
    with e2e.pd_dsa_deployment(
            tmp_path_factory.mktemp("pd-dsa-bf16"), num_layers=NUM_LAYERS,
            index_topk=INDEX_TOPK, block_size=BLOCK_SIZE, max_num_seqs=2, max_model_len=1024,
            deadline_s=DEADLINE_S, extra_args=tuple(BF16)) as running:
        yield running


def test_bf16_pd_equals_the_decodes_own_answer(deployment: e2e.PDDeployment) -> None:
    from kvo_tools.pd.prompts import tagged_prompt
    from kvo_tools.pd.stats import decode_stats, settled_decode_stats

    before = decode_stats(deployment.decode_stats_file)
    cases = [("alpha", 200), ("bravo", 140)]
    for tag, length in cases:
        want, got = e2e.own_and_pd_answers(deployment, tagged_prompt(tag, length), MAX_TOKENS)
        assert got == want, tag
    after = settled_decode_stats(deployment.decode_stats_file,
                                 e2e.ended_pulls(before) + len(cases))
    assert after["received"] - before.get("received", 0) == len(cases)
    assert after.get("failed", 0) == before.get("failed", 0)
    blocks = sum((length - 1) // BLOCK_SIZE for _, length in cases) * NUM_LAYERS
    assert e2e.pulled_bytes(before, after) == {
        "kv": blocks * BLOCK_SIZE * ROW_BYTES,
        "idx": blocks * BLOCK_SIZE * e2e.DSA_INDEXER_ROW_BYTES}
