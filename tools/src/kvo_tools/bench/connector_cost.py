"""Benchmark: what a store connector costs a cold prefill, measured inside one engine.

``e2e_layerwise`` compares separate engine processes, and one process runs several percent
faster or slower than another of the same kind for its whole life: at short prompts that is
more than a connector's whole cost. Here each engine measures its own connector: its requests
alternate, in a random order per pair, between the connector at work and the connector bypassed
(its prefix lookup answers "no hit" without asking the store, its worker hooks return at once),
on fresh prompts, after a pause each (``--settle-ms``). The cost is the median of the paired
differences (with - without), so process-to-process speed drops out.

Engines, all alive, taking turns: kvo's ``LayerwiseStoreConnector`` (8 layers in 3 buffers,
save staging on: ``kvo``), kvo with a buffer per layer (``kvo-own``: the device memory of a
connector that shares no buffers, so nothing is copied; ``--kvo-plans`` picks them) and vLLM's
own ``MooncakeStoreConnector`` as shipped (the peer of ``e2e_layerwise``), on one Mooncake
master. A second table splits each connector's time on the engine's thread by call. The bypass
and the call timers are this benchmark's own patches of each connector class in its engine
process (measuring devices, on no production path). The engines bind their OpenMP threads as
in ``e2e_layerwise`` (``--omp-bind``).

Starts Mooncake, so it runs inside a loopback-only network namespace
(``nox -s bench -- connector_cost`` does that); by hand::

    unshare -n sh -c 'ip link set lo up; KVO_IN_NETNS=1 python -m kvo_tools.bench.connector_cost'
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, ClassVar

from kvo_tools.bench._inproc import inproc_scheduler
from kvo_tools.bench.e2e_layerwise import (
    ENGINE_ENV,
    OMP_BINDINGS,
    kvo_transfer,
    peer_transfer,
    run_in_netns,
    tiny_llama,
)
from kvo_tools.bench.e2e_layerwise import (
    Engine as LayerwiseBenchEngine,
)

BYPASSED_HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save")
"""Worker hooks that return at once while the connector is bypassed."""
PREFIX_LOOKUP = "get_num_new_matched_tokens"
"""The scheduler hook that reports no stored prefix while the connector is bypassed."""

TIMED_HOOKS = {
    "lookup": ("get_num_new_matched_tokens",),
    "start_load_kv": ("start_load_kv", "handle_preemptions"),
    "per_layer": ("wait_for_layer_load", "save_kv_layer"),
    "wait_for_save": ("wait_for_save",),
    "other": ("update_state_after_alloc", "build_connector_meta", "request_finished",
              "get_finished", "update_connector_output", "get_block_ids_with_load_errors",
              "get_kv_connector_stats", "build_connector_worker_meta"),
}
"""Connector calls timed on the engine's thread, by group (those a class lacks are skipped).
The timer itself adds ~0.3 us per call to both connectors."""

COPY = "copy"
"""kvo's staging copies (``SaveStaging.gather``), timed apart: a part of ``per_layer``, the
price of sharing buffers (a layer whose buffer the step reuses is copied out first)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON to this path")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024],
                        help="prompt lengths in tokens (default 256 512 1024)")
    parser.add_argument("--pairs", type=int, default=30,
                        help="with/without pairs per engine and length (default 30)")
    parser.add_argument("--settle-ms", type=float, default=100.0,
                        help="pause before each timed request (default 100)")
    parser.add_argument("--kvo-plans", nargs="+", choices=list(KVO_PLANS),
                        default=list(KVO_PLANS),
                        help="kvo engines to run beside the peer (default: both)")
    parser.add_argument("--omp-bind", choices=sorted(OMP_BINDINGS), default="cores",
                        help="OpenMP thread binding of both engines (see e2e_layerwise)")
    parser.add_argument("--model-dir", type=Path, help="where to build/reuse the tiny model")
    args = parser.parse_args(argv)
    if any(n < 2 or n > 8000 for n in args.lengths):
        parser.error(f"--lengths must be between 2 and 8000 tokens, got {args.lengths}")
    if args.pairs < 3:
        parser.error(f"--pairs must be >= 3, got {args.pairs}")
    if not 0 <= args.settle_ms <= 10_000:
        parser.error(f"--settle-ms must be between 0 and 10000, got {args.settle_ms}")
    return args


