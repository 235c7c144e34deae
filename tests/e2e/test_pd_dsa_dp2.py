"""End to end: a decode with vLLM's data parallelism (DP 2 x TP 1) as the P/D decode.

Real vLLM API servers, Mooncake and the kvo proxy. The decode is ONE API server with
``--data-parallel-size 2`` (two engine cores, one worker each, one core each) serving the tiny
DSA model in kvo's offload mode with ``RemoteD2HConnector``: each DP rank binds its own control
port (``kv_port + dp_rank``), makes its own host pool and writes its own stats file
(``decode-stats.json.dp<rank>``). The proxy learns the DP size from the first advertisement and
then pins each request to a DP rank (``X-data-parallel-rank``), posting the prefill at once to
that rank's endpoints; its ``/kvo/v1/metadata`` says which DP rank took each request.

1. A TP 1 prefill (one thread) feeds the DP 2 decode: every answer equals, tokens and logprobs,
   the answer of a DP 1 decode (same settings, one thread like each DP rank) computing the
   prompt itself; both DP ranks pull requests (kvo's per-rank stats and vLLM's per-engine
   counters), each rank's pulled bytes are exactly its requests' full prompt blocks.
2. A TP 2 prefill feeds the same decode (p_tp 2 -> d_tp 1 in each DP rank): same tokens as the
   DP 1 decode's own answer, logprobs within the TP rounding (1e-3), bytes exact when no pull
   failed (on 2 CPUs the TP 2 prefill's workers can starve the decode past the layer deadline:
   the fence refuses the read and the request is recomputed, never wrong; see test_pd_dsa_tp2).

Mooncake's transfer engine listens on every interface, so this runs in a loopback-only network
namespace (``nox -s e2e`` does that; by hand see ``test_pd.py``).
"""

from __future__ import annotations

import json
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
MAX_TOKENS = 5
DEADLINE_S = 60.0
ROW_BYTES = e2e.DSA_MAIN_ROW_VALUES * 4  # float32
TP2_LOGPROB_TOLERANCE = 1e-3
TP1_CASES = [("alpha", 200), ("bravo", 140), ("charlie", 260), ("delta", 150), ("echo", 190)]
TP2_CASES = [("foxtrot", 200), ("golf", 150), ("hotel", 170)]
OFFLOAD = ["--additional-config", json.dumps({"kvo_sparse": {"mode": "offload"}})]
STEPS = ["--max-num-batched-tokens", str(BLOCK_SIZE), "--max-num-seqs", "2"]

@attrs.frozen
class PulledPhase:
    """What one prefill -> DP 2 decode phase saw."""

    answers: dict[str, e2e.Answer]
    records: list[dict[str, Any]]      # the proxy's record of each request, in order
    grew: dict[int, dict[str, int]]    # DP rank -> part -> bytes pulled in this phase
    pulled: dict[int, int]             # DP rank -> requests received in this phase
    failed: dict[int, int]             # DP rank -> pulls failed in this phase


@attrs.frozen
class Served:
    want: dict[str, e2e.Answer]        # the DP 1 decode's own answers
    tp1: PulledPhase
    tp2: PulledPhase | None             # None with KVO_E2E_SKIP_TP2_PD=1 (e2e.HEAVY_TP2_PD)
    kv_port: int
    endpoints: dict[int, str]          # DP rank -> its control endpoint (its stats file)
    pools: set[Path]
    pool_holders: list[set[int]]
    per_engine: dict[str, float]       # vLLM's finished requests per DP rank (engine label)


def _ask(url: str, cases: list[tuple[str, int]]) -> dict[str, e2e.Answer]:
    from kvo_tools.pd.prompts import tagged_prompt

    return e2e.answers_of(url, {tag: tagged_prompt(tag, length) for tag, length in cases},
                          MAX_TOKENS)


def _rank_stats(stats: Path, dp_rank: int) -> dict[str, Any]:
    from kvo_tools.pd.stats import decode_stats

    return decode_stats(Path(f"{stats}.dp{dp_rank}"))


def _settled(stats: Path, ended: dict[int, int]) -> dict[int, dict[str, Any]]:
    from kvo_tools.pd.stats import settled_decode_stats

    return {rank: settled_decode_stats(Path(f"{stats}.dp{rank}"), count)
            for rank, count in ended.items()}


