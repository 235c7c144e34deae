"""End to end: the P/D flow with real vLLM API servers, real Mooncake and the kvo proxy.

The module starts (once, shared by every test) a Mooncake master, a plain vLLM (the
reference), a prefill vLLM with ``KvoMultiConnector`` (8 layers in 3 reused device buffers,
layers saved to the store and published to decode), a decode vLLM with ``RemoteD2HConnector``
whose transfer faults a test can switch on at run time, a second decode whose KV layout does
not match the prefill's, and one proxy per decode. The decode that is killed in the fault test
is the last one used.

Reference answers: the P/D decode starts from the prompt's KV pulled from the prefill and
computes only the prompt's tail -- what plain vLLM does with the prompt in its prefix cache --
so a P/D answer must equal plain vLLM's warm-cache answer bit for bit, and its tokens the
cold-cache answer's.

Mooncake listens on every interface, so this runs in a loopback-only network namespace:
``nox -s e2e`` does that; by hand::

    unshare -n sh -c 'ip link set lo up; KVO_IN_NETNS=1 HF_HUB_OFFLINE=1 \\
      VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=1 python -m pytest -q tests/e2e/test_pd.py'
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

NUM_LAYERS = 8
MAX_TOKENS = 8
DEADLINE_S = 15.0


def _prompt(tag: str, length: int) -> str:
    from kvo_tools.pd.prompts import DENSE_TEXT, tagged_prompt

    return tagged_prompt(tag, length, DENSE_TEXT)


@attrs.frozen
class Deployment:
    plain: str
    prefill: str
    decode: str
    proxy: str
    mismatch_proxy: str
    workdir: Path
    cluster: Any

    def stats(self, name: str) -> dict[str, Any]:
        from kvo_vllm.remote_d2h.stats_file import read_stats

        return read_stats(self.workdir / f"{name}-stats.json")

    def set_faults(self, **faults: Any) -> None:
        (self.workdir / "faults.json").write_text(json.dumps(faults))

    def managed(self, name: str) -> Any:
        return next(p for p in self.cluster.processes if p.name == name)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    from kvo_tools.models.tiny_llama import build_tiny_llama
    from kvo_tools.pd.cluster import (
        Cluster,
        decode_transfer_config,
        free_port,
        prefill_transfer_config,
        start_master,
        wait_healthy,
    )
    from kvo_tools.pd.sites import faulty_decode_env

    workdir = tmp_path_factory.mktemp("pd")
    model = build_tiny_llama(workdir / "model", num_layers=NUM_LAYERS)
    faults = workdir / "faults.json"
    faults.write_text("{}")
    master = start_master()
    try:
        with Cluster(workdir / "logs") as cluster:
            kv_port, mismatch_port = free_port(), free_port()
            plain = cluster.start_vllm("plain", model, free_port())
            prefill = cluster.start_vllm("prefill", model, free_port(), prefill_transfer_config(
                master.address, kv_port, workdir / "prefill-stats.json",
                layer_deadline_s=DEADLINE_S, handshake_timeout_s=DEADLINE_S))
            decode = cluster.start_vllm("decode", model, free_port(), decode_transfer_config(
                kv_port, workdir / "decode-stats.json", layer_deadline_s=DEADLINE_S,
                read_retries=0), env=faulty_decode_env(faults))
            # Twice the block size: a decode block is two prefill blocks' bytes.
            mismatch = cluster.start_vllm(
                "mismatch", model, free_port(),
                decode_transfer_config(mismatch_port, layer_deadline_s=DEADLINE_S),
                block_size=64)
            proxy = cluster.start_proxy(free_port(), prefill.url or "", decode.url or "")
            mismatch_proxy = cluster.start_proxy(free_port(), prefill.url or "",
                                                 mismatch.url or "", name="mismatch-proxy")
            wait_healthy([plain, prefill, decode, mismatch, proxy, mismatch_proxy], 900)
            yield Deployment(plain=plain.url or "", prefill=prefill.url or "",
                             decode=decode.url or "", proxy=proxy.url or "",
                             mismatch_proxy=mismatch_proxy.url or "", workdir=workdir,
                             cluster=cluster)
    finally:
        master.stop()


def _complete(url: str, prompt: str, stream: bool = False, chat: bool = False,
              max_tokens: int = MAX_TOKENS) -> Any:
    from kvo_tools.pd.client import complete, completion_body

    return complete(url, completion_body(prompt, max_tokens, stream=stream, chat=chat),
                    timeout_s=300)


def _eventually(probe: Any, timeout_s: float = 10.0) -> Any:
    """Poll ``probe()`` until it returns something true (the stats files lag a step)."""
    limit = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value or time.monotonic() > limit:
            return value
        time.sleep(0.25)


def _proxy_records(deployment: Deployment) -> list[dict[str, Any]]:
    with urllib.request.urlopen(deployment.proxy + "/kvo/v1/metadata", timeout=10) as reply:
        return list(json.loads(reply.read())["requests"])


def _reset_prefix_cache(url: str) -> None:
    request = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def _plain_answers(deployment: Deployment, prompt: str, **kwargs: Any) -> tuple[Any, Any]:
    """(cold, warm) answers of the plain vLLM for ``prompt``."""
    _reset_prefix_cache(deployment.plain)
    cold = _complete(deployment.plain, prompt, **kwargs)
    warm = _complete(deployment.plain, prompt, **kwargs)
    assert cold.ok and warm.ok, (cold.error, warm.error)
    assert cold.token_ids == warm.token_ids
    return cold, warm


def test_pd_answers_equal_plain_vllm(deployment: Deployment) -> None:
    cases = [("alpha", 45, True, False), ("bravo", 300, False, False),
             ("charlie", 520, True, True), ("delta", 1100, True, False)]
    received_before = deployment.stats("decode").get("decode", {}).get("received", 0)
    for tag, length, stream, chat in cases:
        prompt = _prompt(tag, length)
        cold, warm = _plain_answers(deployment, prompt, stream=stream, chat=chat)
        got = _complete(deployment.proxy, prompt, stream=stream, chat=chat)
        assert got.ok, got.error
        assert len(got.token_ids) == MAX_TOKENS
        assert got.token_ids == cold.token_ids, (tag, got.token_ids, cold.token_ids)
        assert got.token_ids == warm.token_ids and got.logprobs == warm.logprobs, tag
    time.sleep(1.0)
    decode = deployment.stats("decode")["decode"]
    prefill = deployment.stats("prefill")["remote"]["prefill"]
    # Every prompt longer than one block was pulled layer by layer, none failed.
    assert decode["received"] - received_before == len(cases)
    assert decode["failed"] == 0 and decode["refused_reads"] == 0
    # Prefill and decode share this host: the pulls copied directly (kvo_transport.samehost_engine).
    pulled = sum(layer["bytes"] for layer in decode["per_layer"].values())
    assert decode["same_host_bytes"] >= pulled > 0  # >=: fence reads go the same way
    assert set(decode["per_layer"]) == {str(i) for i in range(NUM_LAYERS)}
    assert prefill["sends_done"] >= len(cases) and prefill["in_flight_sends"] == 0
    # From the decode's second request on, the proxy posted prefill with decode at once.
    # (Decode's advertisement may reach the proxy after such a request ended: its ready_s is
    # then unset; the posts no longer wait for it.)
    records = [(r["concurrent"], r["outcome"]) for r in _proxy_records(deployment)[-len(cases):]]
    assert all(outcome == "ok" for _, outcome in records), records
    assert all(concurrent for concurrent, _ in records[1:]), records
    # A prompt decode holds whole in its prefix cache: decode declines the pull, computes the
    # rest itself, and the prefill's READYs are answered with nothing read (not failures).
    prompt = _prompt("delta", 1100)
    _, warm = _plain_answers(deployment, prompt)
    again = _complete(deployment.proxy, prompt)
    assert again.ok, again.error
    assert again.token_ids == warm.token_ids and again.logprobs == warm.logprobs
    time.sleep(1.0)
    after = deployment.stats("prefill")["remote"]["prefill"]
    assert after["sends_failed"] == prefill["sends_failed"]
    assert after["in_flight_sends"] == 0 and after["in_flight_reads"] == 0
    assert deployment.stats("decode")["decode"]["failed"] == 0


def test_buffer_reuse_is_active_on_prefill(deployment: Deployment) -> None:
    stats = deployment.stats("prefill")
    layout = stats["layout"]
    assert layout["num_layers"] == NUM_LAYERS
    assert layout["physical_buffers"] == 3 < NUM_LAYERS
    assert layout["physical_bytes"] * NUM_LAYERS == layout["logical_bytes"] * 3
    # The live KV tensors vLLM handed the connector: three storages, shared round robin.
    bases = stats["remote"]["prefill"]["layer_bases"]
    by_pointer: dict[int, list[int]] = {}
    for index, pointer in bases.items():
        by_pointer.setdefault(pointer, []).append(int(index))
    assert sorted(sorted(v) for v in by_pointer.values()) == [[0], [1, 3, 5, 7], [2, 4, 6]]


def test_prefix_hit_loads_through_the_store(deployment: Deployment) -> None:
    prompt = _prompt("echo", 700)
    first = _complete(deployment.proxy, prompt)
    assert first.ok, first.error
    time.sleep(1.0)
    before = deployment.stats("prefill")["layerwise"]
    layer0_before = int(before["loaded_blocks_by_layer"].get("0", 0))
    # Forget the prompt on both engines' devices: the prefill must take it from the store.
    _reset_prefix_cache(deployment.prefill)
    _reset_prefix_cache(deployment.decode)
    _, warm = _plain_answers(deployment, prompt)
    again = _complete(deployment.proxy, prompt)
    assert again.ok, again.error
    assert again.token_ids == warm.token_ids and again.logprobs == warm.logprobs
    time.sleep(1.0)
    after = deployment.stats("prefill")["layerwise"]
    # Layer 0 owns its buffer: it loads only blocks the scheduler took from the store.
    assert int(after["loaded_blocks_by_layer"].get("0", 0)) - layer0_before >= 700 // 32 - 1
    assert after["failed_loads"] == before["failed_loads"]


def test_corrupted_transfer_changes_the_output(deployment: Deployment) -> None:
    prompt = _prompt("foxtrot", 600)
    _, warm = _plain_answers(deployment, prompt)
    _reset_prefix_cache(deployment.decode)
    deployment.set_faults(corrupt_reads=True)
    try:
        damaged = _complete(deployment.proxy, prompt)
    finally:
        deployment.set_faults()
    assert damaged.ok, damaged.error
    assert deployment.stats("decode")["decode"]["engine_wrapper"]["corrupted_bytes"] > 0
    assert damaged.token_ids != warm.token_ids
    # The fault was in the transfer only: the next pull is right again.
    _reset_prefix_cache(deployment.decode)
    healed = _complete(deployment.proxy, prompt)
    assert healed.token_ids == warm.token_ids and healed.logprobs == warm.logprobs


def test_failed_pull_is_recomputed_not_garbage(deployment: Deployment) -> None:
    prompt = _prompt("golf", 640)
    cold, _ = _plain_answers(deployment, prompt)
    _reset_prefix_cache(deployment.decode)
    before = deployment.stats("decode")["decode"]
    deployment.set_faults(fail_reads=1)
    try:
        got = _complete(deployment.proxy, prompt)
    finally:
        deployment.set_faults()
    time.sleep(1.0)
    after = deployment.stats("decode")["decode"]
    assert after["engine_wrapper"]["injected_failures"] > \
        before["engine_wrapper"].get("injected_failures", 0)
    assert after["failed"] == before["failed"] + 1
    assert after["invalid_blocks_reported"] > before["invalid_blocks_reported"]
    # vLLM's load-failure path recomputed the whole prompt on decode: the cold answer.
    assert got.ok, got.error
    assert got.token_ids == cold.token_ids and got.logprobs == cold.logprobs


def test_layout_mismatch_is_refused_at_the_handshake(deployment: Deployment) -> None:
    started = time.monotonic()
    got = _complete(deployment.mismatch_proxy, _prompt("hotel", 200))
    assert time.monotonic() - started < DEADLINE_S  # refused at once, not at a deadline
    assert got.status == 502, (got.status, got.error)
    assert "rejected the handshake" in (got.error or "")
    assert "block" in (got.error or "")
    assert _eventually(lambda: deployment.stats("prefill")["remote"]["prefill"][
        "handshake_failures"] >= 1)
    # The prefill is fine and keeps serving the matching decode.
    again = _complete(deployment.proxy, _prompt("india", 200))
    assert again.ok, again.error


def _scrape(url: str, name: str) -> float:
    """The sum over every label set of one series on a vLLM server's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    return sum(values)


