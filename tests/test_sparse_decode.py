"""Sparse decode offload end to end on the tiny DeepSeek-V3.2-style model (issue 5).

Path (a) keeps every request's whole KV resident (``ResidentBackend``, the oracle); path (b)
is ``SparseDecodeOffload``: history in a shared host pool, per layer a 128-row hot buffer per
request, top-64 selection, LRU residency, miss-only copies. Greedy decoding of several
concurrent requests (joining and leaving mid-run, one admitted through the P/D "fill the pool,
then admit_from_pool" path) must give the same tokens on both paths, and TP=2 (two processes
on one pool, only rank 0 writing) must give them too.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import pytest
import torch
from models.tiny_dsa import LayerRows, ResidentBackend, TinyDSA, TinyDSAConfig

from kvo_core.config import SparseDecodeOffloadConfig
from kvo_core.errors import ConfigError
from kvo_kernels import ops
from kvo_vllm.sparse import (
    AdmissionError,
    DecodeInputError,
    RequestCapacityError,
    SparseDecodeOffload,
    SparseModelLayout,
    TensorParallelError,
    UnknownRequestError,
)

STEPS = 72
CAPACITY = 128
MAX_ROWS = 4
MAX_MODEL_LEN = 640
PD_REQUEST = 3  # admitted through reserve + direct pool fill + admit_from_pool


@attrs.frozen
class Req:
    rid: int
    prompt_len: int
    join: int
    leave: int | None = None  # step at which it finishes; None = runs to the end


SCENARIO = (
    Req(0, 150, join=0),
    Req(1, 420, join=0, leave=30),
    Req(2, 260, join=12),
    Req(3, 500, join=30),          # takes the rows request 1 freed at the same step
    Req(4, 200, join=45, leave=60),
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Several processes share 2 cores here; more torch threads only oversubscribe them."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def offload_config(residency: str = "torch") -> SparseDecodeOffloadConfig:
    return SparseDecodeOffloadConfig(top_k=TinyDSAConfig().top_k, block_size=16,
                                     hot_capacity=CAPACITY, residency_backend=residency)


def model_layout(cfg: TinyDSAConfig) -> SparseModelLayout:
    return SparseModelLayout(num_layers=cfg.num_layers, latent_dim=cfg.latent_dim,
                             rope_dim=cfg.rope_dim, index_dim=cfg.index_dim,
                             softmax_scale=cfg.softmax_scale, kv_dtype=torch.float32,
                             index_dtype=torch.float32)


def pool_name() -> str:
    return f"test-{os.getpid()}-{uuid.uuid4().hex[:10]}"


def prefill_all(model: TinyDSA) -> dict[int, tuple[list[LayerRows], int]]:
    gen = torch.Generator().manual_seed(1234)
    prompts = {r.rid: torch.randint(0, model.config.vocab_size, (r.prompt_len,),
                                    generator=gen).tolist() for r in SCENARIO}
    return {rid: model.prefill(prompt) for rid, prompt in prompts.items()}


def admit_via_pool(engine: SparseDecodeOffload, rid: int, history: Sequence[LayerRows]) -> None:
    """What the P/D path does: reserve, let the transfer fill pool + indexer, then admit."""
    length = history[0].kv.shape[0]
    engine.reserve(rid, length)
    for layer, rows in enumerate(history):
        if engine.tp_rank == 0:
            engine.host_rows(rid, layer)[:length] = torch.cat([rows.kv, rows.k_rope], dim=-1)
        engine.indexer_rows(rid, layer)[:length] = rows.index_key
    engine.admit_from_pool(rid, length)


StepHook = Callable[[int, list[int]], None]


def run_scenario(model: TinyDSA, backend: Any, histories: dict[int, tuple[list[LayerRows], int]],
                 *, pd_admit: bool = False, on_step: StepHook | None = None,
                 steps: int = STEPS) -> dict[int, list[int]]:
    """Greedy decoding of SCENARIO; returns every request's generated tokens."""
    generated: dict[int, list[int]] = {}
    last: dict[int, int] = {}
    position: dict[int, int] = {}
    for step in range(steps):
        for req in SCENARIO:
            if req.leave == step:
                backend.finish(req.rid)
                del last[req.rid], position[req.rid]
        for req in SCENARIO:
            if req.join == step:
                history, first = histories[req.rid]
                if pd_admit and req.rid == PD_REQUEST:
                    admit_via_pool(backend, req.rid, history)
                else:
                    backend.admit(req.rid, history)
                generated[req.rid] = [first]
                last[req.rid], position[req.rid] = first, req.prompt_len
        ids = sorted(last)
        tokens = model.decode_step(backend, ids, [last[i] for i in ids],
                                   [position[i] for i in ids])
        for rid, token in zip(ids, tokens, strict=True):
            generated[rid].append(token)
            last[rid] = token
            position[rid] += 1
        if on_step is not None:
            on_step(step, ids)
    return generated


