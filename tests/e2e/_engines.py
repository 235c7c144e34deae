"""Set-up shared by the e2e tests that run real vLLM engines in the test process.

What every such test file does the same way: the engines' environment, the tiny models' build,
an engine's common settings, greedy answers with their logprobs, shutdown, comparing answers,
the layerwise connector's transfer config and Mooncake master, corrupting what its loader
loads (fault injection from the test, not a hook in the worker), the skip for tests that start
Mooncake, and module-scoped fixtures made of these. Each file keeps its own model sizes,
prompts, engine limits and assertions. The files ``import _engines as e2e`` (pytest puts this
directory on ``sys.path``, as for ``_control_harness`` in kvo-transport's tests).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest

Answer = tuple[list[int], list[float]]
"""One greedy answer: its tokens and each token's logprob."""
Answers = list[Answer]
"""Per prompt: the greedy tokens and each token's logprob."""

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
              "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
"""Engines in this process (their counters and modules visible to the test), offline, on
loopback, with a small CPU KV cache. The nox session sets the last three itself."""

TP2_WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
"""One core for each of the two TP workers of a TP 2 engine."""

UNBOUND_PD_WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""Multi-process engines of a P/D pair (TP 2, DP 2) leave their workers unbound: with a TP 2
prefill and a decode each binding one worker per core of this 2-CPU host, the kernel left
runnable threads (the decode's workers, even an unrelated process) waiting on the run queue
for a whole layer deadline while the waiting engine cores spun in vLLM's message queue
(docs/testing.md)."""

NEEDS_NETNS = pytest.mark.skipif(
    os.environ.get("KVO_IN_NETNS") != "1",
    reason="starts Mooncake, which listens on every interface: run inside a loopback-only "
           "network namespace (unshare -n sh -c 'ip link set lo up; KVO_IN_NETNS=1 ...'; "
           "nox -s e2e does this)")
"""``pytestmark`` of a file whose tests start Mooncake."""

RUN_TP2_PREFILL_PD = os.environ.get("KVO_E2E_SKIP_TP2_PD") != "1"
"""Whether P/D runs with a TP 2 prefill start (default; ``KVO_E2E_SKIP_TP2_PD=1`` leaves them out
of a quick local run: they add about 8 minutes)."""
HEAVY_TP2_PD = pytest.mark.skipif(
    not RUN_TP2_PREFILL_PD,
    reason="P/D from a TP 2 prefill left out on request (KVO_E2E_SKIP_TP2_PD=1)")


@contextlib.contextmanager
def engine_environment(extra: Mapping[str, str] | None = None, *,
                       clear_sparse_config: bool = True) -> Iterator[None]:
    """Within: ``IN_PROCESS`` and ``extra``, each unless already set (by nox or by hand), and
    no ``KVO_SPARSE_CONFIG`` (the engines' own ``additional_config`` decides) unless told to
    keep it. Afterwards the variables this set are as before."""
    wanted = {**IN_PROCESS, **(extra or {})}
    saved = {name: os.environ.get(name) for name in wanted}
    for name, value in wanted.items():
        os.environ.setdefault(name, value)
    if clear_sparse_config:
        os.environ.pop("KVO_SPARSE_CONFIG", None)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def tiny_dsv32(tmp_path_factory: pytest.TempPathFactory, name: str, *, num_layers: int,
               index_topk: int, mtp: bool = False) -> Path:
    """A tiny random DeepSeek-V3.2-architecture model in a new temporary directory ``name``."""
    from kvo_tools.models.tiny_dsv32 import build_tiny_dsv32

    return build_tiny_dsv32(tmp_path_factory.mktemp(name), num_layers=num_layers,
                            index_topk=index_topk, mtp=mtp)


def engine_env_fixture(extra: Mapping[str, str] | None = None, *,
                       clear_sparse_config: bool = True) -> Any:
    """A module-scoped ``engine_env`` fixture: ``engine_environment`` around a test module
    (``engine_env = e2e.engine_env_fixture(...)`` in the module)."""

    @pytest.fixture(scope="module", name="engine_env")
    def engine_env() -> Iterator[None]:
        with engine_environment(extra, clear_sparse_config=clear_sparse_config):
            yield

    return engine_env


def dsv32_model_fixture(name: str, *, num_layers: int, index_topk: int) -> Any:
    """A module-scoped ``dsv32_model`` fixture: one ``tiny_dsv32`` for a test module."""

    @pytest.fixture(scope="module", name="dsv32_model")
    def dsv32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return tiny_dsv32(tmp_path_factory, name, num_layers=num_layers, index_topk=index_topk)

    return dsv32_model


def start_engine(model: Path, *, tp: int = 1, **settings: Any) -> Any:
    """A vLLM engine for a tiny test model: float32, eager, seed 0, vLLM's ``uni`` executor
    (TP > 1: its ``mp`` executor, one worker process per rank); ``settings`` add to or
    override these."""
    from vllm import LLM

    common: dict[str, Any] = dict(
        model=str(model), dtype="float32", enforce_eager=True,
        distributed_executor_backend="mp" if tp > 1 else "uni", seed=0)
    if tp != 1:
        common["tensor_parallel_size"] = tp
    return LLM(**{**common, **settings})


def greedy_answers(llm: Any, prompts: list[str], max_tokens: int | list[int]) -> Answers:
    """Greedy tokens (``ignore_eos``) and their logprobs, per prompt; ``max_tokens`` is one
    length for every prompt or one per prompt."""
    from vllm import SamplingParams

    def params(tokens: int) -> Any:
        return SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=0, ignore_eos=True)

    sampling = params(max_tokens) if isinstance(max_tokens, int) else [
        params(n) for n in max_tokens]
    answers = []
    for output in llm.generate(prompts, sampling, use_tqdm=False):
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        answers.append((tokens, [step[token].logprob for step, token in
                                 zip(completion.logprobs, tokens, strict=True)]))
    return answers


def stop_engine(llm: Any) -> None:
    """Shut the engine's core down and collect it now, before the next engine starts."""
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def logprob_distance(answers: Answers, want: Answers) -> float:
    """Infinite when any token differs, else the largest logprob difference."""
    worst = 0.0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(answers, want, strict=True):
        if tokens != want_tokens:
            return float("inf")
        worst = max([worst, *(abs(a - b) for a, b in zip(logprobs, want_logprobs,
                                                        strict=True))])
    return worst


def layerwise_transfer(master_address: str, *, shared_buffers: int, **settings: Any) -> Any:
    """vLLM's transfer config for kvo's ``LayerwiseStoreConnector`` on a Mooncake master: layer
    0 in its own buffer, the others round robin in ``shared_buffers``, one layer prefetched;
    ``settings`` are more ``KVTransferConfig`` fields."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="LayerwiseStoreConnector", kv_connector_module_path="kvo_vllm.connectors",
        kv_role="kv_both",
        kv_connector_extra_config={"store_master_address": master_address,
                                   "shared_buffers": shared_buffers,
                                   "independent_layers": [0], "prefetch_depth": 1},
        **settings)


def layerwise_worker_connector() -> Any:
    """The worker side's ``LayerwiseStoreConnector`` of the engine running in this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvo_vllm.layerwise import LayerwiseStoreConnector

    connector = get_kv_transfer_group()
    assert isinstance(connector, LayerwiseStoreConnector)
    return connector


@contextlib.contextmanager
def corrupting_loads(corrupt: Any) -> Iterator[None]:
    """Fault injection: after each layer's load in this process's layerwise worker, call
    ``corrupt(cache name, cache, loaded block ids)`` once per cache (main KV, DSA indexer)."""
    loader = layerwise_worker_connector().worker.registered.loader
    load = loader.load_layer

    def load_then_corrupt(buffer: Any) -> list[int]:
        failed = load(buffer)
        loaded = [ref.block_id for ref in loader.loads_of(buffer) if ref.block_id not in failed]
        for part in buffer.parts if loaded else ():
            corrupt(part.planned.cache_name, part.tensor, loaded)
        return failed

    loader.load_layer = load_then_corrupt  # the loader submits its own ``load_layer``
    try:
        yield
    finally:
        del loader.load_layer


def scheduler_connector(llm: Any) -> Any:
    """The scheduler side's connector of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def mooncake_master_fixture() -> Any:
    """A module-scoped ``master`` fixture: one real Mooncake master for a test module."""

    @pytest.fixture(scope="module", name="master")
    def master() -> Iterator[Any]:
        from kvo_transport.mooncake_master import MooncakeMaster

        with MooncakeMaster() as running:
            yield running

    return master


def master_metrics(master: Any) -> dict[str, float]:
    """A Mooncake master's Prometheus metrics, by name (with labels)."""
    url = f"http://127.0.0.1:{master.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def settled_master_metrics(master: Any) -> dict[str, float]:
    """The master's metrics once its key count and bytes stopped moving (finished requests'
    private keys are removed in the background), or after 20 s."""
    last = master_metrics(master)
    for _ in range(40):
        time.sleep(0.5)
        now = master_metrics(master)
        if all(now[k] == last[k] for k in ("master_key_count", "master_allocated_bytes")):
            return now
        last = now
    return last


def served_by_engine(url: str) -> dict[str, float]:
    """vLLM's finished requests per engine (DP rank: the ``engine`` label) of the API server
    at ``url``, from its ``/metrics``."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            engine = re.search(r'engine="(\d+)"', line)
            if engine:
                counts[engine.group(1)] = counts.get(engine.group(1), 0.0) + float(
                    line.rsplit(" ", 1)[1])
    return counts


@attrs.frozen
class KvoEngine:
    """A module's engine with kvo's connector, and its first answers (with an empty store and
    an empty prefix cache)."""

    llm: Any
    cold: Answers


DSA_POOL_PREFIX = "kvo-hostpool-dsa-"
"""The /dev/shm name prefix of the DSA offload backend's host pools."""


def dsa_pool_files() -> set[Path]:
    """The DSA offload host pools in /dev/shm now."""
    return set(Path("/dev/shm").glob(f"{DSA_POOL_PREFIX}*"))


def lock_holders(path: Path) -> set[int]:
    """PIDs holding a flock on ``path`` (every process using a pool holds a shared one)."""
    stat = path.stat()
    inode = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    return {int(f[4]) for f in map(str.split, Path("/proc/locks").read_text().splitlines())
            if len(f) > 5 and f[5] == inode}


@attrs.frozen
class PDDeployment:
    """A P/D deployment of API servers (prefill, decode, kvo proxy) for the DSA model."""

    decode: str
    proxy: str
    workdir: Path
    decode_tp: int = 1

    @property
    def decode_stats_file(self) -> Path:
        """Decode TP rank 0's RemoteD2H stats file."""
        return self.workdir / "decode-stats.json"

    def rank_stats_file(self, tp_rank: int) -> Path:
        """Decode TP rank ``tp_rank``'s stats file (``rank_stats_path``)."""
        from kvo_vllm.remote_d2h.stats_file import rank_stats_path

        return Path(str(rank_stats_path(str(self.decode_stats_file), tp_rank)))


DSA_MAIN_ROW_VALUES = 512 + 64
"""Values in one token's main-KV row of the DSA model (MLA latent + rope)."""
DSA_INDEXER_ROW_BYTES = 128 * 2
"""Bytes of one token's DSA indexer key (bf16, unless the engine runs the C8 indexer)."""


def complete(url: str, prompt: str, max_tokens: int, *, stream: bool = False,
             chat: bool = False) -> Any:
    """One greedy completion of ``prompt`` from the API server (or proxy) at ``url``
    (``kvo_tools.pd.client``'s ``Answer``: check ``ok`` before its tokens), 300 s at most."""
    from kvo_tools.pd.client import complete as post
    from kvo_tools.pd.client import completion_body

    return post(url, completion_body(prompt, max_tokens, stream=stream, chat=chat),
                timeout_s=300)


def answers_of(url: str, prompts: Mapping[str, str], max_tokens: int) -> dict[str, Answer]:
    """``complete`` each prompt by its tag, one at a time; every request must succeed."""
    answers = {}
    for tag, prompt in prompts.items():
        got = complete(url, prompt, max_tokens)
        assert got.ok, (tag, got.error)
        answers[tag] = (list(got.token_ids), list(got.logprobs))
    return answers


def own_and_pd_answers(deployment: PDDeployment, prompt: str,
                       max_tokens: int) -> tuple[Answer, Answer]:
    """The decode's own answer to ``prompt`` (it computes the prompt itself), then the P/D
    answer through the proxy (the decode pulls the prompt's KV from the prefill)."""
    own = answers_of(deployment.decode, {"own": prompt}, max_tokens)["own"]
    return own, answers_of(deployment.proxy, {"p/d": prompt}, max_tokens)["p/d"]


def part_bytes(stats: Mapping[str, Any], part: str) -> int:
    """Bytes a decode's RemoteD2H stats say were pulled for ``part`` ("kv", "idx") so far."""
    return int(stats.get("per_part", {}).get(part, {}).get("bytes", 0))


def pulled_bytes(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, int]:
    """Per part (main KV, indexer): the bytes pulled between two reads of a stats file."""
    return {part: part_bytes(after, part) - part_bytes(before, part) for part in ("kv", "idx")}


def ended_pulls(stats: Mapping[str, Any]) -> int:
    """Requests whose pull ended (received or failed) in a decode's stats so far."""
    return int(stats.get("received", 0)) + int(stats.get("failed", 0))


def remote_d2h_producer(kv_port: int, deadline_s: float) -> dict[str, Any]:
    """A prefill's transfer config: ``RemoteD2HConnector`` alone, announcing to the decode's
    control port ``kv_port``, ``deadline_s`` for each layer and for the handshake."""
    return {"kv_connector": "RemoteD2HConnector",
            "kv_connector_module_path": "kvo_vllm.remote_d2h", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"kv_port": kv_port, "layer_deadline_s": deadline_s,
                                          "handshake_timeout_s": deadline_s}}


def _tp_args(tp: int) -> list[str]:
    return [] if tp == 1 else ["--tensor-parallel-size", str(tp),
                               "--distributed-executor-backend", "mp"]


@contextlib.contextmanager
def pd_dsa_deployment(workdir: Path, *, num_layers: int, index_topk: int, block_size: int,
                      max_num_seqs: int, max_model_len: int, deadline_s: float,
                      prefill_tp: int = 1, decode_tp: int = 1,
                      extra_args: tuple[str, ...] = (),
                      decode_env: Mapping[str, str] | None = None,
                      decode_mode: str = "offload",
                      sparse: Mapping[str, Any] | None = None,
                      decode_kernel_backend: str | None = None,
                      speculative_tokens: int = 0) -> Iterator[PDDeployment]:
    """A tiny DSA model served P/D through the kvo proxy: a prefill (kvo's sparse backend,
    resident mode, ``RemoteD2HConnector`` alone) and a decode in kvo's ``decode_mode``
    (default offload: main KV in its host pool), each at its TP (``mp`` executor, workers
    unbound: ``UNBOUND_PD_WORKERS``), both stepping ``block_size`` tokens at a time;
    ``extra_args`` go to both servers, ``sparse`` (``kvo_sparse`` settings, e.g. the indexer
    dtype) to both too, ``decode_kernel_backend`` to the decode alone, ``decode_env`` to the
    decode (e.g. the tests' fault injection, ``kvo_tools.pd.sites.faulty_decode_env``);
    decode reads fail at once (no retries) and a failed pull is recomputed.
    ``speculative_tokens`` > 0: the model gets one MTP layer and both servers draft that many
    tokens with it (``speculative_config`` method ``mtp``)."""
    import json

    from kvo_tools.models.tiny_dsv32 import build_tiny_dsv32
    from kvo_tools.pd.cluster import Cluster, decode_transfer_config, free_port, wait_healthy

    model = build_tiny_dsv32(workdir / "model", num_layers=num_layers, index_topk=index_topk,
                             mtp=speculative_tokens > 0)
    decode_sparse = {**(sparse or {}), "mode": decode_mode}
    if decode_kernel_backend is not None:
        decode_sparse["kernel_backend"] = decode_kernel_backend
    if speculative_tokens > 0:
        extra_args = (*extra_args, "--speculative-config", json.dumps(
            {"method": "mtp", "num_speculative_tokens": speculative_tokens}))
    steps = ["--max-num-batched-tokens", str(block_size), "--max-num-seqs", str(max_num_seqs),
             "--no-enable-prefix-caching"]   # every prompt pulled, never a local hit
    with Cluster(workdir / "logs") as cluster:
        kv_port = free_port()
        decode = cluster.start_vllm(
            "decode" if decode_tp == 1 else f"decode-tp{decode_tp}", model, free_port(),
            decode_transfer_config(kv_port, workdir / "decode-stats.json",
                                   layer_deadline_s=deadline_s, read_retries=0),
            extra_args=[*steps, *extra_args, *_tp_args(decode_tp), "--additional-config",
                        json.dumps({"kvo_sparse": decode_sparse})],
            env={**(UNBOUND_PD_WORKERS if decode_tp > 1 else {}), **(decode_env or {})},
            max_model_len=max_model_len, block_size=block_size)
        prefill = cluster.start_vllm(
            "prefill" if prefill_tp == 1 else f"prefill-tp{prefill_tp}", model, free_port(),
            remote_d2h_producer(kv_port, deadline_s),
            extra_args=[*steps, *extra_args, *_tp_args(prefill_tp), *(
                ["--additional-config", json.dumps({"kvo_sparse": dict(sparse)})]
                if sparse else [])],
            env=UNBOUND_PD_WORKERS if prefill_tp > 1 else None, max_model_len=max_model_len,
            block_size=block_size)
        proxy = cluster.start_proxy(free_port(), prefill.url or "", decode.url or "")
        wait_healthy([decode, prefill, proxy], 900)
        yield PDDeployment(decode=decode.url or "", proxy=proxy.url or "", workdir=workdir,
                           decode_tp=decode_tp)
