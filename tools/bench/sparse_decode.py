"""Sparse decode offload (path b) against everything-resident decode (path a), side by side.

A model slice at DeepSeek-V3.2 widths (MLA latent 512 + rope 64, lightning indexer 64 heads x
128, top-k 2048, hot capacity 8192) decodes R concurrent requests of 32K tokens. The histories
are synthesised (random rows written straight into the host pool, as the P/D transfer would)
instead of running a 32K prefill, and the indexer queries follow a random walk whose step is
calibrated so consecutive top-k sets overlap ~85%, as measured on real models. Per step both
paths get the same new rows and queries; (a) selects and attends over each request's whole
history, (b) runs ``SparseDecodeOffload`` (host pool, residency, miss-only copies, hot
buffers). Reported: per-step time of both, hit rate, misses against Belady's optimum, bytes
moved per step against a full reload, device KV memory of both, and whether the attention
outputs were bit-identical.

On this CPU the "device" of path (a) and the host pool of path (b) are the same DRAM, so (a)
reads each request's rows in place in the pool (no second 2+ GB copy); its device memory is
counted as what a device would have to hold. KV is stored in fp32 on both paths: the reference
primitives convert whatever they attend over to fp32, which with bf16 would charge (a) a
conversion of the whole history every step and flatter (b).

Usage: python tools/bench/sparse_decode.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from kvo_core.config import SparseDecodeOffloadConfig
from kvo_core.residency import belady_min_misses
from kvo_kernels.reference.primitives import indexer_scores, sparse_mla_attention, topk_indices
from kvo_vllm.sparse import SparseDecodeOffload, SparseModelLayout

LATENT, ROPE, INDEX_HEADS, INDEX_DIM = 512, 64, 64, 128
TARGET_OVERLAP = 0.85
TARGET_STEP_RATIO = 1.5
TARGET_MEMORY_RATIO = 0.15
DEFAULT_RUNS = ((4, 8192, 56), (16, 8192, 14), (4, 4096, 56))
"""(requests, hot capacity, steady steps) of the full run. 56 steps let the hot buffers of 4
requests fill and evict; the 4096 run shows the memory/miss trade-off of a smaller buffer."""


@attrs.frozen
class Rows:
    kv: torch.Tensor
    k_rope: torch.Tensor
    index_key: torch.Tensor


@attrs.frozen
class Queries:
    query: torch.Tensor
    query_rope: torch.Tensor
    index_query: torch.Tensor
    index_weights: torch.Tensor


@attrs.frozen
class Settings:
    requests: int
    tokens: int
    layers: int
    heads: int
    top_k: int
    capacity: int
    warmup: int
    steps: int
    seed: int
    residency: str = "native"


class ResidentPath:
    """Path (a): every request's whole history is attended in place (the oracle's maths)."""

    def __init__(self, engine: SparseDecodeOffload, request_ids: Sequence[int],
                 top_k: int, scale: float) -> None:
        self.engine, self.top_k, self.scale = engine, top_k, scale
        layers = range(engine.layout.num_layers)
        self.kv = {(r, n): engine.host_rows(r, n) for r in request_ids for n in layers}
        self.keys = {(r, n): engine.indexer_rows(r, n) for r in request_ids for n in layers}
        self.length = {r: engine.length(r) for r in request_ids}

    def decode_layer(self, layer: int, ids: Sequence[int], rows: Rows,
                     queries: Queries) -> torch.Tensor:
        outputs = []
        for i, rid in enumerate(ids):
            position = self.length[rid]
            kv, keys = self.kv[(rid, layer)], self.keys[(rid, layer)]
            kv[position] = torch.cat([rows.kv[i], rows.k_rope[i]])
            keys[position] = rows.index_key[i]
            scores = indexer_scores(queries.index_query[i:i + 1],
                                    queries.index_weights[i:i + 1], keys[:position + 1])
            selected = topk_indices(scores, self.top_k, torch.tensor([position + 1]))
            outputs.append(sparse_mla_attention(
                queries.query[i:i + 1], queries.query_rope[i:i + 1], kv[:, :LATENT],
                kv[:, LATENT:], selected, self.scale))
        if layer == self.engine.layout.num_layers - 1:
            for rid in ids:
                self.length[rid] += 1
        return torch.cat(outputs, dim=0)


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of one top-k set that is also in the other."""
    return torch.isin(a[a >= 0], b[b >= 0]).float().mean().item()


