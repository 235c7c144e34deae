"""Fused-op speed at production shapes: reference on CPU, Triton where a GPU is present.

Shapes: R = 8 requests x 4 query rows (T = 32), 64 indexer heads of 128, top-k 2048, hot
capacity 8192 slots per request, 32K and 128K cached tokens per request, MLA latent 512 +
rope 64 with 16 attention heads. Each request's pool entry is prepared so that ~15% of the
step's selected tokens miss: a first offload lays the selection into the hot buffer, then 15%
of the resident tokens are swapped for unselected ones (restored before every timed call).
Requests share the physical key/host blocks (through shuffled block tables) to keep memory low;
the ops read them as separate requests.

Per op: the median wall time, and for Copy-SFA the bytes the miss copy moves against a
full-layer reload of every request's cache (bf16).

    python -m kvo_tools.bench.kernels --json PATH [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvo_kernels import dispatch, ops
from kvo_kernels.cache_pool import new_cache_slots_pool
from kvo_kernels.limits import BLOCK_SIZE, INDEXER_HEAD_DIM, INDEXER_HEADS, LATENT_DIM, ROPE_DIM
from kvo_kernels.reference.primitives import hadamard_quant_int8

REQUESTS, QUERY_ROWS, TOP_K, CAPACITY, ATTENTION_HEADS = 8, 4, 2048, 8192, 16
MISS_FRACTION = 0.15
BYTES_PER_TOKEN = (LATENT_DIM + ROPE_DIM) * 2  # bf16 main KV row


WARM_UP = 1  # untimed calls before the timed ones (0 with --quick)


def median_ms(run: Callable[[], object], reps: int, before: Callable[[], None] | None = None,
              sync: Callable[[], None] = lambda: None) -> float:
    """WARM_UP untimed calls, then the median of ``reps`` timed ones (``before`` untimed)."""
    times = []
    for i in range(WARM_UP + reps):
        if before is not None:
            before()
        sync()
        start = time.perf_counter()
        run()
        sync()
        if i >= WARM_UP:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def shared_block_tables(tokens: int, generator: torch.Generator) -> torch.Tensor:
    """[R, blocks] int32: every request reads the same blocks, each in its own shuffled order."""
    blocks = -(-tokens // BLOCK_SIZE)
    return torch.stack([torch.randperm(blocks, generator=generator)
                        for _ in range(REQUESTS)]).to(torch.int32)


class Scenario:
    """All tensors of one configuration (one cached length), on one device."""

    def __init__(self, tokens: int, device: str, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        rows = REQUESTS * QUERY_ROWS
        blocks = -(-tokens // BLOCK_SIZE)
        self.tokens, self.device = tokens, device
        dev = torch.device(device)
        self.key_table = shared_block_tables(tokens, g).to(dev)
        keys = torch.randn(blocks, BLOCK_SIZE, 1, INDEXER_HEAD_DIM, generator=g).bfloat16()
        query = torch.randn(rows, INDEXER_HEADS, INDEXER_HEAD_DIM, generator=g).bfloat16()
        self.keys, self.query = keys.to(dev), query.to(dev)
        self.weights = torch.rand(rows, INDEXER_HEADS, generator=g).bfloat16().to(dev)
        self.keys8, key_scale = hadamard_quant_int8(keys)
        query8, query_scale = hadamard_quant_int8(query)
        self.keys8, self.key_scale = self.keys8.to(dev), key_scale[..., 0].to(dev)
        self.query8, self.query_scale = query8.to(dev), query_scale[..., 0].to(dev)

        def meta(value: int) -> torch.Tensor:
            return torch.full((REQUESTS,), value, dtype=torch.int32, device=dev)

        self.meta = {
            "actual_seq_lengths_query": torch.arange(1, REQUESTS + 1, dtype=torch.int32,
                                                     device=dev) * QUERY_ROWS,
            "actual_seq_lengths_key": meta(tokens), "offload_seq_lengths_key": meta(tokens),
            "num_cache_tokens": meta(CAPACITY),
            "req_pool_entries": torch.arange(REQUESTS, dtype=torch.int32, device=dev)}
        self.pool = new_cache_slots_pool(REQUESTS, CAPACITY, device=dev)
        width = QUERY_ROWS * TOP_K
        self.outputs = {
            "topk_src_ids": torch.empty(rows, 1, TOP_K, dtype=torch.int32, device=dev),
            "topk_dst_slots": torch.empty(rows, 1, TOP_K, dtype=torch.int32, device=dev),
            "topk_miss_counts": torch.empty(rows, dtype=torch.int32, device=dev),
            "miss_src_ids": torch.empty(REQUESTS, width, dtype=torch.int32, device=dev),
            "miss_dst_slots": torch.empty(REQUESTS, width, dtype=torch.int32, device=dev),
            "miss_counts": torch.empty(REQUESTS, dtype=torch.int32, device=dev)}
        # Main KV: shared host blocks (pinned host memory next to a GPU), per-request hot buffer.
        host_blocks = torch.randn(blocks, BLOCK_SIZE, LATENT_DIM + ROPE_DIM,
                                  generator=g).bfloat16()
        if dev.type == "cuda":
            host_blocks = host_blocks.pin_memory()
        self.dram_kv = host_blocks[..., :LATENT_DIM].contiguous()
        self.dram_rope = host_blocks[..., LATENT_DIM:].contiguous()
        self.dram_table = shared_block_tables(tokens, g).to(dev)
        hot_blocks = CAPACITY // BLOCK_SIZE
        self.hbm_table = torch.arange(REQUESTS * hot_blocks, dtype=torch.int32,
                                      device=dev).reshape(REQUESTS, hot_blocks)
        self.hbm_kv = torch.zeros(REQUESTS * hot_blocks, BLOCK_SIZE, 1, LATENT_DIM,
                                  dtype=torch.bfloat16, device=dev)
        self.hbm_rope = torch.zeros(REQUESTS * hot_blocks, BLOCK_SIZE, 1, ROPE_DIM,
                                    dtype=torch.bfloat16, device=dev)
        self.mla_query = torch.randn(rows, ATTENTION_HEADS, LATENT_DIM,
                                     generator=g).bfloat16().to(dev)
        self.mla_rope = torch.randn(rows, ATTENTION_HEADS, ROPE_DIM,
                                    generator=g).bfloat16().to(dev)
        self.attention_out = torch.empty_like(self.mla_query)
        self._prepare_steady_pool(g)

    def manage_args(self, quantised: bool, state: int) -> list[torch.Tensor]:
        query, key = (self.query8, self.keys8) if quantised else (self.query, self.keys)
        query_scale = self.query_scale if quantised else torch.ones_like(self.weights).float()
        key_scale = self.key_scale if quantised else torch.ones(self.keys.shape[:3],
                                                                 device=self.keys.device)
        state_t = torch.full((REQUESTS,), state, dtype=torch.int32, device=self.query.device)
        m = self.meta
        return [self.weights, query_scale, query, key_scale, key, self.key_table,
                m["actual_seq_lengths_query"], m["actual_seq_lengths_key"],
                m["offload_seq_lengths_key"], m["num_cache_tokens"], state_t,
                m["req_pool_entries"], self.pool, *self.outputs.values()]

    def _prepare_steady_pool(self, g: torch.Generator) -> None:
        """First offload, then swap MISS_FRACTION of each entry's tokens for unselected ones."""
        ops.lightning_indexer_manage(*self.manage_args(False, -2), implementation="reference")
        pool = self.pool.cpu().clone()
        for e in range(REQUESTS):
            held = pool[e, 0][pool[e, 0] >= 0]
            chosen = torch.randperm(held.numel(), generator=g)[:int(held.numel() * MISS_FRACTION)]
            outside = torch.ones(self.tokens, dtype=torch.bool)
            outside[held.long()] = False
            spare = outside.nonzero().flatten()
            slots = (pool[e, 0] >= 0).nonzero().flatten()[chosen]
            pool[e, 0, slots] = spare[torch.randperm(spare.numel(), generator=g)[:slots.numel()]
                                      ].to(pool.dtype)
        self.steady_pool = pool.to(self.pool.device).clone()
        self.restore_pool()

    def restore_pool(self) -> None:
        self.pool.copy_(self.steady_pool)

    def copy_sfa_args(self) -> list[Any]:
        m, o = self.meta, self.outputs
        return [self.mla_rope, self.mla_query, m["actual_seq_lengths_query"],
                m["actual_seq_lengths_key"], m["num_cache_tokens"], o["topk_dst_slots"],
                o["topk_src_ids"], o["topk_miss_counts"], o["miss_src_ids"],
                o["miss_dst_slots"], o["miss_counts"], self.hbm_table, self.dram_table,
                self.hbm_rope, self.hbm_kv, self.dram_rope, self.dram_kv,
                LATENT_DIM ** -0.5, self.attention_out]

    def miss_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat host rows -> flat hot rows of every request's miss union (for sparse_copy)."""
        src, dst = [], []
        for b in range(REQUESTS):
            n = int(self.outputs["miss_counts"][b])
            tok = self.outputs["miss_src_ids"][b, :n].long()
            slot = self.outputs["miss_dst_slots"][b, :n].long()
            src.append(self.dram_table[b].long()[tok // BLOCK_SIZE] * BLOCK_SIZE
                       + tok % BLOCK_SIZE)
            dst.append(self.hbm_table[b].long()[slot // BLOCK_SIZE] * BLOCK_SIZE
                       + slot % BLOCK_SIZE)
        return torch.cat(src), torch.cat(dst)


def bench_config(tokens: int, reps: int, device: str, implementation: str) -> dict[str, Any]:
    sc = Scenario(tokens, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, float] = {}
    for name, quantised in (("lightning_indexer_manage", False),
                            ("quant_lightning_indexer_manage", True)):
        op = ops.quant_lightning_indexer_manage if quantised else ops.lightning_indexer_manage
        args = sc.manage_args(quantised, -1)
        times[name] = median_ms(functools.partial(op, *args, implementation=implementation),
                                reps, before=sc.restore_pool, sync=sync)
    sc.restore_pool()
    ops.lightning_indexer_manage(*sc.manage_args(False, -1), implementation=implementation)
    misses = int(sc.outputs["miss_counts"].sum())
    src_ids = sc.outputs["topk_src_ids"].reshape(REQUESTS, -1)
    distinct = sum(int(torch.unique(row[row >= 0]).numel()) for row in src_ids)
    copy_args = sc.copy_sfa_args()
    times["scatter_copy_sparse_flash_attention"] = median_ms(
        lambda: ops.scatter_copy_sparse_flash_attention(*copy_args,
                                                        implementation=implementation),
        reps, sync=sync)
    src, dst = sc.miss_rows()
    src = src.to(sc.dram_kv.device)
    host, hot = sc.dram_kv.view(-1, LATENT_DIM), sc.hbm_kv.view(-1, LATENT_DIM)
    times["sparse_copy (miss rows, latent)"] = median_ms(
        lambda: ops.sparse_copy(host, hot, src, dst, implementation=implementation), reps,
        sync=sync)
    times["hadamard_quant_int8 (query)"] = median_ms(
        lambda: hadamard_quant_int8(sc.query), reps, sync=sync)
    return {"tokens": tokens, "device": device, "implementation": implementation,
            "reps": reps, "times_ms": times, "misses": misses,
            "distinct_selected": distinct,
            "miss_copy_bytes": misses * BYTES_PER_TOKEN,
            "full_reload_bytes": REQUESTS * tokens * BYTES_PER_TOKEN}


def triton_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        dispatch.select("scatter_copy_sparse_flash_attention", "cuda", choice="triton")
        import kvo_kernels.triton  # noqa: F401
    except Exception:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="where to write the results")
    parser.add_argument("--quick", action="store_true",
                        help="32K only, one timed call, no warm-up")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global WARM_UP
    WARM_UP = 0 if args.quick else 1
    configs = [(32 * 1024, 1)] if args.quick else [(32 * 1024, 5), (128 * 1024, 3)]
    gpu = triton_usable()
    results = []
    for tokens, reps in configs:
        results.append(bench_config(tokens, reps, "cpu", "reference"))
        if gpu:
            results.append(bench_config(tokens, reps, "cuda", "triton"))
    print_table(results, gpu)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "benchmark": "kernels", "quick": args.quick, "threads": args.threads,
        "requests": REQUESTS, "query_rows": QUERY_ROWS, "indexer_heads": INDEXER_HEADS,
        "top_k": TOP_K, "capacity": CAPACITY, "attention_heads": ATTENTION_HEADS,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "triton": "measured" if gpu else "n/a (no GPU)", "results": results}, indent=2))


