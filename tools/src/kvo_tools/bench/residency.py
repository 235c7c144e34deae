"""Residency update speed and quality: vectorised vs reference (vs native op), LRU vs Belady.

For every R (decode rows), C (hot-buffer slots) and sequence length: a synthetic decode trace of
top-k selections (K=2048) where each step keeps ~85% of the previous step's tokens and draws the
rest uniformly from the sequence. Step 0 is the first offload (untimed); the following steps
are timed one update (one layer, all R rows) at a time. The reference is pure Python and slow,
so it is timed on the first few steady steps only (the table says how many). Every timed step
is also checked: the implementations must return identical results.

    python -m kvo_tools.bench.residency --json PATH [--quick] [--threads N] [--native-threads N]

With KVO_UPSTREAM_LRU_SRC pointing at a vllm-ascend checkout's
vllm_ascend/distributed/kv_transfer/sparse_kv_offload/sparse_kv_offload.cpp, upstream's own
host LRU (``lru_resident_compact``) is built from it and timed step by step alternately with
the native op, on the same trace and threads (column ``upstream``; n/a without it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvo_core.residency import (
    RESULT_DTYPE,
    ReferenceResidency,
    RequestState,
    ResidencyResult,
    ResidencyTable,
    belady_min_misses,
)
from kvo_core.residency.state import RESULT_FIELDS
from kvo_tools.bench._upstream_lru import ENV_VAR, UpstreamTable
from kvo_tools.bench._upstream_lru import build as build_upstream

TOP_K = 2048
KEEP = 0.85
FIELDS = RESULT_FIELDS


def load_native() -> type | None:
    """The C++/OpenMP op from kvo-kernels (built on first use), or None: the column says n/a."""
    try:
        from kvo_kernels.native_residency import NativeResidencyTable

        NativeResidencyTable(1, 1)  # compiles and loads the op now, not inside a timing
    except Exception as error:  # absent package, no compiler, failed build
        print(f"native residency op unavailable ({type(error).__name__}: {error}); n/a")
        return None
    return NativeResidencyTable


def load_upstream() -> Any:
    """Upstream's LRU built from ``KVO_UPSTREAM_LRU_SRC``, or None when the variable is unset."""
    source = os.environ.get(ENV_VAR)
    if not source:
        return None
    lib = build_upstream(Path(source))  # a bad path or source is an error, not a silent n/a
    print(f"upstream LRU built from {source}")
    return lib


def make_trace(rows: int, seq_len: int, steps: int, seed: int) -> list[torch.Tensor]:
    """steps + 1 top-k selections [rows, K], distinct tokens per row, ~KEEP overlap per step."""
    gen = torch.Generator().manual_seed(seed)
    current = torch.stack([torch.randperm(seq_len, generator=gen)[:TOP_K] for _ in range(rows)])
    trace = [current]
    for _ in range(steps):
        fresh = torch.rand((rows, TOP_K), generator=gen) >= KEEP
        nxt = current.clone()
        while True:  # redraw fresh entries until no row holds a token twice
            nxt[fresh] = torch.randint(0, seq_len, (int(fresh.sum()),), generator=gen)
            ordered, order = nxt.sort(dim=1)
            # Both members of an equal pair: the sort may put the kept one second, and only
            # fresh entries are redrawn (kept ones are distinct already).
            equal = ordered[:, 1:] == ordered[:, :-1]
            repeated = torch.zeros_like(fresh)
            repeated[:, 1:] |= equal
            repeated[:, :-1] |= equal
            again = torch.zeros_like(fresh).scatter_(1, order, repeated) & fresh
            if not bool(again.any()):
                break
            fresh = again
        trace.append(nxt)
        current = nxt
    return trace