def test_metrics_endpoint_counts_what_happened(deployment: Deployment) -> None:
    """kvo's series on vLLM's own /metrics equal the connectors' accounting (the stats files
    the demo reports from): bytes pulled by decode, layers saved and READYs sent by prefill."""
    answer = _complete(deployment.proxy, _prompt("metrics", 260))
    assert answer.ok, answer.error

    seen: list[tuple[tuple[float, float], ...]] = []

    def agree() -> tuple[tuple[float, float], ...] | None:
        decode = deployment.stats("decode")["decode"]
        prefill = deployment.stats("prefill")
        pairs = (
            (_scrape(deployment.decode, "vllm:kvo_remote_d2h_pulled_bytes_total"),
             sum(layer["bytes"] for layer in decode["per_layer"].values())),
            (_scrape(deployment.decode, "vllm:kvo_remote_d2h_requests_received_total"),
             decode["received"]),
            (_scrape(deployment.prefill, "vllm:kvo_layerwise_saved_bytes_total"),
             prefill["layerwise"]["saved_bytes"]),
            (_scrape(deployment.prefill, "vllm:kvo_remote_d2h_readys_published_total"),
             prefill["remote"]["prefill"]["published_layers"]),
        )
        seen[:] = [pairs]
        return pairs if all(got == want > 0 for got, want in pairs) else None

    # (metrics, stats file) for: decode pulled bytes, decode requests received, prefill
    # layerwise saved bytes, prefill READYs published
    assert _eventually(agree, timeout_s=30), seen


