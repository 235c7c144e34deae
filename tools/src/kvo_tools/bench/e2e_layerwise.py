"""Benchmark: prefill TTFT with layerwise offload (LayerwiseStoreConnector) against no offload
and against vLLM's own ``MooncakeStoreConnector``.

The tiny random Llama (8 layers, fp32) runs in three vLLM CPU engines, each in its own process:
plain; kvo, with the connector saving every layer to a Mooncake store while the 8 layers share
3 device buffers; and the peer a user would pick instead, vLLM's ``MooncakeStoreConnector`` as
shipped (it runs stock on vLLM-CPU: ``MOONCAKE_CONFIG_PATH`` names a JSON file with P2PHANDSHAKE
metadata, the master's address and tcp), saving to the same Mooncake master. The engines take
turns on the same fresh prompts (no prefix hits), in a new random order each round, each after a
pause (``--settle-ms``) in which the previous engine's background work (its store puts) ends: a
TTFT is that of a request on a machine with nothing else running, and no engine always inherits
the same predecessor's leftovers (with a fixed rotation the peer always ran right after kvo's
put, and plain right after the peer's). The engines are started afresh ``--sessions`` times:
one engine process runs several percent faster or slower than another of the same kind for its
whole life (seen at 1K and 4K tokens: plain fastest in one start, the peer in the next).
Overheads are medians of the per-round ratios, never ratios of medians.

The engines run vLLM's ``uni`` executor in their own processes, and vLLM binds the OpenMP
threads of a CPU worker only in its ``mp`` executor (``OMP_PLACES``/``OMP_PROC_BIND`` set by
``vllm/utils/ompmultiprocessing.py``). Unbound, the threads of a forward that follows any
Mooncake master RPC (kvo's lookup and the peer's ``batch_is_exist`` alike) share one CPU for
several ms until the scheduler splits them: +3-8 ms on a ~20 ms prefill, unrelated to the
connector's own work. So every engine binds its threads as a served vLLM-CPU would
(``--omp-bind cores``: ``OMP_PLACES=cores OMP_PROC_BIND=close``, the same for all engines);
``--omp-bind none`` leaves them unbound. The prefill device KV
footprint is read from the live caches. Targets: at most 10% TTFT overhead over plain at 4K
tokens; kvo/peer <= 1 at every length (issue 15 §4).

Starts Mooncake, so it runs inside a loopback-only network namespace
(``nox -s bench -- e2e_layerwise`` does that); by hand::

    unshare -n sh -c 'ip link set lo up; KVO_IN_NETNS=1 \
        python -m kvo_tools.bench.e2e_layerwise --quick'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

TARGET_OVERHEAD_PCT = 10.0
STORE_SEGMENT_BYTES = 512 << 20
"""Each engine's contribution to the Mooncake pool (kvo's and the peer's alike)."""
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
              "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
OMP_BINDINGS = {"cores": {"OMP_PLACES": "cores", "OMP_PROC_BIND": "close"},
                "none": {"OMP_PROC_BIND": "false"}}
