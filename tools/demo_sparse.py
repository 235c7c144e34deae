"""kvo's sparse decode offload inside vLLM (CPU), checked against the resident run.

A tiny random DeepSeek-V3.2-architecture model (MLA latent 512 + rope 64, lightning indexer,
top-k sparse attention; built locally, no downloads) is served twice by vLLM's own
``DeepseekV32ForCausalLM`` with kvo's sparse MLA backend, one engine after the other in this
process: ``mode=resident`` (main KV in vLLM's paged device cache) and ``mode=offload`` (main
KV in a kvo host pool addressed by vLLM's block ids; the device keeps the indexer cache and
per-layer hot buffers; each decode step copies only the selected rows that are not resident).
The same prompts of mixed lengths, greedy: every offload answer must have exactly the
resident answer's tokens and logprobs. Printed: device KV with and without offload, the hot
buffers, the host pool, hit rate, bytes moved host -> device against reloading the history.

Run by ``nox -s demo`` after the P/D demo, or ``python tools/demo_sparse.py`` (exit 0: equal
answers; 1: a difference).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

NUM_LAYERS = 2
INDEX_TOPK = 32
MAX_TOKENS = 16
TEXT = ("Decode keeps the full KV history in host memory and copies to the device only the rows "
        "that sparse attention selects and that are not already resident. ")
PROMPT_TOKENS = (60, 250, 700, 1500)

Answer = tuple[list[int], list[float]]


def _engine(model: Path, mode: str, blocks: int | None = None) -> Any:
    from vllm import LLM

    return LLM(model=str(model), dtype="float32", enforce_eager=True,
               distributed_executor_backend="uni", max_model_len=2048, max_num_seqs=4,
               max_num_batched_tokens=512, seed=0, num_gpu_blocks_override=blocks,
               additional_config={"kvo_sparse": {"mode": mode}})


def _generate(llm: Any, prompts: list[str]) -> list[Answer]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0,
                            ignore_eos=True)
    answers = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        answers.append((tokens, [step[t].logprob for step, t in
                                 zip(completion.logprobs, tokens, strict=True)]))
    return answers


def _device_kv_bytes(llm: Any) -> dict[str, int]:
    """Bytes vLLM bound to the main-KV (MLA) layers and to the indexer caches."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    main = sum(m.kv_cache.numel() * m.kv_cache.element_size()
               for m in model.modules() if isinstance(m, MLAAttention))
    indexer = 0
    for name, module in model.named_modules():
        if name.endswith("indexer.k_cache"):
            caches = module.kv_cache if isinstance(module.kv_cache, list) else [module.kv_cache]
            indexer += sum(c.numel() * c.element_size() for c in caches)
    return {"main": main, "indexer": indexer}


def _stop(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def _mib(n: float) -> str:
    return f"{n / 2**20:9.2f} MiB"


def run(workdir: Path) -> int:
    from models.tiny_dsv32 import build_tiny_dsv32

    model = build_tiny_dsv32(workdir / "tiny-dsv32", num_layers=NUM_LAYERS,
                             index_topk=INDEX_TOPK)
    prompts = [(TEXT * (n // len(TEXT) + 1))[:n] for n in PROMPT_TOKENS]
    print(f"[sparse] tiny DeepSeek-V3.2-architecture model ({NUM_LAYERS} layers, top-k "
          f"{INDEX_TOPK}); prompts of {', '.join(map(str, PROMPT_TOKENS))} tokens, "
          f"{MAX_TOKENS} greedy tokens each", flush=True)

    from kvo_vllm.dsa.offload_main_kv import offload_workers

    # Offload first: it sizes vLLM's block count to its host pool; the resident engine then
    # gets the same number of blocks, so both hold the same tokens.
    llm = _engine(model, "offload")
    offload = _generate(llm, prompts)
    offload_kv = _device_kv_bytes(llm)
    worker = next(w for w in offload_workers() if w.manager is not None
                  and w.stats.totals.calls > 0)
    totals, manager = worker.stats.totals, worker.manager
    hot, pool, blocks = manager.hot_buffer_bytes, manager.pool_region[1], manager.num_blocks
    _stop(llm)
    del llm

    llm = _engine(model, "resident", blocks=blocks)
    resident = _generate(llm, prompts)
    resident_kv = _device_kv_bytes(llm)
    _stop(llm)

    print("\n============ kvo sparse decode offload (in vLLM) ============")
    print(f"vLLM KV blocks      : {blocks} in both engines ({manager.block_size} tokens each)")
    print(f"device KV, resident : main {_mib(resident_kv['main'])} + indexer "
          f"{_mib(resident_kv['indexer'])}")
    offload_device = offload_kv["main"] + hot + offload_kv["indexer"]
    print(f"device KV, offload  : hot buffers {_mib(hot)} + placeholder "
          f"{_mib(offload_kv['main'])} + indexer {_mib(offload_kv['indexer'])}"
          f"  (ratio {offload_device / (resident_kv['main'] + resident_kv['indexer']):.3f})")
    print(f"host pool           : {_mib(pool)} (main KV of every block vLLM can hand out)")
    print(f"decode selections   : {totals.selected} rows selected over {totals.steps} steps, "
          f"hit rate {totals.hit_rate:.3f}, {totals.misses} misses")
    print(f"host -> device      : {_mib(totals.h2d_bytes)} copied vs "
          f"{_mib(totals.full_reload_bytes)} for reloading the decode rows' history ("
          f"{totals.h2d_bytes / max(1, totals.full_reload_bytes):.1%})")
    print("==============================================================")
    differences = [i for i, (a, b) in enumerate(zip(resident, offload, strict=True)) if a != b]
    if differences:
        for i in differences:
            print(f"FAILED: prompt {i} ({PROMPT_TOKENS[i]} tokens): offload {offload[i][0]} vs "
                  f"resident {resident[i][0]}", file=sys.stderr)
        return 1
    print(f"OK: all {len(prompts)} offload answers have exactly the resident answers' tokens and "
          f"logprobs.")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where the model is built")
    args = parser.parse_args(argv)
    for name, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("HF_HUB_OFFLINE", "1"),
                        ("VLLM_HOST_IP", "127.0.0.1"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
        os.environ.setdefault(name, value)
    os.environ.pop("KVO_SPARSE_CONFIG", None)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvo-demo-sparse-"))
    return run(workdir)


if __name__ == "__main__":
    sys.exit(main())