def print_table(results: list[dict[str, Any]], gpu: bool) -> None:
    by_tokens: dict[int, dict[str, dict[str, Any]]] = {}
    for r in results:
        by_tokens.setdefault(r["tokens"], {})[r["implementation"]] = r
    print(f"R={REQUESTS} x Q={QUERY_ROWS}, H={INDEXER_HEADS}, top-k {TOP_K}, capacity "
          f"{CAPACITY}, MLA {ATTENTION_HEADS} heads x ({LATENT_DIM}+{ROPE_DIM}), bf16")
    print(f"{'op':40} {'tokens':>7} {'reference CPU ms':>17} {'triton GPU ms':>14}")
    for tokens, impls in by_tokens.items():
        ref = impls["reference"]
        for op, ms in ref["times_ms"].items():
            tri = impls.get("triton")
            tri_ms = f"{tri['times_ms'][op]:14.2f}" if tri else f"{'n/a':>14}"
            print(f"{op:40} {tokens // 1024:6}K {ms:17.1f} {tri_ms}")
    print(f"\n{'tokens':>7} {'misses':>7} {'miss %':>7} {'miss copy MiB':>14} "
          f"{'full reload MiB':>16} {'ratio':>8}")
    for tokens, impls in by_tokens.items():
        ref = impls["reference"]
        fraction = ref["misses"] / max(1, ref["distinct_selected"])
        print(f"{tokens // 1024:6}K {ref['misses']:7d} {100 * fraction:6.1f}% "
              f"{ref['miss_copy_bytes'] / 2**20:14.2f} {ref['full_reload_bytes'] / 2**20:16.1f} "
              f"{ref['full_reload_bytes'] / max(1, ref['miss_copy_bytes']):7.0f}x")
    if not gpu:
        print("triton: n/a (no CUDA GPU here; Triton runs on CPU only in its interpreter)")


if __name__ == "__main__":
    main()