"""OpenMP thread binding of every engine (module docstring): what vLLM's mp executor does, or
nothing."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    parser.add_argument("--quick", action="store_true",
                        help="short run: 256 and 1K tokens, two repetitions")
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt lengths in tokens")
    parser.add_argument("--reps", type=int, help="timed prompt pairs per length")
    parser.add_argument("--sessions", type=int, default=3,
                        help="times every engine is started afresh, --reps rounds each "
                             "(default 3): a process's speed varies by several percent from one "
                             "start to the next, the same in all its rounds")
    parser.add_argument("--settle-ms", type=float, default=200.0,
                        help="pause before each timed request, so the previous engine's "
                             "background work has ended (default 200)")
    parser.add_argument("--model-dir", type=Path, help="where to build/reuse the tiny model")
    parser.add_argument("--omp-bind", choices=sorted(OMP_BINDINGS), default="cores",
                        help="OpenMP thread binding of every engine: 'cores' binds one thread "
                             "per core as vLLM's mp executor does (default); 'none' leaves "
                             "them to the scheduler")
    parser.add_argument("--no-peer", action="store_true",
                        help="leave out vLLM's MooncakeStoreConnector engine")
    parser.add_argument("--direct", action="store_true",
                        help="add a kvo engine without save staging (save_staging_bytes=0: "
                             "every layer put from its device buffer during the forward)")
    args = parser.parse_args(argv)
    if args.lengths is None:
        args.lengths = [256, 1024] if args.quick else [256, 512, 1024, 4096]
    if args.reps is None:
        args.reps = 2 if args.quick else 8
    if args.quick:
        args.sessions = 1
    if any(n < 2 or n > 8000 for n in args.lengths):
        parser.error(f"--lengths must be between 2 and 8000 tokens, got {args.lengths}")
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    if args.sessions < 1:
        parser.error(f"--sessions must be >= 1, got {args.sessions}")
    if not 0 <= args.settle_ms <= 10_000:
        parser.error(f"--settle-ms must be between 0 and 10000, got {args.settle_ms}")
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
                   transfer: dict[str, Any] | None, env: dict[str, str]) -> None:
    """Start one engine, then answer ("ttft", token ids) / ("report",) / ("stop",).

    ``env`` is applied before torch loads: the OpenMP runtime reads its binding once."""
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    os.environ.update(env)
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    llm = LLM(model=model, dtype="float32", enforce_eager=True,
              distributed_executor_backend="uni", max_model_len=max_len,
              max_num_batched_tokens=max_len, seed=0,
              kv_transfer_config=None if transfer is None else KVTransferConfig(**transfer))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    channel.send("ready")
    while True:
        command = channel.recv()
        if command[0] == "ttft":
            started = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=command[1])], params, use_tqdm=False)
            channel.send(time.perf_counter() - started)
        elif command[0] == "report":
            channel.send(report_of(llm, transfer))
        else:
            llm.llm_engine.engine_core.shutdown()
            channel.send("stopped")
            return


def report_of(llm: Any, transfer: dict[str, Any] | None) -> dict[str, Any]:
    report: dict[str, Any] = {"kv_bytes": llm.collective_rpc(kv_storage_bytes)[0]}
    if transfer is not None and transfer["kv_connector"] == "LayerwiseStoreConnector":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from kvo_vllm.layerwise.connector import LayerwiseStoreConnector

        connector = get_kv_transfer_group()
        if not isinstance(connector, LayerwiseStoreConnector):
            raise TypeError(f"the engine's connector is {type(connector).__name__}, "
                            "expected LayerwiseStoreConnector")
        stats, layout = connector.stats, connector.layout
        report.update(
            layers=layout.num_layers, physical_buffers=layout.physical_buffers,
            planned_ratio=layout.physical_bytes / layout.logical_bytes,
            saved_bytes=stats.saved_bytes, failed_saves=stats.failed_saves,
            failed_loads=stats.failed_loads, save_seconds=stats.save_seconds,
            ready_wait_seconds=stats.ready_wait_seconds,
            step_end_wait_seconds=stats.step_end_wait_seconds, steps=stats.steps,
            staged_bytes=stats.staged_bytes, staging_fallbacks=stats.staging_fallbacks,
            held_bytes=stats.held_bytes,
            stage_seconds=stats.stage_seconds, flush_seconds=stats.flush_seconds,
            flush_wait_seconds=stats.flush_wait_seconds)
    return report


class Engine:
    """Parent-side handle of one engine process."""

    def __init__(self, name: str, model: Path, max_len: int, omp_bind: str,
                 transfer: dict[str, Any] | None, env: dict[str, str] | None = None, *,
                 target: Callable[..., None] | None = None) -> None:
        """``target``: the engine process's loop (default ``engine_process``; it takes the
        same arguments)."""
        context = multiprocessing.get_context("spawn")
        self.name = name
        self.channel, child = context.Pipe()
        engine_env = {**OMP_BINDINGS[omp_bind], **(env or {})}
        self.process = context.Process(target=target or engine_process,
                                       name=f"kvo-bench-{name}",
                                       args=(child, str(model), max_len, transfer, engine_env))
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

Samples = dict[int, dict[str, list[float]]]
"""TTFT seconds per prompt length and engine name, one per round, rounds aligned."""


def rounds_ttft(engines: list[Engine], lengths: list[int], reps: int, settle_s: float,
                rng: random.Random, samples: Samples) -> None:
    """Every engine answers the same fresh prompt per round, in a random order, each after
    ``settle_s`` of pause (module docstring); appends to ``samples``."""

    def fresh(length: int) -> list[int]:
        return [rng.randrange(256) for _ in range(length)]

    for length in lengths:
        warm = fresh(length)
        for engine in engines:
            engine.ask("ttft", warm)
        by_name = samples.setdefault(length, {engine.name: [] for engine in engines})
        for rep in range(reps):
            prompt = fresh(length)
            order = list(engines)
            rng.shuffle(order)
            for engine in order:
                time.sleep(settle_s)
                by_name[engine.name].append(engine.ask("ttft", prompt))
            print(f"  {length} tokens, round {rep + 1}/{reps}: " + ", ".join(
                f"{name} {times[-1] * 1000:.1f} ms" for name, times in by_name.items()),
                flush=True)


def median_ratio(top: list[float], bottom: list[float]) -> float:
    return statistics.median(t / b for t, b in zip(top, bottom, strict=True))


def row_of(length: int, samples: dict[str, list[float]], sessions: int) -> dict[str, Any]:
    plain, kvo = samples["plain"], samples["layerwise"]
    row: dict[str, Any] = {
        "prompt_tokens": length, "ttft_plain_s": statistics.median(plain),
        "ttft_layerwise_s": statistics.median(kvo),
        "overhead_pct": 100.0 * (median_ratio(kvo, plain) - 1.0),
        "samples_plain_s": plain, "samples_layerwise_s": kvo}
    peer = samples.get("peer")
    if peer is not None:
        per = len(kvo) // sessions
        row.update(ttft_peer_s=statistics.median(peer),
                   peer_overhead_pct=100.0 * (median_ratio(peer, plain) - 1.0),
                   kvo_over_peer=median_ratio(kvo, peer), samples_peer_s=peer,
                   kvo_over_peer_by_session=[
                       median_ratio(kvo[i * per:(i + 1) * per], peer[i * per:(i + 1) * per])
                       for i in range(sessions)])
    direct = samples.get("direct")
    if direct is not None:
        row.update(ttft_direct_s=statistics.median(direct),
                   kvo_over_direct=median_ratio(kvo, direct), samples_direct_s=direct)
        if peer is not None:
            row.update(direct_over_peer=median_ratio(direct, peer))
    return row


def peer_transfer(workdir: Path, master_address: str) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM's MooncakeStoreConnector as a user starts it on CPU: (transfer config, env)."""
    config = workdir / "mooncake-store.json"
    config.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE", "master_server_address": master_address,
        "protocol": "tcp", "device_name": "", "global_segment_size": STORE_SEGMENT_BYTES,
        "local_buffer_size": STORE_SEGMENT_BYTES}))
    return ({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"},
            {"MOONCAKE_CONFIG_PATH": str(config)})


def tiny_llama(model_dir: Path | None) -> Path:
    """The 8-layer tiny random Llama both layerwise benchmarks serve (built once, reused)."""
    from kvo_tools.models.tiny_llama import build_tiny_llama

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path: Path = build_tiny_llama(
        model_dir or Path(tempfile.gettempdir()) / "kvo-tiny-llama-8", num_layers=8)
    return path


def kvo_transfer(master_address: str, *, own_buffers: bool = False) -> dict[str, Any]:
    """kvo's LayerwiseStoreConnector as the benchmarks run it: 8 layers in 3 buffers, save
    staging on (its default, 64 MiB). ``own_buffers``: every layer keeps a buffer of its own
    (the device memory of a connector that does not share buffers)."""
    layers = ({"independent_layers": "all"} if own_buffers
              else {"shared_buffers": 2, "independent_layers": [0], "prefetch_depth": 1})
    return {
        "kv_connector": "LayerwiseStoreConnector",
        "kv_connector_module_path": "kvo_vllm.connectors", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "store_master_address": master_address,
            "store_segment_bytes": STORE_SEGMENT_BYTES, **layers}}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvo_transport.mooncake_master import MooncakeMaster

    model = tiny_llama(args.model_dir)
    max_len = max(args.lengths) + 64
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(MooncakeMaster())
        # The direct engine saves the same blocks under the same keys: on a master of its own,
        # so it never finds the staged engine's saves of a prompt (no prefix hits).
        direct_master = stack.enter_context(MooncakeMaster()) if args.direct else None
        workdir = stack.enter_context(tempfile.TemporaryDirectory())
        transfer = kvo_transfer(master.address)
        names = "plain, layerwise" + ("" if args.no_peer else " and MooncakeStoreConnector")
        rng = random.Random(0)  # one stream: no prompt repeats across sessions (no store hits)
        samples: Samples = {}
        for session in range(args.sessions):
            print(f"session {session + 1}/{args.sessions}: starting the {names} engines ...",
                  flush=True)
            engines = [Engine("plain", model, max_len, args.omp_bind, None),
                       Engine("layerwise", model, max_len, args.omp_bind, transfer)]
            if not args.no_peer:
                engines.append(Engine("peer", model, max_len, args.omp_bind,
                                      *peer_transfer(Path(workdir), master.address)))
            if args.direct:
                assert direct_master is not None
                direct = json.loads(json.dumps(transfer))
                direct["kv_connector_extra_config"].update(
                    save_staging_bytes=0, store_master_address=direct_master.address)
                engines.append(Engine("direct", model, max_len, args.omp_bind, direct))
            try:
                for engine in engines:
                    engine.wait_ready()
                rounds_ttft(engines, args.lengths, args.reps, args.settle_ms / 1000, rng,
                            samples)
                plain_report = engines[0].ask("report")
                offload_report = engines[1].ask("report")
            finally:
                for engine in engines:
                    engine.stop()
        rows = [row_of(length, samples[length], args.sessions) for length in args.lengths]
    at_target = [r for r in rows if r["prompt_tokens"] >= 4096]
    waited = offload_report["ready_wait_seconds"] + offload_report["step_end_wait_seconds"]
    return {
        "benchmark": "e2e_layerwise", "model": "tiny random Llama, 8 layers, fp32",
        "quick": args.quick, "reps": args.reps, "sessions": args.sessions,
        "settle_ms": args.settle_ms, "connector_stats": "of the last session's kvo engine",
        "omp_bind": args.omp_bind, "omp_env": OMP_BINDINGS[args.omp_bind],
        "cpus": os.cpu_count(),
        "peer": None if args.no_peer else "vLLM MooncakeStoreConnector (kv_both, tcp)",
        "layers": offload_report["layers"],
        "physical_buffers": offload_report["physical_buffers"],
        "planned_footprint_ratio": offload_report["planned_ratio"],
        "kv_bytes_plain": plain_report["kv_bytes"],
        "kv_bytes_layerwise": offload_report["kv_bytes"],
        "footprint_ratio": offload_report["kv_bytes"] / plain_report["kv_bytes"],
        **{key: offload_report[key] for key in (
            "saved_bytes", "failed_saves", "failed_loads", "save_seconds", "ready_wait_seconds",
            "step_end_wait_seconds", "steps", "staged_bytes", "held_bytes", "staging_fallbacks",
            "stage_seconds", "flush_seconds", "flush_wait_seconds")},
        "critical_path_ms_per_prefill": 1000.0 * waited / max(offload_report["steps"], 1),
        "results": rows, "target_overhead_pct": TARGET_OVERHEAD_PCT,
        "meets_target": (all(r["overhead_pct"] <= TARGET_OVERHEAD_PCT for r in at_target)
                         if at_target else None),
        "at_or_below_peer": (None if args.no_peer
                             else all(r["kvo_over_peer"] <= 1.0 for r in rows)),
    }