def _phase(proxy: str, stats: Path, cases: list[tuple[str, int]]) -> PulledPhase:
    from kvo_tools.pd.cluster import get_json

    before = {rank: _rank_stats(stats, rank) for rank in (0, 1)}
    answers = _ask(proxy, cases)
    records = get_json(proxy + "/kvo/v1/metadata")["requests"][-len(cases):]
    per_rank = {rank: sum(1 for r in records if r["dp_rank"] == rank) for rank in (0, 1)}
    ended = {rank: e2e.ended_pulls(before[rank]) + per_rank[rank] for rank in (0, 1)}
    after = _settled(stats, ended)
    return PulledPhase(
        answers=answers, records=records,
        grew={rank: e2e.pulled_bytes(before[rank], after[rank]) for rank in (0, 1)},
        pulled={rank: after[rank].get("received", 0) - before[rank].get("received", 0)
                for rank in (0, 1)},
        failed={rank: after[rank].get("failed", 0) - before[rank].get("failed", 0)
                for rank in (0, 1)})


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from kvo_tools.models.tiny_dsv32 import build_tiny_dsv32
    from kvo_tools.pd.cluster import Cluster, decode_transfer_config, free_port, wait_healthy

    workdir = tmp_path_factory.mktemp("pd-dsa-dp2")
    model = build_tiny_dsv32(workdir / "model", num_layers=NUM_LAYERS, index_topk=INDEX_TOPK)
    stats = workdir / "decode-stats.json"

    with Cluster(workdir / "logs") as cluster:
        # The reference: a DP 1 decode with the same settings, one thread like each DP rank
        # below (CPU matmuls round by thread count), answering every prompt itself.
        dp1 = cluster.start_vllm(
            "decode-dp1", model, free_port(), decode_transfer_config(
                free_port(), workdir / "dp1-stats.json", layer_deadline_s=DEADLINE_S,
                read_retries=0),
            extra_args=[*STEPS, *OFFLOAD], env={"VLLM_CPU_OMP_THREADS_BIND": "0"},
            max_model_len=1024, block_size=BLOCK_SIZE)
        wait_healthy([dp1], 900)
        want = _ask(dp1.url or "", TP1_CASES + TP2_CASES)
        dp1.stop()

        kv_port = free_port()
        before = e2e.dsa_pool_files()
        decode = cluster.start_vllm(
            "decode-dp2", model, free_port(), decode_transfer_config(
                kv_port, stats, layer_deadline_s=DEADLINE_S, read_retries=0),
            extra_args=["--data-parallel-size", "2", *STEPS, *OFFLOAD],
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", **e2e.UNBOUND_PD_WORKERS},
            max_model_len=1024, block_size=BLOCK_SIZE)
        prefill = cluster.start_vllm(
            "prefill-tp1", model, free_port(), e2e.remote_d2h_producer(kv_port, DEADLINE_S),
            extra_args=STEPS,
            env={"VLLM_CPU_OMP_THREADS_BIND": "1"}, max_model_len=1024,
            block_size=BLOCK_SIZE)
        proxy = cluster.start_proxy(free_port(), prefill.url or "", decode.url or "")
        wait_healthy([decode, prefill, proxy], 900)
        pools = e2e.dsa_pool_files() - before
        holders = [e2e.lock_holders(p) for p in sorted(pools)]
        tp1 = _phase(proxy.url or "", stats, TP1_CASES)
        proxy.stop()
        prefill.stop()

        tp2 = None
        if e2e.RUN_TP2_PREFILL_PD:
            prefill2 = cluster.start_vllm(
                "prefill-tp2", model, free_port(), e2e.remote_d2h_producer(kv_port, DEADLINE_S),
                extra_args=[*STEPS, "--tensor-parallel-size", "2",
                            "--distributed-executor-backend", "mp"],
                env=e2e.UNBOUND_PD_WORKERS, max_model_len=1024, block_size=BLOCK_SIZE)
            proxy2 = cluster.start_proxy(free_port(), prefill2.url or "", decode.url or "",
                                         name="proxy-tp2")
            wait_healthy([prefill2, proxy2], 900)
            tp2 = _phase(proxy2.url or "", stats, TP2_CASES)
        endpoints = {rank: str(_rank_stats(stats, rank).get("endpoint")) for rank in (0, 1)}
        yield Served(want=want, tp1=tp1, tp2=tp2, kv_port=kv_port, endpoints=endpoints,
                     pools=pools, pool_holders=holders,
                     per_engine=e2e.served_by_engine(decode.url or ""))