class Timed:
    """One implementation under test: its table, its thread count, and what each step took."""

    def __init__(self, table: Any, threads: int, steps: int,
                 out: ResidencyResult | None = None) -> None:
        self.table, self.threads, self.steps, self.out = table, threads, steps, out
        self.wall: list[float] = []
        self.cpu: list[float] = []  # this thread's CPU time: less disturbed on a shared machine
        self._kept: dict[str, torch.Tensor] = {}

    def update(self, topk: torch.Tensor, requests: torch.Tensor, stable: torch.Tensor,
               states: torch.Tensor, timed: bool = True) -> None:
        torch.set_num_threads(self.threads)
        start, start_cpu = time.perf_counter(), time.thread_time()
        if self.out is None:
            result = self.table.update(topk, requests, stable, states)
        else:
            result = self.table.update(topk, requests, stable, states, out=self.out)
        if timed:
            self.cpu.append(time.thread_time() - start_cpu)
            self.wall.append(time.perf_counter() - start)
            self._keep(len(self.wall) - 1, result)

    def _keep(self, step: int, result: ResidencyResult) -> None:
        """Copies the outputs, untimed, into buffers allocated once: the op's own outputs are
        then freed, and the next step reuses their memory the way a decode loop does. Keeping
        the outputs themselves (or fresh copies) makes the allocator hand out new pages every
        step, whose first-touch faults land in the timing: 3x the op's time at R=32 here."""
        for name in FIELDS:
            value = getattr(result, name)
            if name not in self._kept:
                self._kept[name] = torch.empty((self.steps, *value.shape), dtype=value.dtype)
            self._kept[name][step].copy_(value)

    def result(self, step: int) -> ResidencyResult:
        return ResidencyResult(**{name: self._kept[name][step] for name in FIELDS})

    @property
    def results(self) -> list[ResidencyResult]:
        return [ResidencyResult(**{name: self._kept[name][i] for name in FIELDS})
                for i in range(len(self.wall))]


def result_buffers(rows: int) -> ResidencyResult:
    """Output buffers for one update of ``rows`` rows, reused step after step."""
    return ResidencyResult(*(torch.empty(shape, dtype=RESULT_DTYPE)
                             for shape in ((rows, TOP_K), (rows,), (rows, TOP_K), (rows, TOP_K))))


def same(a: Sequence[ResidencyResult], b: Sequence[ResidencyResult]) -> bool:
    return all(torch.equal(getattr(x, f), getattr(y, f)) for x, y in zip(a, b, strict=True)
               for f in FIELDS)


def median_us(times: Sequence[float]) -> float:
    return statistics.median(times) * 1e6