def walk(query: torch.Tensor, epsilon: float, gen: torch.Generator) -> torch.Tensor:
    """One random-walk step that keeps the query's scale: (q + eps * noise) / sqrt(1 + eps^2)."""
    noise = torch.randn(query.shape, generator=gen)
    return (query + epsilon * noise) / math.sqrt(1.0 + epsilon * epsilon)


def calibrate(keys: torch.Tensor, weights: torch.Tensor, top_k: int, seed: int) -> float:
    """The walk step whose consecutive top-k sets overlap ~TARGET_OVERLAP on these keys."""
    gen = torch.Generator().manual_seed(seed)
    length = torch.tensor([keys.shape[0]])
    queries = [torch.randn(1, INDEX_HEADS, INDEX_DIM, generator=gen) for _ in range(3)]
    before = [topk_indices(indexer_scores(q, weights, keys), top_k, length) for q in queries]

    def mean_overlap(epsilon: float) -> float:
        trial = torch.Generator().manual_seed(seed + 1)
        values = []
        for q, picked in zip(queries, before, strict=True):
            moved = walk(q, epsilon, trial)
            after = topk_indices(indexer_scores(moved, weights, keys), top_k, length)
            values.append(overlap(after, picked))
        return statistics.fmean(values)

    low, high = math.log(1e-3), math.log(1.0)
    for _ in range(12):  # bisection in log space: overlap falls as the step grows
        middle = (low + high) / 2
        if mean_overlap(math.exp(middle)) > TARGET_OVERLAP:
            low = middle
        else:
            high = middle
    return math.exp((low + high) / 2)


