"""End to end: P/D into a decode that runs the fused ops (``kernel_backend="fused"``), the
design's default decode path, with the bf16 and the C8 indexer.

Real vLLM API servers and the kvo proxy: a TP 1 prefill (kvo's sparse backend, resident mode)
with ``RemoteD2HConnector`` alone, and a TP 1 decode in offload mode with the fused ops, whose
host pool keeps latent and rope apart: the pulled 576-wide rows are split on arrival
(``kvo_vllm.remote_d2h.fused_pool_split``). Oracle: the same fused decode answering the prompt
itself (offload on, the prompt computed there). Both engines step through prompts in chunks of
one block and requests go one at a time, so the pool holds the same bytes either way; the
tokens must be equal and the logprobs within the fused path's rounding (1e-4, as for its first
step on rows it did not write: tests/e2e/test_dsa_prefix_cache.py). Main KV corrupted in
flight (every pulled row, the selected ones among them) changes the answer; the next clean pull
answers as before. The bytes pulled are exact: every full prompt block of every layer.

Mooncake's transfer engine listens on every interface, so this runs in a loopback-only network
namespace (``nox -s e2e`` does that; by hand see ``test_pd.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import _engines as e2e
import pytest

pytestmark = e2e.NEEDS_NETNS

NUM_LAYERS = 2
INDEX_TOPK = 32
BLOCK_SIZE = 64
MAX_TOKENS = 5
DEADLINE_S = 30.0
ROW_BYTES = (512 + 64) * 2   # MLA latent + rope, bfloat16
FUSED_ROUNDING = 1e-4
BF16 = ["--dtype", "bfloat16"]   # after the cluster's own --dtype: the last one wins
INDEXERS = {"bf16": {}, "c8": {"indexer_kv_dtype": "int8"}}


@pytest.fixture(scope="module", params=sorted(INDEXERS))
def deployment(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[e2e.PDDeployment]:
    from kvo_tools.pd.sites import faulty_decode_env

    workdir = tmp_path_factory.mktemp(f"pd-dsa-fused-{request.param}")
    (workdir / "faults.json").write_text("{}")
    with e2e.pd_dsa_deployment(
            workdir, num_layers=NUM_LAYERS, index_topk=INDEX_TOPK, block_size=BLOCK_SIZE,
            max_num_seqs=2, max_model_len=1024, deadline_s=DEADLINE_S, extra_args=tuple(BF16),
            decode_env=faulty_decode_env(workdir / "faults.json"),
            sparse=INDEXERS[request.param], decode_kernel_backend="fused") as running:
        yield running


def _complete(url: str, prompt: str) -> Any:
    from kvo_tools.pd.client import complete, completion_body

    return complete(url, completion_body(prompt, MAX_TOKENS, stream=False, chat=False),
                    timeout_s=300)


def _set_faults(deployment: e2e.PDDeployment, **faults: Any) -> None:
    import json

    (deployment.workdir / "faults.json").write_text(json.dumps(faults))


def test_pd_into_the_fused_decode_equals_its_own_answer(deployment: e2e.PDDeployment) -> None:
    from kvo_tools.pd.prompts import tagged_prompt
    from kvo_tools.pd.stats import decode_stats, settled_decode_stats

    before = decode_stats(deployment.decode_stats_file)
    cases = [("alpha", 200), ("bravo", 140)]
    for tag, length in cases:
        prompt = tagged_prompt(tag, length)
        want = _complete(deployment.decode, prompt)
        assert want.ok, (tag, want.error)
        got = _complete(deployment.proxy, prompt)
        assert got.ok, (tag, got.error)
        assert got.token_ids == want.token_ids, tag
        distance = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
        print(f"P/D into the fused decode, {tag}: logprobs differ by at most {distance:g}")
        assert distance <= FUSED_ROUNDING, (tag, distance)
    received = before.get("received", 0)
    after = settled_decode_stats(deployment.decode_stats_file,
                                 received + before.get("failed", 0) + len(cases))
    assert after["received"] - received == len(cases)
    assert after.get("failed", 0) == before.get("failed", 0)
    blocks = sum((length - 1) // BLOCK_SIZE for _, length in cases) * NUM_LAYERS
    pulled = after["per_part"]["kv"]["bytes"] - before.get("per_part", {}).get(
        "kv", {}).get("bytes", 0)
    assert pulled == blocks * BLOCK_SIZE * ROW_BYTES
    split = after["engine_wrapper"]["fused_pool_split_rows"] - before.get(
        "engine_wrapper", {}).get("fused_pool_split_rows", 0)
    assert split == blocks * BLOCK_SIZE   # every pulled row went through the split


def test_corrupted_main_kv_in_flight_changes_the_fused_answer(deployment: e2e.PDDeployment
                                                              ) -> None:
    """Every pulled main-KV row (the selected ones among them) is damaged after it arrived in
    staging, before the split: the fused decode's answer changes; the next clean pull heals."""
    from kvo_tools.pd.prompts import tagged_prompt
    from kvo_tools.pd.stats import decode_stats, settled_decode_stats

    prompt = tagged_prompt("echo", 200)
    want = _complete(deployment.decode, prompt)
    assert want.ok, want.error
    before = decode_stats(deployment.decode_stats_file)
    ended = before.get("received", 0) + before.get("failed", 0)
    _set_faults(deployment, corrupt_reads=True, corrupt_part="kv")
    try:
        damaged = _complete(deployment.proxy, prompt)
    finally:
        _set_faults(deployment)
    assert damaged.ok, damaged.error
    assert damaged.token_ids != want.token_ids
    healed = _complete(deployment.proxy, prompt)
    assert healed.ok, healed.error
    assert healed.token_ids == want.token_ids
    after = settled_decode_stats(deployment.decode_stats_file, ended + 2)
    corrupted = before.get("engine_wrapper", {}).get("corrupted_bytes", 0)
    assert after["engine_wrapper"]["corrupted_bytes"] > corrupted
    assert after.get("failed", 0) == before.get("failed", 0)   # damaged, not refused