def print_table(report: dict[str, Any]) -> None:
    peer = report["peer"] is not None
    print()
    print("| prompt tokens | TTFT plain (ms) | TTFT layerwise (ms) | overhead (median round) |"
          + (" TTFT peer (ms) | peer overhead | kvo/peer (median round) |" if peer else ""))
    print("|---:|---:|---:|---:|" + ("---:|---:|---:|" if peer else ""))
    for row in report["results"]:
        line = (f"| {row['prompt_tokens']} | {row['ttft_plain_s'] * 1000:.1f} | "
                f"{row['ttft_layerwise_s'] * 1000:.1f} | {row['overhead_pct']:+.1f}% |")
        if peer:
            line += (f" {row['ttft_peer_s'] * 1000:.1f} | {row['peer_overhead_pct']:+.1f}% | "
                     f"{row['kvo_over_peer']:.3f} |")
        print(line)
    print()
    print(f"OpenMP binding of every engine: {report['omp_bind']} "
          f"({' '.join(f'{k}={v}' for k, v in report['omp_env'].items())})")
    if peer:
        print("kvo/peer per session (median round): " + "; ".join(
            f"{row['prompt_tokens']}: " + " / ".join(
                f"{ratio:.3f}" for ratio in row["kvo_over_peer_by_session"])
            for row in report["results"]))
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
    steps = max(report["steps"], 1)
    print(f"save staging: {report['staged_bytes'] / 2**20:.1f} MiB staged, "
          f"{report['held_bytes'] / 2**20:.1f} MiB put from the buffers in place (the last "
          f"layer of each), "
          f"{report['staging_fallbacks']} layers saved directly (area full); per prefill "
          f"{1000 * report['stage_seconds'] / steps:.2f} ms copying to staging (forward "
          f"thread), {1000 * report['flush_seconds'] / steps:.2f} ms batched put after the "
          f"forward, {1000 * report['flush_wait_seconds'] / steps:.2f} ms the next step waited "
          f"for it")
    if any("kvo_over_direct" in row for row in report["results"]):
        print("kvo staged vs direct saves (median round ratio): " + ", ".join(
            f"{row['prompt_tokens']}: {row['kvo_over_direct']:.3f}"
            + (f" (direct/peer {row['direct_over_peer']:.3f})" if "direct_over_peer" in row
               else "") for row in report["results"]))
    if report["meets_target"] is not None:
        verdict = "met" if report["meets_target"] else "MISSED"
        print(f"target (<= {report['target_overhead_pct']:.0f}% TTFT overhead at 4K): {verdict}")
    if report["at_or_below_peer"] is not None:
        verdict = "met" if report["at_or_below_peer"] else "MISSED"
        print(f"target (kvo/peer <= 1 at every length): {verdict}")


def main(argv: list[str] | None = None) -> int:
    return run_in_netns("e2e_layerwise", parse_args(argv), run, print_table)


def run_in_netns(name: str, args: argparse.Namespace,
                 run: Callable[[argparse.Namespace], dict[str, Any]],
                 print_table: Callable[[dict[str, Any]], None]) -> int:
    """A Mooncake benchmark's main: refuse outside a loopback-only namespace, run, print the
    table, write ``--json``."""
    if os.environ.get("KVO_IN_NETNS") != "1":
        print(f"{name} starts Mooncake, which listens on every interface: run it inside a "
              f"loopback-only network namespace, e.g.\n  unshare -n sh -c 'ip link set lo up; "
              f"KVO_IN_NETNS=1 python -m kvo_tools.bench.{name}'\n"
              f"(nox -s bench -- {name} does this)", file=sys.stderr)
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
