"""Benchmark: prefill TTFT with layerwise offload (LayerwiseStoreConnector) against no offload.

The tiny random Llama (8 layers, fp32) runs in two vLLM CPU engines, each in its own process:
plain, and with the connector saving every layer to a Mooncake store while the 8 layers share
3 device buffers. The engines take turns on the same fresh prompts (no prefix hits), alternating
which goes first, so a busy machine slows both alike; the overhead is the median of the paired
ratios. The prefill device KV footprint is read from the live caches. Target: at most 10% TTFT
overhead at 4K tokens.

Starts Mooncake, so it runs inside a loopback-only network namespace
(``nox -s bench -- e2e_layerwise`` does that); by hand::

    unshare -n sh -c 'ip link set lo up; KVO_IN_NETNS=1 python tools/bench/e2e_layerwise.py --quick'
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent.parent
TARGET_OVERHEAD_PCT = 10.0
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
              "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    parser.add_argument("--quick", action="store_true",
                        help="short run: 1K and 2K tokens, two repetitions")
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt lengths in tokens")
    parser.add_argument("--reps", type=int, help="timed prompt pairs per length")
    parser.add_argument("--model-dir", type=Path, help="where to build/reuse the tiny model")
    args = parser.parse_args(argv)
    if args.lengths is None:
        args.lengths = [1024, 2048] if args.quick else [1024, 4096]
    if args.reps is None:
        args.reps = 2 if args.quick else 5
    if any(n < 2 or n > 8000 for n in args.lengths):
        parser.error(f"--lengths must be between 2 and 8000 tokens, got {args.lengths}")
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    return args


# -- engine processes --------------------------------------------------------------------------

def kv_storage_bytes(worker: Any) -> int:
    """Bytes of the device KV allocation behind the model's layers (each storage once)."""
    storages = {}
    for cache in worker.model_runner.kv_caches:
        storage = cache.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def engine_process(channel: Connection, model: str, max_len: int,
                   transfer: dict[str, Any] | None) -> None:
    """Start one engine, then answer ("ttft", token ids) / ("report",) / ("stop",)."""
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {} if transfer is None else {"kv_transfer_config": KVTransferConfig(**transfer)}
    llm = LLM(model=model, dtype="float32", enforce_eager=True,
              distributed_executor_backend="uni", max_model_len=max_len,
              max_num_batched_tokens=max_len, seed=0, **extra)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    channel.send("ready")
    while True:
        command = channel.recv()
        if command[0] == "ttft":
            started = time.perf_counter()
            llm.generate([{"prompt_token_ids": command[1]}], params, use_tqdm=False)
            channel.send(time.perf_counter() - started)
        elif command[0] == "report":
            channel.send(report_of(llm, transfer is not None))
        else:
            llm.llm_engine.engine_core.shutdown()
            channel.send("stopped")
            return


def report_of(llm: Any, offloading: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"kv_bytes": llm.collective_rpc(kv_storage_bytes)[0]}
    if offloading:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        stats, layout = connector.stats, connector.layout
        report.update(
            layers=layout.num_layers, physical_buffers=layout.physical_buffers,
            planned_ratio=layout.physical_bytes / layout.logical_bytes,
            saved_bytes=stats.saved_bytes, failed_saves=stats.failed_saves,
            failed_loads=stats.failed_loads, save_seconds=stats.save_seconds,
            ready_wait_seconds=stats.ready_wait_seconds,
            step_end_wait_seconds=stats.step_end_wait_seconds, steps=stats.steps)
    return report


class Engine:
    """Parent-side handle of one engine process."""

    def __init__(self, name: str, model: Path, max_len: int,
                 transfer: dict[str, Any] | None) -> None:
        context = multiprocessing.get_context("spawn")
        self.name = name
        self.channel, child = context.Pipe()
        self.process = context.Process(target=engine_process, name=f"kvo-bench-{name}",
                                       args=(child, str(model), max_len, transfer))
        self.process.start()

    def wait_ready(self) -> None:
        if self.channel.recv() != "ready":
            raise RuntimeError(f"the {self.name} engine did not start")

    def ask(self, *command: Any) -> Any:
        self.channel.send(command)
        return self.channel.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.ask("stop")
            finally:
                self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.terminate()


# -- measurement ---------------------------------------------------------------------------