# -- engine processes --------------------------------------------------------------------------

class Bypass:
    """Whether the engine's connector is bypassed for the next request (engine process)."""

    on = False


def install_bypass(connector_class: type) -> None:
    """Wrap the connector's hooks and prefix lookup so that ``Bypass.on`` skips them."""
    for name in BYPASSED_HOOKS:
        hook = getattr(connector_class, name)

        def skipped(self: Any, *args: Any, _hook: Any = hook, **kwargs: Any) -> Any:
            return None if Bypass.on else _hook(self, *args, **kwargs)

        setattr(connector_class, name, skipped)
    lookup = getattr(connector_class, PREFIX_LOOKUP)

    def no_hit(self: Any, *args: Any, **kwargs: Any) -> Any:
        return (0, False) if Bypass.on else lookup(self, *args, **kwargs)

    setattr(connector_class, PREFIX_LOOKUP, no_hit)


KVO_PLANS = {"kvo": False, "kvo-own": True}
"""kvo engines by name: whether every layer has a buffer of its own (``kvo_transfer``)."""


class HookClock:
    """Seconds spent inside the connector's calls for the current request (engine process)."""

    seconds: ClassVar[dict[str, float]] = {}


def clocked(method: Any, group: str) -> Any:
    """``method`` adding the seconds of each call to ``HookClock.seconds[group]``."""

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            spent = time.perf_counter() - started
            HookClock.seconds[group] = HookClock.seconds.get(group, 0.0) + spent

    return timed


def install_hook_clock(connector_class: type) -> None:
    """Time every call of ``TIMED_HOOKS`` into ``HookClock.seconds`` by group."""
    for group, names in TIMED_HOOKS.items():
        for name in names:
            hook = getattr(connector_class, name, None)
            if hook is not None:
                setattr(connector_class, name, clocked(hook, group))


def install_copy_clock() -> None:
    """Time kvo's staging copies into ``HookClock.seconds[COPY]``."""
    from kvo_vllm.layerwise.staging import SaveStaging

    SaveStaging.gather = clocked(SaveStaging.gather, COPY)  # type: ignore[method-assign]


def release_skipped_saves(scheduler: Any, before: set[int]) -> None:
    """The peer's scheduler pins a request's blocks until its worker reports the store job
    done; a bypassed worker never runs the job, so the pins of jobs made while bypassed are
    dropped here as a finished job's are (else they pile up until the KV cache is full and
    the engine waits for blocks for ever)."""
    pool = scheduler._gpu_block_pool
    for job in set(scheduler._pinned_saves) - before:
        block_ids, _ = scheduler._pinned_saves.pop(job)
        pool.free_blocks(pool.blocks[block] for block in reversed(block_ids))


