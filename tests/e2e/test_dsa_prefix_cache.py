"""vLLM's prefix cache with kvo's sparse MLA backend, resident and offload mode, in real engines.

A tiny random DeepSeek-V3.2-architecture model (byte tokenizer: one token per byte)
runs the same sequence of generate calls in five engines, one after the other, in this
process: resident mode with the prefix cache off (the oracle), resident mode with it on,
offload mode (main KV in kvo's host pool, addressed by vLLM's block ids) with it on, and
offload mode with the fused decode ops (``kernel_backend="fused"``) with it off and on. The
calls share a 3-block prefix (block size 64):

1. ``PREFIX + s1`` alone: nothing cached yet;
2. ``PREFIX + s2`` alone: a hit on the prefix's 3 full blocks (192 tokens);
3. ``PREFIX + s3`` and ``PREFIX + s4`` together: both hit, the two running requests hold the
   same cached blocks at once;
4. two long unrelated prompts that need every block of the small KV space
   (``num_gpu_blocks_override``): the prefix's cached blocks are evicted and written with
   other tokens;
5. ``PREFIX + s1`` again: no hit any more (the blocks now hold other tokens), and the answer
   must still be call 1's;
6. the prefix's first 192 tokens plus one: a hit on call 5's blocks whose first step computes
   one token, so in offload mode it takes the decode path (residency) from its first step, in
   the batch row call 5's request left.

Every engine's tokens and logprobs equal the oracle's exactly; the hits are counted by
vLLM's own prefix-cache metrics (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``)
and each request's ``num_cached_tokens``; on a hit only the uncached tokens' KV rows are
written (kvo's counter), so the prefix rows come from the blocks already written (in offload
mode: from the host pool rows those block ids address).

By hand: ``HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 python -m pytest -q
tests/e2e/test_dsa_prefix_cache.py`` (``nox -s e2e`` sets these).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _engines as e2e
import attrs
import pytest

NUM_LAYERS = 2
INDEX_TOPK = 32
BLOCK = 64
MAX_TOKENS = 8
STEP_TOKENS = 3 * BLOCK    # the oracle computes the prefix in one chunk, the suffix in the next
BLOCKS = 9                 # vLLM's null block + 8: call 4's two prompts need all 8
PREFIX = ("A shared system prompt: answer briefly, cite the source, and never invent a number "
          "that the context does not give. Sparse attention keeps the long context cheap, and "
          "shared prompts are computed once. ")
SUFFIXES = ["Question one: why?", "Question two: how many?", "Question three: where?",
            "Question four: when was it?"]
FILLERS = ["Unrelated filler text that takes the blocks the shared prefix left in the cache. " * 3,
           "Another unrelated prompt, long enough to need four blocks of sixty-four tokens. " * 3]
CALLS: list[list[str]] = [
    [PREFIX + SUFFIXES[0]],
    [PREFIX + SUFFIXES[1]],
    [PREFIX + SUFFIXES[2], PREFIX + SUFFIXES[3]],
    FILLERS,
    [PREFIX + SUFFIXES[0]],
    [PREFIX[:3 * BLOCK] + "?"],
]
HIT_TOKENS = 3 * BLOCK     # the prefix's full blocks (its first 192 bytes)

MODES = ["resident", "offload", "fused"]
"""The engines with the prefix cache on (``fused``: offload mode with the fused decode ops)."""

engine_env = e2e.engine_env_fixture()
dsv32_model = e2e.dsv32_model_fixture("tiny-dsv32-prefix", num_layers=NUM_LAYERS,
                                      index_topk=INDEX_TOPK)


@attrs.frozen
class Call:
    answers: e2e.Answers
    prompt_tokens: list[int]         # per request
    cached_tokens: list[int]         # per request: RequestOutput.num_cached_tokens
    prefix_cache_hits: int           # vllm:prefix_cache_hits over this call
    prefix_cache_queries: int        # vllm:prefix_cache_queries over this call
    kv_rows_written: int             # kvo's main-KV rows written over this call (all layers)


def _counter(llm: Any, name: str) -> int:
    return int(sum(metric.value for metric in llm.get_metrics() if metric.name == name))


def _run_calls(llm: Any) -> list[Call]:
    from vllm import SamplingParams

    from kvo_vllm.dsa.stats import COUNTERS

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    calls = []
    for prompts in CALLS:
        hits = _counter(llm, "vllm:prefix_cache_hits")
        queries = _counter(llm, "vllm:prefix_cache_queries")
        written = COUNTERS.kv_rows_written
        outputs = llm.generate(prompts, params, use_tqdm=False)
        answers = []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            answers.append((tokens, [step[token].logprob for step, token in
                                     zip(completion.logprobs, tokens, strict=True)]))
        calls.append(Call(
            answers=answers, prompt_tokens=[len(o.prompt_token_ids or []) for o in outputs],
            cached_tokens=[int(o.num_cached_tokens or 0) for o in outputs],
            prefix_cache_hits=_counter(llm, "vllm:prefix_cache_hits") - hits,
            prefix_cache_queries=_counter(llm, "vllm:prefix_cache_queries") - queries,
            kv_rows_written=COUNTERS.kv_rows_written - written))
    return calls


def _engine_calls(model: Path, *, mode: str, prefix_caching: bool,
                  **sparse: Any) -> list[Call]:
    llm = e2e.start_engine(model, max_model_len=5 * BLOCK, max_num_seqs=2,
                           max_num_batched_tokens=STEP_TOKENS, num_gpu_blocks_override=BLOCKS,
                           block_size=BLOCK, enable_prefix_caching=prefix_caching,
                           disable_log_stats=False,
                           additional_config={"kvo_sparse": {"mode": mode, **sparse}})
    try:
        config = llm.llm_engine.vllm_config.cache_config
        assert config.enable_prefix_caching is prefix_caching
        return _run_calls(llm)
    finally:
        e2e.stop_engine(llm)


@attrs.frozen
class Runs:
    oracle: list[Call]              # resident, prefix cache off
    resident: list[Call]            # resident, prefix cache on
    offload: list[Call]             # offload, prefix cache on
    fused_oracle: list[Call]        # offload with the fused ops, prefix cache off
    fused: list[Call]               # offload with the fused ops, prefix cache on


@pytest.fixture(scope="module")
def runs(engine_env: None, dsv32_model: Path) -> Runs:
    def calls(mode: str, prefix_caching: bool, **sparse: Any) -> list[Call]:
        return _engine_calls(dsv32_model, mode=mode, prefix_caching=prefix_caching, **sparse)

    return Runs(oracle=calls("resident", False), resident=calls("resident", True),
                offload=calls("offload", True),
                fused_oracle=calls("offload", False, kernel_backend="fused"),
                fused=calls("offload", True, kernel_backend="fused"))


def _oracle(runs: Runs, mode: str) -> list[Call]:
    """The same engine's calls with the prefix cache off (the fused ops round differently from
    the unfused ones, so the fused engine has its own oracle)."""
    return runs.fused_oracle if mode == "fused" else runs.oracle


def _prompt_tokens(prompt: str) -> int:
    return len(prompt.encode())   # byte tokenizer, no BOS


def test_prompts_fit_the_plan() -> None:
    assert HIT_TOKENS < _prompt_tokens(PREFIX) < HIT_TOKENS + BLOCK
    for prompts in CALLS:
        assert all(_prompt_tokens(p) + MAX_TOKENS <= 5 * BLOCK for p in prompts)
    # Call 4's two prompts need all 8 blocks: the prefix's cached blocks must be reused.
    assert sum(-(-(_prompt_tokens(p) + MAX_TOKENS) // BLOCK) for p in FILLERS) == BLOCKS - 1


@pytest.mark.parametrize("mode", MODES)
def test_prefix_hits_answer_exactly_as_without_prefix_caching(runs: Runs, mode: str) -> None:
    """Tokens and logprobs bit-equal for every call whose steps have the oracle's shapes: the
    hit computes the suffix in one step, as the oracle's second prefill chunk does. Call 3's
    two hits are computed in one step where the oracle batches a prefix chunk with the other
    request's suffix: its tokens are equal and its logprobs within 1e-5 (the float32 GEMMs of
    the linear layers round differently for a different number of rows; offload and resident
    with hits agree bit for bit there, test_offload_with_prefix_hits_equals_resident...).

    The fused ops attend a step's selected rows misses first (their softmax sums in another
    order when some rows are already resident): call 6's first step finds call 5's rows in
    its residency row (same blocks, same block versions), where the oracle's request starts
    with all misses; its tokens are equal and its logprobs within 1e-4."""
    calls = getattr(runs, mode)
    for number, (call, want) in enumerate(zip(calls, _oracle(runs, mode), strict=True),
                                          start=1):
        if number == 6 and mode == "fused":
            assert e2e.logprob_distance(call.answers, want.answers) < 1e-4
        elif number == 3:
            assert e2e.logprob_distance(call.answers, want.answers) < 1e-5
        else:
            assert call.answers == want.answers, f"call {number}"


@pytest.mark.parametrize("mode", MODES)
def test_second_request_is_a_hit_counted_by_vllm(runs: Runs, mode: str) -> None:
    calls: list[Call] = getattr(runs, mode)
    assert calls[0].cached_tokens == [0]
    assert calls[1].cached_tokens == [HIT_TOKENS]
    assert calls[2].cached_tokens == [HIT_TOKENS, HIT_TOKENS]
    assert calls[0].prefix_cache_hits == 0
    assert calls[1].prefix_cache_hits == HIT_TOKENS
    assert calls[2].prefix_cache_hits == 2 * HIT_TOKENS
    assert calls[1].prefix_cache_queries == calls[1].prompt_tokens[0]
    # Call 6: every prompt token but the last was cached: its first step computes one token.
    assert calls[5].cached_tokens == [HIT_TOKENS] == [calls[5].prompt_tokens[0] - 1]
    # The oracles had no hits at all.
    assert all(call.prefix_cache_hits == 0 and set(call.cached_tokens) == {0}
               for call in _oracle(runs, mode))


@pytest.mark.parametrize("mode", MODES)
def test_a_hit_writes_only_the_uncached_rows(runs: Runs, mode: str) -> None:
    """The prefix's rows are not computed again: they are read from the blocks (in offload
    mode the host pool rows) the first request wrote."""
    calls: list[Call] = getattr(runs, mode)
    oracle = _oracle(runs, mode)
    for index in (1, 2, 5):
        fed = sum(tokens + MAX_TOKENS - 1 for tokens in oracle[index].prompt_tokens)
        assert oracle[index].kv_rows_written == NUM_LAYERS * fed
        hits = sum(calls[index].cached_tokens)
        assert calls[index].kv_rows_written == NUM_LAYERS * (fed - hits)


@pytest.mark.parametrize("mode", MODES)
def test_an_evicted_prefix_whose_blocks_were_reused_answers_exactly(runs: Runs,
                                                                    mode: str) -> None:
    calls: list[Call] = getattr(runs, mode)
    assert calls[4].cached_tokens == [0]          # its blocks now hold the fillers' tokens
    assert calls[4].prefix_cache_hits == 0
    assert calls[4].answers == calls[0].answers == _oracle(runs, mode)[0].answers


def test_offload_with_prefix_hits_equals_resident_with_prefix_hits(runs: Runs) -> None:
    for offload, resident in zip(runs.offload, runs.resident, strict=True):
        assert offload.answers == resident.answers
        assert offload.cached_tokens == resident.cached_tokens
