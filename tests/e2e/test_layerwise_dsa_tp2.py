"""Layerwise prefill offload of a DSA model at TP 2: the replicated MLA KV (and indexer keys)
is saved to the store once, not once per TP rank, and loaded on every rank.

Two real engines in this process, one after the other, each with its own real Mooncake master
(its metrics count what the store holds): the tiny random ``DeepseekV32ForCausalLM`` with the
``LayerwiseStoreConnector`` at TP 1 (uni executor) and at TP 2 (``mp`` executor, two spawned
workers, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``). The same prompts leave the same keys and bytes
in the store at TP 2 as at TP 1. Then, at TP 2, vLLM's prefix cache is emptied and the prompts
run again: their whole blocks come from the store (the master counts the keys read: every
stored key, by both ranks), with the tokens of the cold TP 2 run and logprobs within rounding
(the hit computes only the tails, in other chunks).

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
MAX_TOKENS = 3
PROMPTS = [
    "Sparse attention reads only the rows the indexer selects. " * 4,   # ~230 tokens
    "The quick brown fox jumps over the lazy dog. " * 2,                 # ~90 tokens
]
LOGPROB_TOLERANCE = 1e-4


engine_env = e2e.engine_env_fixture(e2e.TP2_WORKERS)
dsv32_model = e2e.dsv32_model_fixture("tiny-dsv32-lw-tp2", num_layers=NUM_LAYERS,
                                      index_topk=INDEX_TOPK)


def _engine(model: Path, master: Any, tp: int) -> Any:
    transfer = e2e.layerwise_transfer(master.address, shared_buffers=1)
    return e2e.start_engine(model, tp=tp, max_model_len=1024, max_num_seqs=2,
                            max_num_batched_tokens=STEP_TOKENS, kv_transfer_config=transfer)


def _generate(llm: Any) -> e2e.Answers:
    return e2e.greedy_answers(llm, PROMPTS, MAX_TOKENS)


def _gets(metrics: dict[str, float]) -> float:
    """Keys the master was asked to locate for reads (a worker's batched get: one per key)."""
    return metrics.get("master_batch_get_replica_list_items_total", 0.0)


@attrs.frozen
class Runs:
    tp1: dict[str, float]
    tp2: dict[str, float]
    tp2_cold: e2e.Answers
    tp2_hit: e2e.Answers
    tp2_hit_gets: float
    hit_blocks: int          # whole blocks before each prompt's last token


@pytest.fixture(scope="module")
def runs(engine_env: None, dsv32_model: Path) -> Iterator[Runs]:
    from kvo_transport.mooncake_master import MooncakeMaster

    with MooncakeMaster() as master:
        llm = _engine(dsv32_model, master, tp=1)
        _generate(llm)
        # before the stop: the blocks live in the engine's segment
        tp1 = e2e.settled_master_metrics(master)
        e2e.stop_engine(llm)
        del llm
    with MooncakeMaster() as master:
        llm = _engine(dsv32_model, master, tp=2)
        cold = _generate(llm)
        tokenizer = llm.get_tokenizer()
        hit_blocks = sum((len(tokenizer(p).input_ids) - 1) // BLOCK_SIZE for p in PROMPTS)
        tp2 = e2e.settled_master_metrics(master)
        assert llm.reset_prefix_cache()
        before = _gets(e2e.master_metrics(master))
        hit = _generate(llm)
        gets = _gets(e2e.master_metrics(master)) - before
        e2e.stop_engine(llm)
        del llm
    yield Runs(tp1=tp1, tp2=tp2, tp2_cold=cold, tp2_hit=hit, tp2_hit_gets=gets,
               hit_blocks=hit_blocks)


def test_tp2_stores_the_replicated_kv_once(runs: Runs) -> None:
    # Every block of both prompts (the partial ones under request keys until the requests'
    # removal, which follows at the next step), 2 layers x (main KV + indexer keys) each.
    assert runs.tp1["master_key_count"] > 0
    assert runs.tp2["master_key_count"] == runs.tp1["master_key_count"]
    assert runs.tp2["master_allocated_bytes"] == runs.tp1["master_allocated_bytes"] > 0


def test_tp2_store_hit_loads_on_every_rank(runs: Runs) -> None:
    assert e2e.logprob_distance(runs.tp2_hit, runs.tp2_cold) <= LOGPROB_TOLERANCE
    # The hit reads each block's keys (2 layers x main KV and indexer) once on each rank.
    assert runs.hit_blocks > 0
    assert runs.tp2_hit_gets == 2 * runs.hit_blocks * NUM_LAYERS * 2