def store_connector_scheduler(llm: Any) -> Any:
    """The scheduler side of the peer engine's ``MooncakeStoreConnector`` (it holds the pins)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
        MooncakeStoreConnector,
    )

    connector = inproc_scheduler(llm).connector
    if not isinstance(connector, MooncakeStoreConnector):
        raise TypeError(f"the peer engine's connector is {type(connector).__name__}, "
                        "expected MooncakeStoreConnector")
    return connector.connector_scheduler


def engine_process(channel: Connection, model: str, max_len: int, transfer: dict[str, Any],
                   env: dict[str, str]) -> None:
    """Start one engine, then answer ("ttft", token ids, bypassed) / ("stop",)."""
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    os.environ.update(env)
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    if transfer["kv_connector"] == "LayerwiseStoreConnector":
        from kvo_vllm.layerwise.connector import LayerwiseStoreConnector

        install_bypass(LayerwiseStoreConnector)
        install_hook_clock(LayerwiseStoreConnector)
        install_copy_clock()
    else:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
            MooncakeStoreConnector,
        )

        install_bypass(MooncakeStoreConnector)
        install_hook_clock(MooncakeStoreConnector)
    llm = LLM(model=model, dtype="float32", enforce_eager=True,
              distributed_executor_backend="uni", max_model_len=max_len,
              max_num_batched_tokens=max_len, seed=0,
              kv_transfer_config=KVTransferConfig(**transfer))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    peer_scheduler = (None if transfer["kv_connector"] == "LayerwiseStoreConnector"
                      else store_connector_scheduler(llm))
    channel.send("ready")
    while True:
        command = channel.recv()
        if command[0] == "ttft":
            Bypass.on = command[2]
            pinned = set() if peer_scheduler is None else set(peer_scheduler._pinned_saves)
            HookClock.seconds = {}
            started = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=command[1])], params, use_tqdm=False)
            channel.send((time.perf_counter() - started, HookClock.seconds))
            if Bypass.on and peer_scheduler is not None:
                release_skipped_saves(peer_scheduler, pinned)
        else:
            llm.llm_engine.engine_core.shutdown()
            channel.send("stopped")
            return


class Engine(LayerwiseBenchEngine):
    """Parent-side handle of one engine process (``engine_process`` above)."""

    def __init__(self, name: str, model: Path, max_len: int, omp_bind: str,
                 transfer: dict[str, Any], env: dict[str, str] | None = None) -> None:
        super().__init__(name, model, max_len, omp_bind, transfer, env, target=engine_process)

    def ttft(self, prompt: list[int], bypassed: bool) -> tuple[float, dict[str, float]]:
        """TTFT of ``prompt`` and the seconds spent in the connector's calls, by group."""
        ttft, hooks = self.ask("ttft", prompt, bypassed)
        assert isinstance(ttft, float) and isinstance(hooks, dict)
        return ttft, hooks


# -- measurement ---------------------------------------------------------------------------

def measure(engines: list[Engine], lengths: list[int], pairs: int, settle_s: float,
            rng: random.Random) -> list[dict[str, Any]]:
    """Per length and engine: TTFT with and without the connector, paired (module docstring)."""
    rows = []
    for length in lengths:
        def fresh(n: int = length) -> list[int]:
            return [rng.randrange(256) for _ in range(n)]

        for engine in engines:  # warm both modes
            for bypassed in (False, True):
                engine.ttft(fresh(), bypassed)
        timed: dict[str, dict[bool, list[float]]] = {
            engine.name: {False: [], True: []} for engine in engines}
        hook_s: dict[str, list[dict[str, float]]] = {engine.name: [] for engine in engines}
        for _ in range(pairs):
            turns = [(engine, bypassed) for engine in engines for bypassed in (False, True)]
            rng.shuffle(turns)
            for engine, bypassed in turns:
                time.sleep(settle_s)
                ttft, hooks = engine.ttft(fresh(), bypassed)
                timed[engine.name][bypassed].append(ttft)
                if not bypassed:
                    hook_s[engine.name].append(hooks)
        row: dict[str, Any] = {"prompt_tokens": length}
        for name, by_mode in timed.items():
            with_s, without_s = by_mode[False], by_mode[True]
            row[name] = {
                "ttft_with_s": statistics.median(with_s),
                "ttft_without_s": statistics.median(without_s),
                "cost_s": statistics.median(w - o for w, o in zip(with_s, without_s,
                                                                  strict=True)),
                "hook_s": median_hook_seconds(hook_s[name]),
                "samples_with_s": with_s, "samples_without_s": without_s}
        peer = row["peer"]["cost_s"]
        for name in timed:
            if name != "peer":
                row[name]["cost_over_peer_cost"] = (row[name]["cost_s"] / peer if peer > 0
                                                    else None)
        print(f"  {length} tokens: " + ", ".join(
            f"{name} costs {row[name]['cost_s'] * 1000:.2f} ms" for name in timed), flush=True)
        rows.append(row)
    return rows