def _full_block_bytes(cases: list[tuple[str, int]], tags: set[str], row_bytes: int) -> int:
    """Bytes of every full prompt block of every layer of the requests ``tags`` (decode
    computes each prompt's last, partial block itself)."""
    blocks = sum((length - 1) // BLOCK_SIZE for tag, length in cases if tag in tags)
    return blocks * NUM_LAYERS * BLOCK_SIZE * row_bytes


def _tags_by_rank(phase: PulledPhase, cases: list[tuple[str, int]]) -> dict[int, set[str]]:
    ranks: dict[int, set[str]] = {0: set(), 1: set()}
    for (tag, _), record in zip(cases, phase.records, strict=True):
        assert record["outcome"] == "ok", record
        ranks[record["dp_rank"]].add(tag)
    return ranks


def test_dp2_decode_answers_each_request_as_a_dp1_decode(served: Served) -> None:
    assert served.tp1.answers == {tag: served.want[tag] for tag, _ in TP1_CASES}


def test_requests_reach_both_dp_ranks_and_each_pulls_exactly_its_own(served: Served) -> None:
    phase = served.tp1
    ranks = _tags_by_rank(phase, TP1_CASES)
    assert all(ranks[rank] for rank in (0, 1)), ranks
    # The first request is unpinned and decode-first (vLLM picks the rank); then each DP rank
    # goes decode-first once at most, and once both ranks' endpoints are known every prefill
    # is posted at once, to the rank the request is pinned to.
    concurrent = [r["concurrent"] for r in phase.records]
    assert not concurrent[0] and concurrent.count(False) <= 2 and all(concurrent[3:]), concurrent
    assert phase.failed == {0: 0, 1: 0}
    assert phase.pulled == {rank: len(ranks[rank]) for rank in (0, 1)}
    for rank in (0, 1):
        assert phase.grew[rank] == {
            "kv": _full_block_bytes(TP1_CASES, ranks[rank], ROW_BYTES),
            "idx": _full_block_bytes(TP1_CASES, ranks[rank], e2e.DSA_INDEXER_ROW_BYTES)}, rank
    # vLLM's own per-engine counters agree that both engines served.
    assert sorted(served.per_engine) == ["0", "1"], served.per_engine
    assert all(count >= 1 for count in served.per_engine.values()), served.per_engine


def test_each_dp_rank_has_its_own_pool_and_control_port(served: Served) -> None:
    assert served.endpoints == {rank: f"tcp://127.0.0.1:{served.kv_port + rank}"
                                for rank in (0, 1)}
    assert len(served.pools) == 2
    assert all(len(h) == 1 for h in served.pool_holders)          # one process maps each
    assert served.pool_holders[0] != served.pool_holders[1]


@e2e.HEAVY_TP2_PD
def test_tp2_prefill_feeds_the_dp2_decode(served: Served) -> None:
    phase = served.tp2
    assert phase is not None
    worst = 0.0
    for tag, _ in TP2_CASES:
        got, want = phase.answers[tag], served.want[tag]
        assert got[0] == want[0], (tag, got[0], want[0])
        worst = max([worst, *(abs(a - b) for a, b in zip(got[1], want[1], strict=True))])
    assert worst < TP2_LOGPROB_TOLERANCE, worst
    ranks = _tags_by_rank(phase, TP2_CASES)
    assert all(ranks[rank] for rank in (0, 1)), ranks
    assert sum(phase.pulled.values()) + sum(phase.failed.values()) == len(TP2_CASES)
    assert sum(phase.pulled.values()) >= 1, phase
    for rank in (0, 1):
        if phase.failed[rank]:
            continue
        assert phase.grew[rank] == {
            "kv": _full_block_bytes(TP2_CASES, ranks[rank], ROW_BYTES),
            "idx": _full_block_bytes(TP2_CASES, ranks[rank], e2e.DSA_INDEXER_ROW_BYTES)}, rank
