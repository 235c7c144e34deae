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

import gc
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("KVO_IN_NETNS") != "1",
    reason="starts Mooncake, which listens on every interface: run inside a loopback-only "
           "network namespace (unshare -n sh -c 'ip link set lo up; KVO_IN_NETNS=1 ...'; "
           "nox -s e2e does this)")

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

Answers = list[tuple[list[int], list[float]]]


@pytest.fixture(scope="module")
def engine_env() -> Iterator[None]:
    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
              "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    saved = {name: os.environ.get(name) for name in wanted}
    for name, value in wanted.items():
        os.environ.setdefault(name, value)
    os.environ.pop("KVO_SPARSE_CONFIG", None)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def dsv32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from models.tiny_dsv32 import build_tiny_dsv32

    return build_tiny_dsv32(tmp_path_factory.mktemp("tiny-dsv32-lw-tp2"),
                            num_layers=NUM_LAYERS, index_topk=INDEX_TOPK)


def _engine(model: Path, master: Any, tp: int) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="LayerwiseStoreConnector", kv_connector_module_path="kvo_vllm.connectors",
        kv_role="kv_both",
        kv_connector_extra_config={"store_master_address": master.address,
                                   "shared_buffers": 1, "independent_layers": [0],
                                   "prefetch_depth": 1})
    return LLM(model=str(model), dtype="float32", enforce_eager=True,
               distributed_executor_backend="mp" if tp > 1 else "uni",
               tensor_parallel_size=tp, max_model_len=1024, max_num_seqs=2,
               max_num_batched_tokens=STEP_TOKENS, seed=0, kv_transfer_config=transfer)


def _generate(llm: Any) -> Answers:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                            ignore_eos=True)
    results = []
    for output in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        results.append((tokens, [step[t].logprob for step, t in
                                 zip(completion.logprobs, tokens, strict=True)]))
    return results


def _stop(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def _metrics(master: Any) -> dict[str, float]:
    url = f"http://127.0.0.1:{master.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _settled(master: Any) -> dict[str, float]:
    """The master's metrics once its key count and bytes stopped moving (a test measurement:
    finished requests' private keys are removed in the background)."""
    last = _metrics(master)
    for _ in range(40):
        time.sleep(0.5)
        now = _metrics(master)
        if all(now[k] == last[k] for k in ("master_key_count", "master_allocated_bytes")):
            return now
        last = now
    return last


def _gets(metrics: dict[str, float]) -> float:
    """Keys the master was asked to locate for reads (a worker's batched get: one per key)."""
    return metrics.get("master_batch_get_replica_list_items_total", 0.0)


def _distance(answers: Answers, want: Answers) -> float:
    worst = 0.0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(answers, want, strict=True):
        if tokens != want_tokens:
            return float("inf")
        worst = max([worst, *(abs(a - b) for a, b in zip(logprobs, want_logprobs,
                                                        strict=True))])
    return worst


@attrs.frozen
class Runs:
    tp1: dict[str, float]
    tp2: dict[str, float]
    tp2_cold: Answers
    tp2_hit: Answers
    tp2_hit_gets: float
    hit_blocks: int          # whole blocks before each prompt's last token


@pytest.fixture(scope="module")
def runs(engine_env: None, dsv32_model: Path) -> Iterator[Runs]:
    from kvo_transport.mooncake_master import MooncakeMaster

    with MooncakeMaster() as master:
        llm = _engine(dsv32_model, master, tp=1)
        _generate(llm)
        tp1 = _settled(master)   # before the stop: the blocks live in the engine's segment
        _stop(llm)
        del llm
    with MooncakeMaster() as master:
        llm = _engine(dsv32_model, master, tp=2)
        cold = _generate(llm)
        tokenizer = llm.get_tokenizer()
        hit_blocks = sum((len(tokenizer(p).input_ids) - 1) // BLOCK_SIZE for p in PROMPTS)
        tp2 = _settled(master)
        assert llm.reset_prefix_cache()
        before = _gets(_metrics(master))
        hit = _generate(llm)
        gets = _gets(_metrics(master)) - before
        _stop(llm)
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
    assert _distance(runs.tp2_hit, runs.tp2_cold) <= LOGPROB_TOLERANCE
    # The hit reads each block's keys (2 layers x main KV and indexer) once on each rank.
    assert runs.hit_blocks > 0
    assert runs.tp2_hit_gets == 2 * runs.hit_blocks * NUM_LAYERS * 2