def median_hook_seconds(requests: list[dict[str, float]]) -> dict[str, float]:
    """Per group of ``TIMED_HOOKS``, in total, kvo's staging copies (``COPY``, inside
    ``per_layer``) and the total less them: the median over requests."""
    medians = {group: statistics.median(r.get(group, 0.0) for r in requests)
               for group in (*TIMED_HOOKS, COPY)}
    totals = [sum(r.get(group, 0.0) for group in TIMED_HOOKS) for r in requests]
    medians["total"] = statistics.median(totals)
    medians["total_less_copy"] = statistics.median(
        total - r.get(COPY, 0.0) for total, r in zip(totals, requests, strict=True))
    return medians


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvo_transport.mooncake_master import MooncakeMaster

    model = tiny_llama(args.model_dir)
    max_len = max(args.lengths) + 64
    omp = OMP_BINDINGS[args.omp_bind]
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(MooncakeMaster())
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        peer, peer_env = peer_transfer(workdir, master.address)
        print("starting the kvo and MooncakeStoreConnector engines ...", flush=True)
        engines = [Engine(name, model, max_len, args.omp_bind,
                          kvo_transfer(master.address, own_buffers=KVO_PLANS[name]))
                   for name in args.kvo_plans]
        engines.append(Engine("peer", model, max_len, args.omp_bind, peer, peer_env))
        try:
            for engine in engines:
                engine.wait_ready()
            rows = measure(engines, args.lengths, args.pairs, args.settle_ms / 1000,
                           random.Random(0))
        finally:
            for engine in engines:
                engine.stop()
    return {
        "benchmark": "connector_cost", "model": "tiny random Llama, 8 layers, fp32",
        "pairs": args.pairs, "settle_ms": args.settle_ms, "omp_bind": args.omp_bind,
        "omp_env": omp, "cpus": os.cpu_count(),
        "engines": {
            "kvo": "LayerwiseStoreConnector (8 layers in 3 buffers, save staging on)",
            "kvo-own": "LayerwiseStoreConnector (a buffer per layer, save staging on)",
            "peer": "vLLM MooncakeStoreConnector (kv_both, tcp)"},
        "kvo_plans": args.kvo_plans,
        "results": rows,
        "at_or_below_peer": {name: all(r[name]["cost_s"] <= r["peer"]["cost_s"] for r in rows)
                             for name in args.kvo_plans},
    }


def print_table(report: dict[str, Any]) -> None:
    print()
    names = [*report["kvo_plans"], "peer"]
    print("| prompt tokens | connector | TTFT with / without (ms) | cost (ms) | "
          "cost / peer cost |")
    print("|---:|---|---:|---:|---:|")
    for row in report["results"]:
        for name in names:
            result = row[name]
            ratio = result.get("cost_over_peer_cost")
            print(f"| {row['prompt_tokens']} | {name} | {result['ttft_with_s'] * 1000:.2f} / "
                  f"{result['ttft_without_s'] * 1000:.2f} | {result['cost_s'] * 1000:+.2f} | "
                  f"{'' if name == 'peer' else 'n/a' if ratio is None else f'{ratio:.2f}'} |")
    print()
    print(f"cost = median of {report['pairs']} paired differences (with - without) in one "
          f"engine; OpenMP binding: {report['omp_bind']}")
    print()
    groups = list(TIMED_HOOKS)
    print("Time inside the connector's calls per request, connector at work (median ms; on the "
          "engine's thread, not counting its background threads):")
    print("| prompt tokens | connector | total | " + " | ".join(groups)
          + " | of which copy | total less copy |")
    print("|---:|---|---:|" + "---:|" * (len(groups) + 2))
    for row in report["results"]:
        for name in names:
            hooks = row[name]["hook_s"]
            print(f"| {row['prompt_tokens']} | {name} | {hooks['total'] * 1000:.3f} | "
                  + " | ".join(f"{hooks[group] * 1000:.3f}" for group in groups)
                  + f" | {hooks.get(COPY, 0.0) * 1000:.3f}"
                  + f" | {hooks.get('total_less_copy', hooks['total']) * 1000:.3f} |")
    print()
    print("copy: kvo's staging copies of the layers whose buffer the step reuses (a part of "
          "per_layer; what sharing buffers costs on a CPU, where the copy runs on the "
          "forward's cores)")
    print()
    for name, met in report["at_or_below_peer"].items():
        print(f"{name}'s cost <= the peer's at every length: {'met' if met else 'MISSED'}")


def main(argv: list[str] | None = None) -> int:
    return run_in_netns("connector_cost", parse_args(argv), run, print_table)


if __name__ == "__main__":
    raise SystemExit(main())