@attrs.define
class CopySpy:
    """Counts the bytes every ``kvo_kernels.ops.sparse_copy`` call actually moves."""

    calls: list[tuple[int, str, str]] = attrs.Factory(list)

    def wrap(self, real: Callable[..., None]) -> Callable[..., None]:
        def spy(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                dst_rows: torch.Tensor, **kwargs: Any) -> None:
            moved = src_rows.numel() * src[0].numel() * src.element_size()
            self.calls.append((moved, str(src.device), str(dst.device)))
            real(src, dst, src_rows, dst_rows, **kwargs)
        return spy


@attrs.frozen
class Runs:
    model: TinyDSA
    histories: dict[int, tuple[list[LayerRows], int]]
    resident_tokens: dict[int, list[int]]
    offload_tokens: dict[int, list[int]]
    selections: list[dict[tuple[int, int], list[int]]]  # per step: (request, layer) -> top-k
    step_stats: list[Any]
    spied_bytes: list[int]
    row_bytes: int
    pool_starts: dict[int, int]


@pytest.fixture(scope="module")
def runs() -> Runs:
    model = TinyDSA(TinyDSAConfig())
    histories = prefill_all(model)

    resident = ResidentBackend(model.config, MAX_MODEL_LEN)
    selections: list[dict[tuple[int, int], list[int]]] = []

    def record_selection(step: int, ids: list[int]) -> None:
        selections.append({key: value.tolist() for key, value in resident.selected.items()
                           if key[0] in ids})

    resident_tokens = run_scenario(model, resident, histories, on_step=record_selection)

    spy = CopySpy()
    real_copy = ops.sparse_copy
    ops.sparse_copy = spy.wrap(real_copy)  # the engine calls ops.sparse_copy for every copy
    step_stats: list[Any] = []
    spied: list[int] = []
    starts: dict[int, int] = {}
    try:
        with SparseDecodeOffload(offload_config(), model_layout(model.config),
                                 max_rows=MAX_ROWS, max_model_len=MAX_MODEL_LEN,
                                 pool_name=pool_name()) as engine:
            def record_step(step: int, ids: list[int]) -> None:
                step_stats.append(engine.last_step)
                spied.append(sum(moved for moved, _, _ in spy.calls))
                spy.calls.clear()
                for rid in ids:
                    starts.setdefault(rid, engine.placement(rid).start)

            offload_tokens = run_scenario(model, engine, histories, pd_admit=True,
                                          on_step=record_step)
            row_bytes = engine.row_bytes
    finally:
        ops.sparse_copy = real_copy
    return Runs(model, histories, resident_tokens, offload_tokens, selections, step_stats,
                spied, row_bytes, starts)


def test_offload_tokens_equal_resident_tokens(runs: Runs) -> None:
    assert set(runs.offload_tokens) == {r.rid for r in SCENARIO}
    for req in SCENARIO:
        decoded = (req.leave or STEPS) - req.join
        assert len(runs.resident_tokens[req.rid]) == decoded + 1
    assert runs.offload_tokens == runs.resident_tokens
    # The run really exercised selection changes: the top-k moved between steps.
    changed = sum(set(runs.selections[s][(0, 1)]) != set(runs.selections[s - 1][(0, 1)])
                  for s in range(1, STEPS))
    assert changed > STEPS // 2