def build(settings: Settings) -> tuple[SparseDecodeOffload, float]:
    max_len = -(-(settings.tokens + settings.warmup + settings.steps + 1) // 128) * 128
    layout = SparseModelLayout(num_layers=settings.layers, latent_dim=LATENT, rope_dim=ROPE,
                               index_dim=INDEX_DIM, softmax_scale=1.0 / math.sqrt(LATENT + ROPE),
                               kv_dtype=torch.float32, index_dtype=torch.float32)
    config = SparseDecodeOffloadConfig(top_k=settings.top_k, block_size=128,
                                       hot_capacity=settings.capacity,
                                       residency_backend=settings.residency)
    engine = SparseDecodeOffload(config, layout, max_rows=settings.requests,
                                 max_model_len=max_len,
                                 pool_name=f"bench-sd-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    gen = torch.Generator().manual_seed(settings.seed)
    for rid in range(settings.requests):
        # What the P/D path does: reserve, the transfer fills pool + indexer, then admit.
        engine.reserve(rid, settings.tokens, max_tokens=max_len)
        for layer in range(settings.layers):
            engine.host_rows(rid, layer)[:settings.tokens].normal_(generator=gen)
            engine.indexer_rows(rid, layer)[:settings.tokens].normal_(generator=gen)
        engine.admit_from_pool(rid, settings.tokens)
    return engine, float(layout.softmax_scale)


def run(settings: Settings) -> dict[str, Any]:
    setup_start = time.perf_counter()
    engine, scale = build(settings)
    ids = list(range(settings.requests))
    resident = ResidentPath(engine, ids, settings.top_k, scale)
    gen = torch.Generator().manual_seed(settings.seed + 7)
    shape = (settings.layers, settings.requests)
    weights = torch.softmax(torch.randn(*shape, INDEX_HEADS, generator=gen), dim=-1)
    index_query = torch.randn(*shape, INDEX_HEADS, INDEX_DIM, generator=gen)
    epsilon = calibrate(engine.indexer_rows(0, 0)[:settings.tokens], weights[0, :1],
                        settings.top_k, settings.seed)
    setup_s = time.perf_counter() - setup_start

    total = settings.warmup + settings.steps
    times_a: list[float] = []
    times_b: list[float] = []
    stats: list[Any] = []
    traces: dict[tuple[int, int], list[list[int]]] = {
        (r, n): [] for r in ids for n in range(settings.layers)}
    overlaps: list[float] = []
    identical = True
    for _step in range(total):
        index_query = walk(index_query, epsilon, gen)
        inputs = []
        for layer in range(settings.layers):
            rows = Rows(kv=torch.randn(settings.requests, LATENT, generator=gen),
                        k_rope=torch.randn(settings.requests, ROPE, generator=gen),
                        index_key=torch.randn(settings.requests, INDEX_DIM, generator=gen))
            queries = Queries(
                query=torch.randn(settings.requests, settings.heads, LATENT, generator=gen),
                query_rope=torch.randn(settings.requests, settings.heads, ROPE, generator=gen),
                index_query=index_query[layer].contiguous(), index_weights=weights[layer])
            inputs.append((rows, queries))
        outputs = {}
        for name, backend, times in (("a", resident, times_a), ("b", engine, times_b)):
            start = time.perf_counter()
            outputs[name] = [backend.decode_layer(layer, ids, rows, queries)
                             for layer, (rows, queries) in enumerate(inputs)]
            times.append(time.perf_counter() - start)
        identical &= all(torch.equal(x, y) for x, y in zip(outputs["a"], outputs["b"],
                                                           strict=True))
        stats.append(engine.last_step)
        for layer in range(settings.layers):
            picked = engine.last_topk[layer]
            for i, rid in enumerate(ids):
                trace = traces[(rid, layer)]
                if trace:
                    overlaps.append(overlap(picked[i], torch.tensor(trace[-1])))
                trace.append(picked[i].tolist())

    steady = slice(settings.warmup, total)
    steady_stats = stats[steady]
    misses = sum(s.misses for s in stats)
    belady = sum(belady_min_misses(trace, settings.capacity) for trace in traces.values())
    compulsory = sum(len({t for step in trace for t in step if t >= 0})
                     for trace in traces.values())
    row_bytes = engine.row_bytes
    index_bytes = engine.layout.index_row_bytes
    history = settings.tokens + total
    device_a_main = settings.requests * settings.layers * history * row_bytes
    device_b = engine.device_bytes()
    device_b_main = device_b.hot_buffers
    indexer_used = settings.requests * settings.layers * history * index_bytes
    engine.close()
    step_a = statistics.median(times_a[steady])
    step_b = statistics.median(times_b[steady])
    result = {
        "settings": attrs.asdict(settings),
        "walk_epsilon": epsilon,
        "setup_s": setup_s,
        "topk_overlap": statistics.fmean(overlaps),
        "step_ms_a": 1e3 * step_a,
        "step_ms_b": 1e3 * step_b,
        "step_ratio_b_over_a": step_b / step_a,
        "first_step_ms_a": 1e3 * times_a[0],
        "first_step_ms_b": 1e3 * times_b[0],
        "hit_rate_steady": (sum(s.hits for s in steady_stats)
                            / max(1, sum(s.selected for s in steady_stats))),
        "misses_per_step_steady": statistics.fmean(s.misses for s in steady_stats),
        "misses_total": misses,
        "belady_misses_total": belady,
        "compulsory_misses_total": compulsory,
        "misses_over_belady": misses / max(1, belady),
        "h2d_bytes_per_step_steady": statistics.fmean(s.h2d_bytes for s in steady_stats),
        "full_reload_bytes_per_step": statistics.fmean(s.full_reload_bytes
                                                       for s in steady_stats),
        "h2d_bytes_first_step": stats[0].h2d_bytes,
        "device_main_kv_bytes_a": device_a_main,
        "device_main_kv_bytes_b": device_b_main,
        "device_main_kv_ratio": device_b_main / device_a_main,
        "device_total_bytes_a": device_a_main + indexer_used,
        "device_total_bytes_b": device_b_main + indexer_used,
        "device_total_ratio": (device_b_main + indexer_used) / (device_a_main + indexer_used),
        "host_pool_bytes": engine.host_pool_bytes,
        "outputs_identical": identical,
    }
    result["bytes_ratio"] = (result["h2d_bytes_per_step_steady"]
                             / result["full_reload_bytes_per_step"])
    return result


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def table(results: Sequence[dict[str, Any]]) -> str:
    rows = [
        ("requests x tokens", lambda r: f"{r['settings']['requests']} x "
                                        f"{r['settings']['tokens']}"),
        ("top-k / hot capacity", lambda r: f"{r['settings']['top_k']} / "
                                           f"{r['settings']['capacity']}"),
        ("decode steps (warm-up + steady)", lambda r: f"{r['settings']['warmup']} + "
                                                      f"{r['settings']['steps']}"),
        ("top-k overlap step to step", lambda r: f"{r['topk_overlap']:.3f}"),
        ("(a) resident: ms / step", lambda r: f"{r['step_ms_a']:.1f}"),
        ("(b) offload:  ms / step", lambda r: f"{r['step_ms_b']:.1f}"),
        ("(b) / (a) step time [target <= 1.5]", lambda r: f"{r['step_ratio_b_over_a']:.2f}"),
        ("first offload step ms (a) / (b)", lambda r: f"{r['first_step_ms_a']:.0f} / "
                                                      f"{r['first_step_ms_b']:.0f}"),
        ("hit rate (steady)", lambda r: f"{r['hit_rate_steady']:.3f}"),
        ("misses / step (steady)", lambda r: f"{r['misses_per_step_steady']:.0f}"),
        ("misses / Belady MIN, whole run", lambda r: f"{r['misses_total']} / "
                                                      f"{r['belady_misses_total']} = "
                                                      f"{r['misses_over_belady']:.2f}"),
        ("  of which compulsory (distinct tokens)",
         lambda r: f"{r['compulsory_misses_total']}"),
        ("MiB moved / step (steady)", lambda r: mib(r["h2d_bytes_per_step_steady"])),
        ("MiB full reload / step", lambda r: mib(r["full_reload_bytes_per_step"])),
        ("moved / full reload", lambda r: f"{r['bytes_ratio']:.4f}"),
        ("device main KV MiB (a) / (b)", lambda r: f"{mib(r['device_main_kv_bytes_a'])} / "
                                                   f"{mib(r['device_main_kv_bytes_b'])}"),
        ("device main KV (b)/(a) [target < 0.15]", lambda r: f"{r['device_main_kv_ratio']:.3f}"),
        ("device KV + indexer (b)/(a)", lambda r: f"{r['device_total_ratio']:.3f}"),
        ("attention outputs identical", lambda r: "yes" if r["outputs_identical"] else "NO"),
    ]
    width = max(len(name) for name, _ in rows)
    cells = [[fmt(r) for r in results] for _, fmt in rows]
    col = max(len(c) for line in cells for c in line)
    lines = [f"{name:<{width}}  " + "  ".join(f"{c:>{col}}" for c in line)
             for (name, _), line in zip(rows, cells, strict=True)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="4 requests, few steps (< 1 min)")
    parser.add_argument("--requests", default=None,
                        help="comma-separated concurrencies (default: 4 and 16 at capacity "
                             "8192, 4 at capacity 4096; quick: 4)")
    parser.add_argument("--capacity", type=int, default=8192,
                        help="hot capacity for --requests runs (default 8192)")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16,
                        help="attention heads per rank (DeepSeek-V3.2 has 128 over TP)")
    parser.add_argument("--steps", type=int, default=None,
                        help="measured steady steps (default: DEFAULT_RUNS; quick: 4)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: stable timings on a shared machine)")
    parser.add_argument("--residency", choices=("torch", "native"), default="native",
                        help="residency table: the C++/OpenMP op (default; falls back to "
                             "torch with a warning if it does not build) or kvo-core's torch one")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.requests:
        plan = [(int(x), args.capacity, args.steps or 14) for x in args.requests.split(",")]
    elif args.quick:
        plan = [(4, args.capacity, args.steps or 4)]
    else:
        plan = [(r, c, args.steps or n) for r, c, n in DEFAULT_RUNS]
    results = []
    for requests, capacity, steps in plan:
        settings = Settings(requests=requests, tokens=args.tokens, layers=args.layers,
                            heads=args.heads, top_k=2048, capacity=capacity, warmup=2,
                            steps=steps, seed=requests, residency=args.residency)
        print(f"running {requests} requests x {args.tokens} tokens, capacity {capacity}, "
              f"{args.layers} layers, {steps} steady steps ...", file=sys.stderr, flush=True)
        results.append(run(settings))
    print(table(results))
    notes = []
    for r in results:
        if r["step_ratio_b_over_a"] > TARGET_STEP_RATIO:
            notes.append(f"{r['settings']['requests']} requests, capacity "
                         f"{r['settings']['capacity']}: step-time target missed")
        if r["device_main_kv_ratio"] >= TARGET_MEMORY_RATIO:
            floor = r["settings"]["capacity"] / r["settings"]["tokens"]
            notes.append(f"{r['settings']['requests']} requests, capacity "
                         f"{r['settings']['capacity']}: device main-KV ratio "
                         f"{r['device_main_kv_ratio']:.3f} >= {TARGET_MEMORY_RATIO}; its floor "
                         f"is capacity / context = {floor:.3f} at this context length (below "
                         f"{TARGET_MEMORY_RATIO} from "
                         f"{math.ceil(r['settings']['capacity'] / TARGET_MEMORY_RATIO)} "
                         "tokens of context)")
    for note in notes:
        print("note:", note)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"benchmark": "sparse_decode", "torch_threads": torch.get_num_threads(),
                       "results": results, "notes": notes}, handle, indent=2)
    return 0 if all(r["outputs_identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