def test_decode_killed_mid_request_prefill_recovers(deployment: Deployment) -> None:
    """Kill decode once it holds the destination; prefill's reads expire, buffers come back."""
    before = deployment.stats("prefill")["remote"]["prefill"]
    seen = len(_proxy_records(deployment))
    outcome: dict[str, Any] = {}

    def run() -> None:
        outcome["answer"] = _complete(deployment.proxy, _prompt("juliett", 3000), stream=True)

    # Decode stalls every read, so the kill lands while prefill still waits for acknowledgements.
    deployment.set_faults(stall_reads_s=DEADLINE_S * 4)
    client = threading.Thread(target=run)
    client.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        records = _proxy_records(deployment)
        if len(records) > seen and records[seen]["ready_s"] is not None:
            break
        time.sleep(0.05)
    else:
        deployment.set_faults()
        pytest.fail("decode never advertised the request's destination")
    # Kill only once the prefill is publishing this request's layers to decode (mid-transfer);
    # killing earlier lets the proxy cancel the prefill before it sends anything.
    while time.monotonic() < deadline:
        now = deployment.stats("prefill")["remote"]["prefill"]
        if now["published_layers"] > before["published_layers"]:
            break
        time.sleep(0.02)
    else:
        deployment.set_faults()
        pytest.fail("prefill never published a layer of the request")
    deployment.managed("decode").kill()
    deployment.set_faults()
    client.join(timeout=DEADLINE_S * 4)
    assert not client.is_alive(), "the client hung after decode died"
    assert not outcome["answer"].ok  # an error, not a truncated or made-up answer
    # Every READY to the dead decode expires by its deadline; the request's blocks return.
    limit = time.monotonic() + DEADLINE_S * 3
    while time.monotonic() < limit:
        prefill = deployment.stats("prefill")["remote"]["prefill"]
        if prefill["in_flight_sends"] == 0 and prefill["in_flight_reads"] == 0 \
                and prefill["sends_failed"] > before["sends_failed"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"prefill still holds sends/reads after the deadline: {prefill}")
    # The prefill engine is not stuck: it answers (as a plain engine) right away.
    plain = _complete(deployment.prefill, _prompt("kilo", 100))
    reference = _complete(deployment.plain, _prompt("kilo", 100))
    assert plain.ok and plain.token_ids == reference.token_ids