def test_native_residency_gives_the_same_tokens_and_copies(runs: Runs) -> None:
    """The C++/OpenMP residency table in place of kvo-core's torch one changes nothing."""
    from kvo_kernels.native_build import NativeBuildError, load_native_ops

    try:
        load_native_ops()
    except NativeBuildError as error:
        pytest.skip(f"kvo's native residency op does not build here: {error}")
    stats: list[Any] = []
    with SparseDecodeOffload(offload_config("native"), model_layout(runs.model.config),
                             max_rows=MAX_ROWS, max_model_len=MAX_MODEL_LEN,
                             pool_name=pool_name()) as engine:
        assert type(engine._tables[0]).__name__ == "NativeResidencyTable"
        tokens = run_scenario(runs.model, engine, runs.histories,
                              on_step=lambda step, ids: stats.append(engine.last_step))
    assert tokens == runs.offload_tokens
    assert stats == runs.step_stats


def test_request_joining_later_reuses_finished_rows(runs: Runs) -> None:
    # Request 1 (420 + 72 budget rows) finished at step 30, request 3 joined at step 30.
    assert runs.pool_starts[3] == runs.pool_starts[1]


def lru_trace(steps: Sequence[Sequence[int]], capacity: int) -> list[tuple[set[int], int]]:
    """Per step of one (request, layer): (tokens resident before it, its misses).

    Follows docs/design.md section 6 token by token: resident tokens in LRU order; the unselected
    ones are evicted least recent first; the new order is [kept unselected..., misses
    (ascending on the first step)..., hits...].
    """
    resident: list[int] = []
    trace = []
    for i, selection in enumerate(steps):
        chosen = list(dict.fromkeys(t for t in selection if t >= 0))
        held = set(resident)
        misses = [t for t in chosen if t not in held]
        if i == 0:
            misses.sort()
        keep = [t for t in resident if t not in set(chosen)]
        hits = [t for t in resident if t in set(chosen)]
        keep = keep[max(0, len(keep) + len(chosen) - capacity):]
        trace.append((held, len(misses)))
        resident = keep + misses + hits
    return trace


def test_bytes_copied_equal_misses_times_row_bytes(runs: Runs) -> None:
    num_layers = runs.model.config.num_layers
    expected = [0] * STEPS
    for req in SCENARIO:
        for layer in range(num_layers):
            trace = [runs.selections[s][(req.rid, layer)]
                     for s in range(req.join, req.leave or STEPS)]
            for offset, (_, count) in enumerate(lru_trace(trace, CAPACITY)):
                expected[req.join + offset] += count
    misses = [stats.misses for stats in runs.step_stats]
    assert misses == expected
    for step, stats in enumerate(runs.step_stats):
        assert runs.spied_bytes[step] == stats.misses * runs.row_bytes == stats.h2d_bytes
        assert stats.hits + stats.misses == stats.selected
    # Far below a full reload of the history, every step (first-offload steps included) ...
    assert all(s.h2d_bytes < 0.5 * s.full_reload_bytes for s in runs.step_stats)
    # ... and in steady state (no request on its first step) a small fraction of it.
    joins = {r.join for r in SCENARIO}
    steady = [s for i, s in enumerate(runs.step_stats) if i not in joins]
    assert sum(s.h2d_bytes for s in steady) < 0.2 * sum(s.full_reload_bytes for s in steady)
    assert sum(s.hits for s in steady) > sum(s.misses for s in steady)


def test_corrupting_a_selected_host_row_changes_the_output(runs: Runs) -> None:
    """Overwrite, in the pool, a history row that the next step selects and that is not in
    the hot buffer (evicted earlier): the output must change from that step on, and not
    before (so the rows attention reads are exactly the pool rows the misses copied)."""
    rid, layer = 0, 1
    trace = lru_trace([runs.selections[s][(rid, layer)] for s in range(STEPS)], CAPACITY)
    step, token = next((s, t) for s in range(20, STEPS)
                       for t in runs.selections[s][(rid, layer)]
                       if t not in trace[s][0] and t < SCENARIO[rid].prompt_len)

    with SparseDecodeOffload(offload_config(), model_layout(runs.model.config),
                             max_rows=MAX_ROWS, max_model_len=MAX_MODEL_LEN,
                             pool_name=pool_name()) as engine:
        def corrupt_before_next(done: int, ids: list[int]) -> None:
            if done == step - 1:
                engine.host_rows(rid, layer)[token] = 1e3

        tokens = run_scenario(runs.model, engine, runs.histories, steps=step + 12,
                              on_step=corrupt_before_next)
    clean = runs.resident_tokens[rid]
    # tokens[rid][k + 1] is what decode step k produced.
    assert tokens[rid][:step + 1] == clean[:step + 1]
    assert tokens[rid][step + 1:] != clean[step + 1:step + 13]


