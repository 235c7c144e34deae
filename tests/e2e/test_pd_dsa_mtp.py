"""End to end: P/D of the DSA model with MTP speculative decoding on both sides.

Real vLLM API servers and the kvo proxy: the tiny DSA model with one MTP layer (its own
indexer and sparse MLA layer, ``model.layers.2``), a TP 1 prefill (kvo's sparse backend,
resident mode, ``RemoteD2HConnector``) and a decode in kvo's offload mode, both serving
``speculative_config={"method": "mtp", "num_speculative_tokens": 2}``: the drafter runs its
layer twice per step, and the prefill publishes it once per step, after the model's layers.

Reference: the decode answering the prompt itself. Both engines step through prompts in chunks
of one block and requests go one at a time, so the P/D decode's first step computes the prompt
tail over the same KV the reference computed, the drafter's layer included: the answer's
tokens and logprobs are equal, and so are the drafts the decode proposed and accepted (vLLM's
``spec_decode`` counters): a draft layer left unpulled (the decode's pool rows of another
request, or zeros) would draft from other KV. The bytes pulled are exact: every full prompt
block of the two model layers and of the draft layer, main KV and indexer.

Mooncake's transfer engine listens on every interface, so this runs in a loopback-only network
namespace (``nox -s e2e`` does that; by hand see ``test_pd.py``).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import _engines as e2e
import pytest

pytestmark = e2e.NEEDS_NETNS

NUM_LAYERS = 2            # the model's; the MTP layer is layer 2
INDEX_TOPK = 32
BLOCK_SIZE = 64
MAX_TOKENS = 8
DRAFT_TOKENS = 2
DEADLINE_S = 30.0
ROW_BYTES = (512 + 64) * 4    # MLA latent + rope, float32
INDEXER_ROW_BYTES = 128 * 2   # bf16 indexer keys
SPEC = "vllm:spec_decode_num_"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[e2e.PDDeployment]:
    with e2e.pd_dsa_deployment(
            tmp_path_factory.mktemp("pd-dsa-mtp"), num_layers=NUM_LAYERS,
            index_topk=INDEX_TOPK, block_size=BLOCK_SIZE, max_num_seqs=2, max_model_len=1024,
            deadline_s=DEADLINE_S, speculative_tokens=DRAFT_TOKENS) as running:
        yield running


def _complete(url: str, prompt: str) -> Any:
    from kvo_tools.pd.client import complete, completion_body

    return complete(url, completion_body(prompt, MAX_TOKENS, stream=False, chat=False),
                    timeout_s=300)


def _spec_counters(url: str) -> dict[str, float]:
    """vLLM's speculative-decoding counters on a server (drafts, draft tokens, accepted)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(SPEC) and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0][len(SPEC):].removesuffix("_total")
            if name in ("drafts", "draft_tokens", "accepted_tokens"):
                counters[name] = counters.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters


def _answer_with_drafts(url: str, decode: str, prompt: str) -> tuple[Any, dict[str, float]]:
    """The answer and the decode's counter growth over it (the counters reach /metrics a
    moment after the answer: wait until they stop moving)."""
    before = _spec_counters(decode)
    answer = _complete(url, prompt)
    assert answer.ok, answer.error
    after, limit = _spec_counters(decode), time.monotonic() + 10
    while time.monotonic() < limit:
        time.sleep(0.5)
        now = _spec_counters(decode)
        if now == after and now.get("drafts", 0) > before.get("drafts", 0):
            break
        after = now
    return answer, {name: after.get(name, 0) - before.get(name, 0) for name in after}


def test_mtp_pd_equals_the_decodes_own_answer_and_drafts(deployment: e2e.PDDeployment
                                                         ) -> None:
    from kvo_tools.pd.prompts import tagged_prompt
    from kvo_tools.pd.stats import decode_stats, settled_decode_stats

    before = decode_stats(deployment.decode_stats_file)
    cases = [("alpha", 200), ("bravo", 140)]
    accepted = {"pd": 0.0, "reference": 0.0}
    proposed = {"pd": 0.0, "reference": 0.0}
    for tag, length in cases:
        prompt = tagged_prompt(tag, length)
        want, want_drafts = _answer_with_drafts(deployment.decode, deployment.decode, prompt)
        got, got_drafts = _answer_with_drafts(deployment.proxy, deployment.decode, prompt)
        assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs), tag
        assert want_drafts["draft_tokens"] > 0, (tag, want_drafts)   # it did draft
        assert got_drafts == want_drafts, (tag, got_drafts, want_drafts)
        for run, drafts in (("pd", got_drafts), ("reference", want_drafts)):
            accepted[run] += drafts["accepted_tokens"]
            proposed[run] += drafts["draft_tokens"]
    for run in accepted:
        print(f"MTP acceptance ({run}): {accepted[run]:.0f} of {proposed[run]:.0f} draft "
              f"tokens ({accepted[run] / proposed[run]:.1%})")
    received = before.get("received", 0)
    after = settled_decode_stats(deployment.decode_stats_file,
                                 received + before.get("failed", 0) + len(cases))
    assert after["received"] - received == len(cases)
    assert after.get("failed", 0) == before.get("failed", 0)
    blocks = sum((length - 1) // BLOCK_SIZE for _, length in cases)   # full prompt blocks
    per_layer = blocks * BLOCK_SIZE * (ROW_BYTES + INDEXER_ROW_BYTES)

    def grown(index: int) -> int:
        was = before.get("per_layer", {}).get(str(index), {}).get("bytes", 0)
        return int(after["per_layer"].get(str(index), {}).get("bytes", 0) - was)

    assert {index: grown(index) for index in range(NUM_LAYERS + 1)} == {
        index: per_layer for index in range(NUM_LAYERS + 1)}   # layer 2: the draft layer
