"""Benchmark: many long requests under one fixed device KV budget, resident vs offload.

Issue 15 section 3's scenario on the tiny random DeepSeek-V3.2-architecture model
(``kvo_tools.models.tiny_dsv32``): ``--requests`` requests of ``--context`` prompt tokens, each
generating ``--decode-tokens``, all submitted at once to a vLLM-CPU engine whose device KV
budget (``kv_cache_memory_bytes``, the bytes ``VLLM_CPU_KVCACHE_SPACE`` would set) holds the
full length of only ``--budget-requests`` of them with the main KV on the device.

- resident: vLLM sizes its blocks from the budget; the scheduler queues what does not fit and
  preempts (recomputes) running requests when their growing sequences run out of blocks.
- offload: kvo's sparse offload backend keeps the main KV in its host pool (sized for every
  request); the device holds the indexer cache, vLLM's one-value placeholder per token and the
  hot buffers, so all requests run together. The table shows these device bytes beside the
  budget (they must fit in it for the comparison to be fair).

Reported per mode: wall time of the whole run, output tokens/s (generated tokens / wall
time), vLLM's own preemption counter (``vllm:num_preemptions``), the most requests running in
one step, and whether both modes produced the same tokens. Each mode runs in a fresh process
(vLLM-CPU binds its OpenMP threads once per process); with ``--reps`` > 1 the order alternates
and the table gives medians and the median of per-repetition ratios. On this CPU "device" and
host are the same DRAM: what is measured is scheduling (queueing and recompute) against the
offload path's extra work, not a PCIe link.

Usage: python -m kvo_tools.bench.sparse_budget [--requests N] [--context L] [--decode-tokens D]
  [--budget-requests R] [--reps N] [--json PATH]
  default: 16 requests of 2048 tokens, 128 generated each, a budget of 4 requests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvo_tools.bench._inproc import inproc_scheduler
from kvo_tools.bench.sparse_vllm import CHUNK_TOKENS, NUM_LAYERS, _model_dir

BLOCK_TOKENS = 64   # the DSA backends' block size (the indexer cache needs 64)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    parser.add_argument("--requests", type=int, default=16, help="concurrent requests")
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens per request")
    parser.add_argument("--budget-requests", type=int, default=4,
                        help="requests whose full length the device budget holds (resident)")
    parser.add_argument("--reps", type=int, default=1, help="runs per mode, order alternating")
    args = parser.parse_args(argv)
    if args.requests < 2 or args.context < 64 or args.decode_tokens < 4:
        parser.error("--requests must be >= 2, --context >= 64, --decode-tokens >= 4; got "
                     f"{args.requests}, {args.context}, {args.decode_tokens}")
    if not 1 <= args.budget_requests < args.requests:
        parser.error(f"--budget-requests must be in [1, --requests); got {args.budget_requests}")
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    return args


def _row_bytes(model: Path) -> dict[str, int]:
    """Device bytes per token and layer of the resident main KV and the bf16 indexer key."""
    config = json.loads((model / "config.json").read_text())
    return {"main": (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4,   # float32
            "indexer": config["index_head_dim"] * 2}


def budget_bytes(model: Path, tokens_per_request: int, budget_requests: int) -> int:
    """The device KV budget: ``budget_requests`` full-length requests kept resident (whole
    blocks, both caches, every layer) plus vLLM's null block."""
    rows = _row_bytes(model)
    blocks = budget_requests * -(-tokens_per_request // BLOCK_TOKENS) + 1
    return blocks * BLOCK_TOKENS * NUM_LAYERS * (rows["main"] + rows["indexer"])


def run_mode(model: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine, every request submitted at once, stepped to the end (in a fresh process)."""
    from vllm import LLM, RequestOutput, SamplingParams

    max_len = args.context + args.decode_tokens + 16
    tokens_per_request = args.context + args.decode_tokens
    budget = budget_bytes(model, tokens_per_request, args.budget_requests)
    sparse: dict[str, Any] = {"mode": mode}
    if mode == "offload":
        blocks = args.requests * -(-max_len // BLOCK_TOKENS) + 1
        sparse["host_pool_bytes"] = (blocks * BLOCK_TOKENS * NUM_LAYERS
                                     * _row_bytes(model)["main"])
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True,
              distributed_executor_backend="uni", max_model_len=max_len,
              max_num_seqs=args.requests, max_num_batched_tokens=CHUNK_TOKENS,
              enable_prefix_caching=False, seed=0, kv_cache_memory_bytes=budget,
              disable_log_stats=False, additional_config={"kvo_sparse": sparse})
    engine = llm.llm_engine
    scheduler = inproc_scheduler(llm)
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(args.context * 31 + args.requests)
    prompts = [[rng.randrange(256) for _ in range(args.context)] for _ in range(args.requests)]
    finished: dict[str, list[int]] = {}
    most_running = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if isinstance(output, RequestOutput) and output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        most_running = max(most_running, len(scheduler.running))
    wall = time.perf_counter() - start
    preemptions = sum(
        int(metric.value) for metric in llm.get_metrics()
        if metric.name == "vllm:num_preemptions" and hasattr(metric, "value"))
    cache = engine.vllm_config.cache_config
    row: dict[str, Any] = {
        "mode": mode, "wall_s": wall, "budget_mib": budget / 2**20,
        "output_tokens_per_s": args.requests * args.decode_tokens / wall,
        "preemptions": preemptions, "most_running": most_running,
        "blocks": int(cache.num_gpu_blocks or 0),
        "tokens": [finished[str(i)] for i in range(args.requests)]}
    row["device_kv_mib"] = _device_kv_bytes(llm, row["blocks"], mode) / 2**20
    engine.engine_core.shutdown()
    return row


def _device_kv_bytes(llm: Any, blocks: int, mode: str) -> float:
    """Bytes of device KV the engine bound (every layer's cache, the hot buffers on top)."""
    import torch

    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    total = 0.0
    seen: set[int] = set()
    for module in model.modules():
        for cache in (getattr(module, "kv_cache", None),
                      getattr(getattr(module, "k_cache", None), "kv_cache", None)):
            if isinstance(cache, torch.Tensor) and cache.numel() and id(cache) not in seen:
                seen.add(id(cache))
                total += cache.numel() * cache.element_size()
    if mode == "offload":
        from kvo_vllm.dsa.offload_main_kv import offload_workers

        total += sum(w.manager.hot_buffer_bytes for w in offload_workers()
                     if w.manager is not None)
    return total


COLUMNS = [("mode", "mode", "{}"), ("budget_mib", "budget MiB", "{:.1f}"),
           ("device_kv_mib", "device KV MiB", "{:.1f}"), ("blocks", "blocks", "{:d}"),
           ("most_running", "max running", "{:d}"), ("preemptions", "preempted", "{:d}"),
           ("wall_s", "wall s", "{:.1f}"), ("output_tokens_per_s", "out tok/s", "{:.1f}")]


def table(rows: list[dict[str, Any]]) -> str:
    header = " | ".join(title for _, title, _ in COLUMNS)
    lines = [header, "-" * len(header)]
    lines += [" | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) for row in rows]
    return "\n".join(lines)


def _environment() -> None:
    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("HF_HUB_OFFLINE", "1"),
                        ("VLLM_HOST_IP", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)   # it would override the budget
    os.environ.pop("KVO_SPARSE_CONFIG", None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--run"]:   # a child: one mode, JSON to the given file
        mode, model_dir, result_path = argv[1:4]
        args = parse_args(argv[4:])
        _environment()
        Path(result_path).write_text(json.dumps(run_mode(Path(model_dir), mode, args)))
        return 0
    args = parse_args(argv)
    _environment()
    model = _model_dir(args.context + args.decode_tokens + 16)
    runs: dict[str, list[dict[str, Any]]] = {"resident": [], "offload": []}
    passed = [f"--requests={args.requests}", f"--context={args.context}",
              f"--decode-tokens={args.decode_tokens}",
              f"--budget-requests={args.budget_requests}"]
    for rep in range(args.reps):
        order = ("resident", "offload") if rep % 2 == 0 else ("offload", "resident")
        for mode in order:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([sys.executable, "-m", "kvo_tools.bench.sparse_budget", "--run",
                                mode, str(model), out.name, *passed], check=True)
                runs[mode].append(json.loads(Path(out.name).read_text()))
            print(table(runs[mode][-1:]).splitlines()[-1], flush=True)
    rows = []
    for results in runs.values():
        row = dict(results[0])
        for key in ("wall_s", "output_tokens_per_s"):
            row[key] = statistics.median(r[key] for r in results)
        row["preemptions"] = int(statistics.median(r["preemptions"] for r in results))
        row.pop("tokens")
        rows.append(row)
    pairs = list(zip(runs["resident"], runs["offload"], strict=True))
    speedup = statistics.median(r["wall_s"] / o["wall_s"] for r, o in pairs)
    same = all(r["tokens"] == o["tokens"] for r, o in pairs)
    print()
    print(f"{args.requests} requests x {args.context} prompt tokens, {args.decode_tokens} "
          f"generated each, device KV budget = {args.budget_requests} requests resident "
          f"({NUM_LAYERS} layers; medians of {args.reps} run(s) per mode)")
    print(table(rows))
    print(f"offload / resident output tokens/s: {speedup:.2f}x (median of per-run ratios); "
          f"same tokens: {same}")
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "sparse_budget", "rows": rows,
                                         "offload_speedup": speedup, "same_tokens": same,
                                         "args": {k: v for k, v in vars(args).items()
                                                  if k != "json"}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