# -- TP = 2: two processes, one pool --------------------------------------------------------

@attrs.frozen
class BlindRows:
    """The new rows without main KV (NaN): a rank > 0 must read main KV from the pool only."""

    kv: torch.Tensor
    k_rope: torch.Tensor
    index_key: torch.Tensor

    @classmethod
    def of(cls, rows: Any) -> BlindRows:
        return cls(torch.full_like(rows.kv, float("nan")),
                   torch.full_like(rows.k_rope, float("nan")), rows.index_key)


class BlindBackend:
    """Rank 1's view: forwards to the engine with every main-KV row replaced by NaN."""

    def __init__(self, engine: SparseDecodeOffload) -> None:
        self.engine = engine
        self.tp_rank = engine.tp_rank

    def admit(self, rid: int, history: Sequence[LayerRows]) -> None:
        self.engine.admit(rid, [BlindRows.of(rows) for rows in history])

    def reserve(self, rid: int, length: int) -> Any:
        return self.engine.reserve(rid, length)

    def host_rows(self, rid: int, layer: int) -> torch.Tensor:
        raise AssertionError("rank 1 must not write the host pool")

    def indexer_rows(self, rid: int, layer: int) -> torch.Tensor:
        return self.engine.indexer_rows(rid, layer)

    def admit_from_pool(self, rid: int, length: int) -> None:
        self.engine.admit_from_pool(rid, length)

    def decode_layer(self, layer: int, ids: Sequence[int], rows: Any, queries: Any) -> Any:
        return self.engine.decode_layer(layer, ids, BlindRows.of(rows), queries)

    def finish(self, rid: int) -> None:
        self.engine.finish(rid)


def tp_worker(rank: int, name: str, barrier: Any, results: Any) -> None:
    """One TP rank: rank 0 creates and writes the pool, rank 1 attaches and only reads."""
    try:
        torch.set_num_threads(1)
        model = TinyDSA(TinyDSAConfig())
        histories = prefill_all(model)

        def wait() -> None:
            barrier.wait(timeout=120)

        if rank == 1:
            wait()  # rank 0 has created the pool
        engine = SparseDecodeOffload(offload_config(), model_layout(model.config),
                                     max_rows=MAX_ROWS, max_model_len=MAX_MODEL_LEN,
                                     pool_name=name, tp_rank=rank, tp_size=2, tp_barrier=wait)
        if rank == 0:
            wait()
        backend: Any = engine if rank == 0 else BlindBackend(engine)
        tokens = run_scenario(model, backend, histories, pd_admit=True)
        wait()  # rank 0 keeps the pool until rank 1 is done with it
        engine.close()
        results.put(json.dumps({"rank": rank, "tokens": tokens}))
    except BaseException:
        barrier.abort()
        results.put(json.dumps({"rank": rank, "error": traceback.format_exc()}))