def paired_ttft(plain: Engine, offload: Engine, lengths: list[int], reps: int
                ) -> list[dict[str, Any]]:
    rng = random.Random(0)

    def fresh(length: int) -> list[int]:
        return [rng.randrange(256) for _ in range(length)]

    rows = []
    for length in lengths:
        warm = fresh(length)
        plain.ask("ttft", warm)
        offload.ask("ttft", warm)
        plain_s, offload_s = [], []
        for rep in range(reps):
            prompt = fresh(length)
            order = (plain, offload) if rep % 2 == 0 else (offload, plain)
            times = {engine.name: engine.ask("ttft", prompt) for engine in order}
            plain_s.append(times["plain"])
            offload_s.append(times["layerwise"])
            print(f"  {length} tokens, pair {rep + 1}/{reps}: plain {times['plain']:.3f} s, "
                  f"layerwise {times['layerwise']:.3f} s", flush=True)
        ratios = [o / p for o, p in zip(offload_s, plain_s, strict=True)]
        rows.append({"prompt_tokens": length, "ttft_plain_s": statistics.median(plain_s),
                     "ttft_layerwise_s": statistics.median(offload_s),
                     "overhead_pct": 100.0 * (statistics.median(ratios) - 1.0),
                     "samples_plain_s": plain_s, "samples_layerwise_s": offload_s})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(TOOLS))
    from models.tiny_llama import build_tiny_llama

    from kvo_transport.mooncake_master import MooncakeMaster

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = build_tiny_llama(args.model_dir or Path(tempfile.gettempdir()) / "kvo-tiny-llama-8",
                             num_layers=8)
    max_len = max(args.lengths) + 64
    with MooncakeMaster() as master:
        transfer = {
            "kv_connector": "LayerwiseStoreConnector",
            "kv_connector_module_path": "kvo_vllm.connectors", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "store_master_address": master.address, "store_segment_bytes": 512 << 20,
                "shared_buffers": 2, "independent_layers": [0], "prefetch_depth": 1}}
        print("starting a plain engine and a layerwise-offload engine ...", flush=True)
        plain = Engine("plain", model, max_len, None)
        offload = Engine("layerwise", model, max_len, transfer)
        try:
            plain.wait_ready()
            offload.wait_ready()
            rows = paired_ttft(plain, offload, args.lengths, args.reps)
            plain_report, offload_report = plain.ask("report"), offload.ask("report")
        finally:
            plain.stop()
            offload.stop()
    at_target = [r for r in rows if r["prompt_tokens"] >= 4096]
    waited = offload_report["ready_wait_seconds"] + offload_report["step_end_wait_seconds"]
    return {
        "benchmark": "e2e_layerwise", "model": "tiny random Llama, 8 layers, fp32",
        "quick": args.quick, "reps": args.reps, "cpus": os.cpu_count(),
        "layers": offload_report["layers"],
        "physical_buffers": offload_report["physical_buffers"],
        "planned_footprint_ratio": offload_report["planned_ratio"],
        "kv_bytes_plain": plain_report["kv_bytes"],
        "kv_bytes_layerwise": offload_report["kv_bytes"],
        "footprint_ratio": offload_report["kv_bytes"] / plain_report["kv_bytes"],
        **{key: offload_report[key] for key in (
            "saved_bytes", "failed_saves", "failed_loads", "save_seconds", "ready_wait_seconds",
            "step_end_wait_seconds", "steps")},
        "critical_path_ms_per_prefill": 1000.0 * waited / max(offload_report["steps"], 1),
        "results": rows, "target_overhead_pct": TARGET_OVERHEAD_PCT,
        "meets_target": (all(r["overhead_pct"] <= TARGET_OVERHEAD_PCT for r in at_target)
                         if at_target else None),
    }


def print_table(report: dict[str, Any]) -> None:
    print()
    print("| prompt tokens | TTFT plain (s) | TTFT layerwise (s) | overhead (median pair) |")
    print("|---:|---:|---:|---:|")
    for row in report["results"]:
        print(f"| {row['prompt_tokens']} | {row['ttft_plain_s']:.3f} | "
              f"{row['ttft_layerwise_s']:.3f} | {row['overhead_pct']:+.1f}% |")
    print()
    print(f"prefill device KV: {report['kv_bytes_layerwise'] / 2**20:.0f} MiB with reuse vs "
          f"{report['kv_bytes_plain'] / 2**20:.0f} MiB without "
          f"(ratio {report['footprint_ratio']:.3f}, planned "
          f"{report['planned_footprint_ratio']:.3f}: {report['physical_buffers']} buffers for "
          f"{report['layers']} layers)")
    print(f"saved to the store: {report['saved_bytes'] / 2**20:.1f} MiB, "
          f"{report['save_seconds']:.2f} s of background save time, "
          f"{report['failed_saves']} failed saves")
    print(f"connector on the critical path over {report['steps']} prefills: "
          f"{report['ready_wait_seconds']:.3f} s waiting for buffers, "
          f"{report['step_end_wait_seconds']:.3f} s waiting for the last saves "
          f"({report['critical_path_ms_per_prefill']:.1f} ms per prefill)")
    if report["meets_target"] is not None:
        verdict = "met" if report["meets_target"] else "MISSED"
        print(f"target (<= {report['target_overhead_pct']:.0f}% TTFT overhead at 4K): {verdict}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ.get("KVO_IN_NETNS") != "1":
        print("e2e_layerwise starts Mooncake, which listens on every interface: run it inside a "
              "loopback-only network namespace, e.g.\n  unshare -n sh -c 'ip link set lo up; "
              "KVO_IN_NETNS=1 python tools/bench/e2e_layerwise.py --quick'\n"
              "(nox -s bench -- e2e_layerwise does this)", file=sys.stderr)
        return 2
    report = run(args)
    print_table(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
