"""kvo's sparse decode offload at decode DP 2 with vLLM's own data parallelism.

A real vLLM API server (``--data-parallel-size 2``: two engine cores, one worker each) serves
the tiny DSA model in kvo's offload mode. Each DP rank makes its own host pool (two pool files
appear at start, each mapped by another process); requests sent one at a time are answered
with exactly the tokens and logprobs of a DP 1 server (same settings, one thread like each DP
rank), and both DP ranks serve some (vLLM's per-engine request counters on ``/metrics``).

By hand: ``HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 python -m pytest -q
tests/e2e/test_dsa_offload_dp2.py`` (``nox -s e2e`` sets these).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import _engines as e2e
import attrs
import pytest

NUM_LAYERS = 2
INDEX_TOPK = 32
BLOCK_SIZE = 64
STEP_TOKENS = 128
MAX_MODEL_LEN = 1024
MAX_TOKENS = 5
PROMPTS = [f"Request {i}: sparse attention reads only the rows the indexer selects. " * 2
           for i in range(6)]
OFFLOAD = {"kvo_sparse": {"mode": "offload"}}




@attrs.frozen
class Served:
    answers: e2e.Answers
    pools: set[Path]
    pool_holders: list[set[int]]
    per_engine: dict[str, float]     # vLLM's finished requests per DP rank (engine label)
    dp1_answers: e2e.Answers


def _ask(url: str) -> e2e.Answers:
    """Each prompt in turn (one at a time), in PROMPTS' order."""
    prompts = {str(i): prompt for i, prompt in enumerate(PROMPTS)}
    return list(e2e.answers_of(url, prompts, MAX_TOKENS).values())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from kvo_tools.models.tiny_dsv32 import build_tiny_dsv32
    from kvo_tools.pd.cluster import Cluster, free_port, wait_healthy

    workdir = tmp_path_factory.mktemp("dsa-dp2")
    model = build_tiny_dsv32(workdir / "model", num_layers=NUM_LAYERS, index_topk=INDEX_TOPK)
    args = ["--max-num-batched-tokens", str(STEP_TOKENS), "--max-num-seqs", "2",
            "--additional-config", json.dumps(OFFLOAD)]
    with Cluster(workdir / "logs") as cluster:
        before = e2e.dsa_pool_files()
        dp2 = cluster.start_vllm(
            "dp2", model, free_port(), None, extra_args=["--data-parallel-size", "2", *args],
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
            max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
        wait_healthy([dp2], 900)
        pools = e2e.dsa_pool_files() - before
        holders = [e2e.lock_holders(p) for p in sorted(pools)]
        answers = _ask(dp2.url or "")
        per_engine = e2e.served_by_engine(dp2.url or "")
        # The DP 1 reference: one thread, like each DP rank above (vLLM-CPU gives each local
        # DP rank one of the two cores), since CPU matmuls round by thread count.
        dp1 = cluster.start_vllm(
            "dp1", model, free_port(), None, extra_args=args,
            env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
            max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
        wait_healthy([dp1], 900)
        yield Served(answers=answers, pools=pools, pool_holders=holders,
                     per_engine=per_engine, dp1_answers=_ask(dp1.url or ""))


def test_each_dp_rank_has_its_own_pool(served: Served) -> None:
    assert len(served.pools) == 2
    assert all(len(h) == 1 for h in served.pool_holders)          # one process maps each
    assert served.pool_holders[0] != served.pool_holders[1]


def test_dp2_answers_equal_dp1_and_both_ranks_serve(served: Served) -> None:
    assert sorted(served.per_engine) == ["0", "1"], served.per_engine
    assert all(count >= 1 for count in served.per_engine.values()), served.per_engine
    assert sum(served.per_engine.values()) == len(PROMPTS)
    assert served.answers == served.dp1_answers