def test_tp2_ranks_share_one_pool_and_match_tp1(runs: Runs) -> None:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    results = context.Queue()
    name = pool_name()
    workers = [context.Process(target=tp_worker, args=(rank, name, barrier, results))
               for rank in (0, 1)]
    for worker in workers:
        worker.start()
    try:
        reports = [json.loads(results.get(timeout=170)) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    errors = [r["error"] for r in reports if "error" in r]
    assert not errors, "\n".join(errors)
    expected = {str(rid): tokens for rid, tokens in runs.offload_tokens.items()}
    for report in sorted(reports, key=lambda r: r["rank"]):
        assert report["tokens"] == expected, f"rank {report['rank']} differs from TP=1"


# -- admission, capacity, boundaries ---------------------------------------------------------

SMALL = SparseModelLayout(num_layers=2, latent_dim=8, rope_dim=4, index_dim=4,
                          softmax_scale=0.25, kv_dtype=torch.float32,
                          index_dtype=torch.float32)


def small_history(length: int, seed: int) -> list[LayerRows]:
    gen = torch.Generator().manual_seed(seed)
    return [LayerRows(kv=torch.randn(length, 8, generator=gen),
                      k_rope=torch.randn(length, 4, generator=gen),
                      index_key=torch.randn(length, 4, generator=gen)) for _ in range(2)]


def small_engine(pool_tokens: int, **kwargs: Any) -> SparseDecodeOffload:
    config = SparseDecodeOffloadConfig(
        top_k=4, block_size=16, hot_capacity=16,
        host_pool_bytes=4096 + pool_tokens * SMALL.host_bytes_per_token)
    return SparseDecodeOffload(config, SMALL, max_rows=4, max_model_len=64,
                               pool_name=pool_name(), **kwargs)


def test_admission_refused_when_pool_too_small_and_finish_frees_rows() -> None:
    with small_engine(pool_tokens=128) as engine:   # two requests of 64 tokens
        engine.admit("a", small_history(40, 1))
        engine.admit("b", small_history(20, 2))
        before = engine.host_rows("a", 0).clone()
        with pytest.raises(AdmissionError, match=r"request 'c' needs 64 host-pool rows.*"
                                                 r"0 free rows.*raise host_pool_bytes"):
            engine.admit("c", small_history(30, 3))
        assert torch.equal(engine.host_rows("a", 0), before)  # refusal wrote nothing
        with pytest.raises(UnknownRequestError):
            engine.finish("c")
        start_a = engine.placement("a").start
        engine.finish("a")
        engine.admit("c", small_history(30, 3))            # reuses a's rows
        assert engine.placement("c").start == start_a
        assert torch.equal(engine.host_rows("c", 1)[:30],
                           torch.cat([small_history(30, 3)[1].kv,
                                      small_history(30, 3)[1].k_rope], dim=-1))


def test_fused_kernel_backend_is_refused_by_the_harness() -> None:
    config = SparseDecodeOffloadConfig(top_k=4, block_size=16, hot_capacity=16,
                                       kernel_backend="fused")
    with pytest.raises(ConfigError, match=r"kernel_backend 'fused' .* allowed here: auto, "
                                          r"reference, triton"):
        SparseDecodeOffload(config, SMALL, max_rows=4, max_model_len=64, pool_name=pool_name())


def test_history_longer_than_budget_is_refused() -> None:
    with small_engine(pool_tokens=256) as engine:
        with pytest.raises(AdmissionError, match="max_tokens must be an integer in"):
            engine.admit("long", small_history(64, 1))
        with pytest.raises(AdmissionError, match="max_tokens"):
            engine.admit("tight", small_history(10, 1), max_tokens=10)


def test_decode_past_reserved_rows_raises_before_writing() -> None:
    with small_engine(pool_tokens=256) as engine:
        engine.admit("r", small_history(15, 1), max_tokens=16)
        rows = small_history(1, 9)[0]
        queries = attrs.make_class("Q", ["query", "query_rope", "index_query",
                                         "index_weights"])(
            torch.randn(1, 2, 8), torch.randn(1, 2, 4), torch.randn(1, 3, 4),
            torch.rand(1, 3))
        # Budgets are whole blocks (16 rows): the 16th token fits, the 17th does not.
        for layer in range(2):
            engine.decode_layer(layer, ["r"], rows, queries)
        with pytest.raises(RequestCapacityError, match="reached its reserved 16 host-pool rows"):
            engine.decode_layer(0, ["r"], rows, queries)
        engine.admit("s", small_history(4, 2))
        bad = LayerRows(kv=torch.zeros(1, 7), k_rope=rows.k_rope, index_key=rows.index_key)
        with pytest.raises(DecodeInputError, match="kv must have shape"):
            engine.decode_layer(0, ["s"], bad, queries)
        with pytest.raises(DecodeInputError, match="expects layer 0 next, got layer 1"):
            engine.decode_layer(1, ["s"], rows, queries)


def test_rank1_attach_checks_layout() -> None:
    with small_engine(pool_tokens=64) as engine:
        other = attrs.evolve(SMALL, latent_dim=16)
        with pytest.raises(TensorParallelError, match="created for another layout"):
            SparseDecodeOffload(engine.config, other, max_rows=4, max_model_len=64,
                                pool_name=engine.store.pool.name, tp_rank=1, tp_size=2,
                                tp_barrier=lambda: None)
