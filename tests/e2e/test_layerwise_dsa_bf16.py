"""Layerwise prefill offload of the DSA model served in bfloat16 (DeepSeek-V3.2's main-KV dtype).

Three real engines in this process, one after the other: the tiny random
``DeepseekV32ForCausalLM`` in bf16 without kvo's connector (the reference), in bf16 with the
``LayerwiseStoreConnector`` on a real Mooncake master, and in float32 with it on another master
(the same prompts: what the store holds at fp32). The bf16 engine's cold run gives exactly the
reference's tokens and logprobs; after ``reset_prefix_cache`` the prompts' whole blocks come
from the store (both parts loaded) and give the reference's tokens, logprobs within the
rounding of computing only the tails in other chunks. The store holds bf16 rows: the same
keys as at fp32, the main-KV (MLA) bytes half of fp32's, the indexer keys (bf16 at both) the
same, and the master allocates exactly those bytes.

Mooncake listens on every interface, so this runs inside a loopback-only network namespace
(``nox -s e2e`` does that; by hand see ``test_layerwise.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _engines as e2e
import attrs
import pytest

pytestmark = e2e.NEEDS_NETNS

NUM_LAYERS = 2
INDEX_TOPK = 32
BLOCK_SIZE = 64
STEP_TOKENS = 128
MAX_TOKENS = 4
PROMPTS = [
    "Sparse attention reads only the rows the indexer selects. " * 4,   # ~230 tokens
    "The quick brown fox jumps over the lazy dog. " * 2,                 # ~90 tokens
]
HIT_LOGPROB_TOLERANCE = 1e-3
"""bf16 store hit vs the reference: the tails are computed in other chunks, which may round
differently (measured here: 0.0); far below what a wrong KV gives (> 0.1)."""

engine_env = e2e.engine_env_fixture()
dsv32_model = e2e.dsv32_model_fixture("tiny-dsv32-lw-bf16", num_layers=NUM_LAYERS,
                                      index_topk=INDEX_TOPK)


def _engine(model: Path, dtype: str, master: Any | None) -> Any:
    extra: dict[str, Any] = {}
    if master is not None:
        extra["kv_transfer_config"] = e2e.layerwise_transfer(master.address, shared_buffers=1)
    return e2e.start_engine(model, dtype=dtype, max_model_len=1024, max_num_seqs=2,
                            max_num_batched_tokens=STEP_TOKENS, **extra)


def _generate(llm: Any) -> e2e.Answers:
    return e2e.greedy_answers(llm, PROMPTS, MAX_TOKENS)


@attrs.frozen
class StoreRun:
    """One layerwise engine's cold run: its answers, what it saved, what the master holds."""

    cold: e2e.Answers
    saved: dict[str, int]        # part -> bytes saved by the worker connector
    main_block_bytes: int        # one block of one layer's main KV in the connector's layout
    master: dict[str, float]


@attrs.frozen
class Runs:
    reference: e2e.Answers
    bf16: StoreRun
    fp32: StoreRun
    hit: e2e.Answers
    hit_loaded: dict[str, int]   # part -> bytes loaded from the store by the hit


def _store_run(model: Path, dtype: str, master: Any) -> tuple[Any, StoreRun]:
    llm = _engine(model, dtype, master)
    cold = _generate(llm)
    worker = e2e.layerwise_worker_connector()
    # The master's metrics before the stop: the blocks live in the engine's segment.
    run = StoreRun(cold=cold, saved=dict(worker.stats.saved_bytes_by_part),
                   main_block_bytes=worker.layout.layers[0].parts[0].block_bytes,
                   master=e2e.settled_master_metrics(master))
    return llm, run


@pytest.fixture(scope="module")
def runs(engine_env: None, dsv32_model: Path) -> Iterator[Runs]:
    from kvo_transport.mooncake_master import MooncakeMaster

    llm = _engine(dsv32_model, "bfloat16", None)
    reference = _generate(llm)
    e2e.stop_engine(llm)
    del llm
    with MooncakeMaster() as master:
        llm, bf16 = _store_run(dsv32_model, "bfloat16", master)
        worker = e2e.layerwise_worker_connector()
        loaded_before = dict(worker.stats.loaded_bytes_by_part)
        assert llm.reset_prefix_cache()
        hit = _generate(llm)
        hit_loaded = {part: worker.stats.loaded_bytes_by_part.get(part, 0)
                      - loaded_before.get(part, 0) for part in ("kv", "idx")}
        assert worker.stats.failed_loads == 0 and worker.stats.failed_saves == 0
        e2e.stop_engine(llm)
        del llm, worker
    with MooncakeMaster() as master:
        llm, fp32 = _store_run(dsv32_model, "float32", master)
        e2e.stop_engine(llm)
        del llm
    yield Runs(reference=reference, bf16=bf16, fp32=fp32, hit=hit, hit_loaded=hit_loaded)


def test_bf16_layerwise_cold_and_store_hit_answer_as_bf16_without_offload(runs: Runs) -> None:
    assert runs.bf16.cold == runs.reference
    assert [tokens for tokens, _ in runs.hit] == [tokens for tokens, _ in runs.reference]
    assert e2e.logprob_distance(runs.hit, runs.reference) <= HIT_LOGPROB_TOLERANCE
    # The hit really came from the store: both parts of the prompts' whole blocks were loaded.
    assert runs.hit_loaded["kv"] > 0 and runs.hit_loaded["idx"] > 0


def test_the_store_holds_bf16_rows(runs: Runs) -> None:
    # A main-KV row is 512 latent + 64 rope values: 2 bytes each in bf16, 4 in fp32.
    assert runs.bf16.main_block_bytes == BLOCK_SIZE * (512 + 64) * 2
    assert runs.fp32.main_block_bytes == 2 * runs.bf16.main_block_bytes
    assert runs.bf16.master["master_key_count"] == runs.fp32.master["master_key_count"] > 0
    assert runs.bf16.saved["kv"] > 0
    assert runs.bf16.saved["kv"] * 2 == runs.fp32.saved["kv"]
    assert runs.bf16.saved["idx"] == runs.fp32.saved["idx"] > 0
    # What the master holds: per held block and layer one main-KV key and one indexer key,
    # allocated at exactly their bytes (bf16 main rows; the indexer's bf16 keys at both).
    held = runs.bf16.master["master_key_count"] / (2 * NUM_LAYERS)
    indexer_block_bytes = BLOCK_SIZE * 128 * 2
    for run in (runs.bf16, runs.fp32):
        assert run.master["master_allocated_bytes"] == (
            NUM_LAYERS * held * (run.main_block_bytes + indexer_block_bytes))