def bench_one(rows: int, capacity: int, seq_len: int, trace: list[torch.Tensor],
              steps: int, ref_steps: int, native: Callable[..., Any] | None,
              threads: int, native_threads: int, upstream: Any = None) -> dict[str, Any]:
    """Step 0 is a first offload (untimed). The vectorised and the reference table take each
    step in turn, so a change in machine load hits both alike; the speed-ups compare the same
    steps. The native op runs the trace afterwards, taking turns with upstream's LRU when that
    was built (which starts from the native table's state after the first offload)."""
    vec = Timed(ResidencyTable(rows, capacity, max_seq_len=seq_len), threads, steps)
    ref = Timed(ReferenceResidency(rows, capacity, max_seq_len=seq_len), threads, steps)
    # The native op writes into buffers allocated once, as a decode loop (or a captured graph)
    # would and as upstream's contract has it.
    nat = (Timed(native(rows, capacity, max_seq_len=seq_len), native_threads, steps,
                 out=result_buffers(rows)) if native is not None else None)
    requests = torch.arange(rows, dtype=torch.int64)
    stable = torch.full((rows,), seq_len, dtype=torch.int64)
    first = torch.full((rows,), int(RequestState.FIRST_OFFLOAD), dtype=torch.int64)
    steady = torch.full((rows,), int(RequestState.STEADY), dtype=torch.int64)
    for impl in (vec, ref):
        impl.update(trace[0], requests, stable, first, timed=False)
    for i, topk in enumerate(trace[1:steps + 1]):
        vec.update(topk, requests, stable, steady)
        if i < ref_steps:
            ref.update(topk, requests, stable, steady)
    upstream_wall: list[float] = []
    upstream_agree = True
    # The native op has a run of its own: its idle OpenMP threads spin and would slow others.
    if native is not None and nat is not None:
        # The native op and upstream's take the selection as int32 (vLLM's indexers give
        # int32), converted here, outside the timing, once for both.
        trace = [topk.int() for topk in trace]
        # The op allocates per-thread scratch on first use: a throwaway table pays for it.
        warm = Timed(native(rows, capacity, max_seq_len=seq_len), native_threads, steps)
        warm.update(trace[0], requests, stable, first, timed=False)
        for topk in trace[1:4]:
            warm.update(topk, requests, stable, steady, timed=False)
        nat.update(trace[0], requests, stable, first, timed=False)
        up = None
        if upstream is not None:
            up = UpstreamTable(upstream, rows, capacity, TOP_K, seq_len, native_threads)
            up.start_from(nat.table.slot_tokens, nat.table.lru_order)
        for step, topk in enumerate(trace[1:steps + 1]):
            nat.update(topk, requests, stable, steady)
            if up is not None:
                up.set_topk(topk)
                start = time.perf_counter()
                up.update()
                upstream_wall.append(time.perf_counter() - start)
                mine = nat.result(step)
                upstream_agree = upstream_agree and all(
                    torch.equal(value, getattr(mine, name)) for name, value in up.outputs().items())
        # The same calls with no residency work (NOT_OFFLOADED rows): argument checks, four
        # fresh outputs written. What any implementation of this contract pays per step here.
        io_floor = Timed(native(rows, capacity, max_seq_len=seq_len), native_threads, steps,
                         out=result_buffers(rows))
        not_offloaded = torch.full((rows,), int(RequestState.NOT_OFFLOADED), dtype=torch.int64)
        for topk in trace[1:steps + 1]:
            io_floor.update(topk, requests, stable, not_offloaded)
    torch.set_num_threads(threads)
    agree = same(vec.results[:ref_steps], ref.results)
    native_us = native_cpu_us = io_floor_us = None
    if nat is not None:
        native_us, native_cpu_us = median_us(nat.wall), median_us(nat.cpu)
        io_floor_us = median_us(io_floor.wall)
        agree = agree and same(nat.results, vec.results)
    upstream_us = median_us(upstream_wall) if upstream_wall else None
    if upstream_wall:
        agree = agree and upstream_agree
    vec_results = vec.results

    lru_misses = sum(int(r.miss_counts.sum()) for r in vec_results)
    selected = steps * rows * TOP_K  # tokens are distinct within a row
    # Step 0 costs K misses per row under any policy; compare the steady steps only.
    optimum = sum(belady_min_misses([step[r].tolist() for step in trace[:steps + 1]], capacity)
                  for r in range(rows)) - rows * TOP_K
    ref_us, ref_cpu_us = median_us(ref.wall), median_us(ref.cpu)
    paired_us = median_us(vec.wall[:ref_steps])
    paired_cpu_us = median_us(vec.cpu[:ref_steps])
    return dict(rows=rows, capacity=capacity, top_k=TOP_K, seq_len=seq_len, steps=steps,
                ref_steps=ref_steps, vectorised_us=median_us(vec.wall),
                vectorised_cpu_us=median_us(vec.cpu), reference_us=ref_us,
                reference_cpu_us=ref_cpu_us, speedup=ref_us / paired_us,
                cpu_speedup=ref_cpu_us / paired_cpu_us,
                native_us=native_us, native_cpu_us=native_cpu_us, io_floor_us=io_floor_us,
                upstream_us=upstream_us, upstream_agrees=upstream_agree if upstream_wall else None,
                speed_vs_upstream=(upstream_us / native_us
                                   if upstream_us is not None and native_us else None),
                hit_rate=1 - lru_misses / selected,
                lru_misses_per_row_step=lru_misses / (steps * rows),
                belady_misses_per_row_step=optimum / (steps * rows),
                lru_over_belady=lru_misses / optimum if optimum else float("nan"),
                results_agree=agree)


def table_text(records: Sequence[dict[str, Any]], threads: int, native_threads: int,
               load: tuple[float, float]) -> str:
    head = (f"{'R':>3} {'C':>5} {'seq':>6} {'vec us':>8} {'ref us':>9} {'ref n':>5} "
            f"{'speedup':>8} {'cpu x':>6} {'native us':>9} {'io floor':>8} {'upstream':>8} "
            f"{'kvo/up':>6} "
            f"{'hit rate':>8} "
            f"{'LRU miss':>8} {'Belady':>7} {'LRU/OPT':>7} {'agree':>5}")
    lines = [
        f"residency update: K={TOP_K}, ~{KEEP:.0%} of the top-k kept per step; us = median wall "
        f"time per layer-step (one update of all R rows); cpu x = speed-up in this thread's "
        f"CPU time (less disturbed by other load); ref n = steps the slow reference was timed "
        f"on (vectorised and native: every step; the speed-ups compare the vectorised run on "
        f"those same steps, taken in turn); native: the op writing into output buffers "
        f"allocated once (update(..., out=)); io floor = the native op's own calls on the same "
        f"steps with every row NOT_OFFLOADED (argument checks and the four [R, K] outputs "
        f"written, no residency work); upstream = vllm-ascend's host LRU "
        f"(lru_resident_compact, int32, caller-owned outputs) built from {ENV_VAR}, timed "
        f"alternately with the native op on the same steps and threads, from the same state "
        f"(both given the top-k as int32); kvo/up = upstream us / native us (> 1: kvo "
        f"faster); misses per row-step over the steady steps.",
        f"torch threads: {threads} (vectorised, reference), {native_threads} (native op); "
        f"load average {load[0]:.1f} at start, {load[1]:.1f} at end on {os.cpu_count()} CPUs.",
        head, "-" * len(head)]
    for r in records:
        native = f"{r['native_us']:9.0f}" if r["native_us"] is not None else f"{'n/a':>9}"
        floor = f"{r['io_floor_us']:8.0f}" if r["io_floor_us"] is not None else f"{'n/a':>8}"
        upstream = f"{r['upstream_us']:8.0f}" if r["upstream_us"] is not None else f"{'n/a':>8}"
        ratio = (f"{r['speed_vs_upstream']:5.2f}x" if r["speed_vs_upstream"] is not None
                 else f"{'n/a':>6}")
        lines.append(
            f"{r['rows']:>3} {r['capacity']:>5} {r['seq_len']:>6} {r['vectorised_us']:8.0f} "
            f"{r['reference_us']:9.0f} {r['ref_steps']:>5} {r['speedup']:7.1f}x "
            f"{r['cpu_speedup']:5.1f}x {native} {floor} {upstream} {ratio} {r['hit_rate']:8.3f} "
            f"{r['lru_misses_per_row_step']:8.1f} {r['belady_misses_per_row_step']:7.1f} "
            f"{r['lru_over_belady']:7.3f} {'yes' if r['results_agree'] else 'NO':>5}")
    lines.extend(geomean_lines(records))
    return "\n".join(lines)


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def speed_geomeans(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Geometric means of kvo/up: over every shape ("all") and per R; empty without upstream."""
    ratios = [(r["rows"], r["speed_vs_upstream"]) for r in records
              if r["speed_vs_upstream"] is not None]
    if not ratios:
        return {}
    means = {"all": geomean([v for _, v in ratios])}
    for rows in sorted({rows for rows, _ in ratios}):
        means[f"R={rows}"] = geomean([v for r, v in ratios if r == rows])
    return means


def geomean_lines(records: Sequence[dict[str, Any]]) -> list[str]:
    means = speed_geomeans(records)
    if not means:
        return []
    shapes = sum(1 for r in records if r["speed_vs_upstream"] is not None)
    parts = [f"{name} {value:.2f}x" for name, value in means.items()]
    return [f"kvo/up geometric mean over {shapes} shapes: " + ", ".join(parts)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--quick", action="store_true",
                        help="R=1 and R=32 at C=8192, 128K tokens, 10 steps (under a minute)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the vectorised and reference runs (default 1: "
                             "on a shared 2-CPU machine a second thread mostly waits)")
    parser.add_argument("--native-threads", type=int, default=2,
                        help="torch/OpenMP threads while timing the native op (default 2)")
    args = parser.parse_args(argv)

    if args.quick:
        grid, steps, ref_steps = [(1, 8192, 131072), (32, 8192, 131072)], 10, 3
    else:
        grid = [(r, c, s) for r in (1, 8, 32) for s in (32768, 131072) for c in (4096, 8192)]
        steps, ref_steps = 100, 10
    native = load_native()
    upstream = load_upstream() if native is not None else None
    load_start = os.getloadavg()[0]
    records = []
    traces: dict[tuple[int, int], list[torch.Tensor]] = {}
    for rows, capacity, seq_len in grid:
        key = (rows, seq_len)
        if key not in traces:
            traces[key] = make_trace(rows, seq_len, steps, seed=rows * 7919 + seq_len)
        records.append(bench_one(rows, capacity, seq_len, traces[key], steps, ref_steps,
                                 native, args.threads, args.native_threads, upstream))
        print(f"  done R={rows} C={capacity} seq={seq_len}", flush=True)
    load = (load_start, os.getloadavg()[0])
    print(table_text(records, args.threads, args.native_threads, load))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(
        benchmark="residency", top_k=TOP_K, keep=KEEP, threads=args.threads,
        native_threads=args.native_threads, quick=args.quick, load_average=load,
        speed_vs_upstream_geomean=speed_geomeans(records),
        cpus=os.cpu_count(), native_available=native is not None,
        upstream_source=os.environ.get(ENV_VAR), results=records),
        indent=2))
    return 0 if all(r["results_agree"] for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
