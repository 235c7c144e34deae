"""kvo-vllm's decode worker (``DecodePuller``) against a prefill that reuses its memory.

Real Mooncake engines and real ZMQ on loopback; the decode worker owns real CPU tensors as its KV
cache (vLLM's engine is not needed to show what the worker reports to it). The prefill side is
kvo-transport's publisher over its own tensors; when it reports a request failed it hands the
request's blocks to a new occupant, as vLLM's free list would. Both stale-read shapes end with
the request reported to vLLM with its blocks on the load-failure path (so vLLM recomputes), never
received with reused bytes; revoking a request whose read is stalled returns at once and its
blocks come back only after the read ended.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvo_core.config import RemoteD2HConfig
from kvo_core.gates import RequestCompletionTracker, SlotGates
from kvo_transport.address_spans import AddressSpans
from kvo_transport.control import LayerMeta, PrefillPublisher, TensorGroup
from kvo_transport.engine import DelegatingEngine, TransferEngine, create_transfer_engine
from kvo_vllm.remote_d2h.decode_worker import DecodePuller
from kvo_vllm.remote_d2h.guarded_engine import LayerRegion
from kvo_vllm.remote_d2h.metadata import IDLE_WAIT_S, RecvTarget, RemoteD2HMetadata

pytestmark = pytest.mark.skipif(
    os.environ.get("KVO_IN_NETNS") != "1",
    reason="starts Mooncake, which listens on every interface: run inside a loopback-only "
           "network namespace (nox -s vllm does this)")

LAYERS = 4
BLOCKS = 8
BLOCK_SHAPE = (2, 16, 8)  # heads, block size, 2 * head size: 1 KiB of float32 per block
SRC_BLOCKS = (0, 1, 2)
DST_BLOCKS = (5, 3, 6)
WAIT = 20.0


def layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def prefill_engine() -> Iterator[TransferEngine]:
    engine = create_transfer_engine("mooncake")
    yield engine
    engine.close()


class Prefill:
    """Source tensors and a publisher: layer i's KV content is a function of (request, i)."""

    def __init__(self, engine: TransferEngine, deadline_s: float) -> None:
        self.engine = engine
        self.kv = {layer(i): torch.zeros(BLOCKS, *BLOCK_SHAPE) for i in range(LAYERS)}
        for tensor in self.kv.values():
            engine.register(tensor.data_ptr(), tensor.numel() * 4)
        block_bytes = self.kv[layer(0)][0].numel() * 4
        metas = [LayerMeta(index=i, name=layer(i), main=TensorGroup(
            base_addrs=(self.kv[layer(i)].data_ptr(),), block_bytes=(block_bytes,),
            num_blocks=BLOCKS)) for i in range(LAYERS)]
        self.gates, self.tracker = SlotGates(), RequestCompletionTracker()
        self.publisher = PrefillPublisher.for_engine(
            engine, instance_id="prefill-fence", prefill_tp=1, p_rank=0, decode_tp=1,
            layers=metas, gates=self.gates, tracker=self.tracker, layer_deadline_s=deadline_s)

    def fill(self, occupant: int) -> None:
        for i, tensor in enumerate(self.kv.values()):
            for block in SRC_BLOCKS:
                tensor[block] = float(1000 * occupant + 10 * i + block)

    def publish(self, endpoint: str, transfer_id: str) -> None:
        request = self.publisher.ready_request(transfer_id, 0, SRC_BLOCKS)
        for i in range(LAYERS):
            self.publisher.publish_layer(i, (i + 1,), {endpoint: [request]},
                                         last_layer_request_ids=(transfer_id,)
                                         if i == LAYERS - 1 else ())

    def reuse_blocks_once_failed(self, transfer_id: str) -> bool:
        """Poll the publisher; once the request is reported failed, a new occupant writes
        its blocks (vLLM's free list would hand them out). True when that happened."""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            done, failed = self.tracker.pop_finished()
            if transfer_id in failed:
                self.fill(occupant=2)
                return True
            if transfer_id in done:
                return False
            time.sleep(0.005)
        raise AssertionError(f"the prefill never settled {transfer_id}")

    def close(self) -> None:
        self.publisher.close()
        for tensor in self.kv.values():
            self.engine.unregister(tensor.data_ptr())


class SlowEngine(DelegatingEngine):
    """Test-only ``engine_wrapper``: every read into the KV layers first sleeps ``stall_s``
    (a decode that is slow, not dead); other reads (the fence words) are not delayed."""

    def __init__(self, engine: TransferEngine, layers: Sequence[LayerRegion],
                 stall_s: float) -> None:
        super().__init__(engine)
        self._stall_s = stall_s
        self._layers = AddressSpans((layer.base, layer.end, layer.index) for layer in layers)
        self._lock = threading.Lock()
        self.data_read_started = threading.Event()
        self.data_reads_in_flight = 0
        self.data_reads_ended = 0

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        if self._layers.find(local_addrs[0]) is None:
            self._engine.read(peer, local_addrs, remote_addrs, lengths)
            return
        with self._lock:
            self.data_reads_in_flight += 1
        self.data_read_started.set()
        try:
            time.sleep(self._stall_s)
            self._engine.read(peer, local_addrs, remote_addrs, lengths)
        finally:
            with self._lock:
                self.data_reads_in_flight -= 1
                self.data_reads_ended += 1


def make_puller(stall_s: float, engines: list[SlowEngine] | None = None
                ) -> tuple[DecodePuller, dict[str, torch.Tensor]]:
    """A decode worker reading through a SlowEngine (appended to ``engines`` when given)."""
    config = RemoteD2HConfig(kv_port=free_port(), layer_deadline_s=30.0,
                             handshake_timeout_s=30.0, read_retries=0)

    def wrapper(engine: TransferEngine, layers: Sequence[LayerRegion]) -> TransferEngine:
        slow = SlowEngine(engine, layers, stall_s)
        if engines is not None:
            engines.append(slow)
        return slow

    puller = DecodePuller(config=config, tp_rank=0, tp_size=1, dp_rank=0,
                          engine_wrapper=wrapper)
    kv = {layer(i): torch.full((BLOCKS, *BLOCK_SHAPE), -1.0) for i in range(LAYERS)}
    puller.register_kv_caches(kv)
    return puller, kv


def register(puller: DecodePuller, transfer_id: str) -> None:
    puller.start_step(RemoteD2HMetadata(recvs=(RecvTarget(
        request_id=f"req-{transfer_id}", transfer_id=transfer_id, block_ids=DST_BLOCKS,
        skip_blocks=0),)))


def collect_until(puller: DecodePuller, request_id: str) -> tuple[set[str], set[int]]:
    """What the worker reports to vLLM, once it reports ``request_id``."""
    invalid: set[int] = set()
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        done, bad = puller.collect()
        invalid |= bad
        if request_id in done:
            return done, invalid
        time.sleep(0.01)
    raise AssertionError(f"the decode worker never reported {request_id}")


def run_shape(prefill_engine: TransferEngine, *, stall_s: float, deadline_s: float
              ) -> tuple[set[int], dict[str, object]]:
    """(blocks reported to vLLM's load-failure path, the worker's counters)."""
    prefill = Prefill(prefill_engine, deadline_s)
    puller, _ = make_puller(stall_s)
    try:
        register(puller, "t1")
        prefill.fill(occupant=1)
        prefill.publish(puller.endpoint, "t1")
        assert prefill.reuse_blocks_once_failed("t1"), "the prefill's deadline never fired"
        _, invalid = collect_until(puller, "req-t1")
        return invalid, puller.snapshot()
    finally:
        prefill.close()
        puller.close()


def received_correctly(kv: dict[str, torch.Tensor]) -> bool:
    return all(bool((kv[layer(i)][dst] == float(1000 + 10 * i + src)).all())
               for i in range(LAYERS) for src, dst in zip(SRC_BLOCKS, DST_BLOCKS, strict=True))


def test_a_read_stalled_past_the_deadline_goes_to_the_load_failure_path(
        prefill_engine: TransferEngine) -> None:
    # Every read stalls 1.5 s; the prefill's deadline is 0.5 s, then the blocks are reused.
    invalid, stats = run_shape(prefill_engine, stall_s=1.5, deadline_s=0.5)
    assert set(DST_BLOCKS) <= invalid  # vLLM recomputes them (or fails the request)
    assert stats["stale_reads"] >= 1 and stats["received"] == 0


def test_slow_but_progressing_reads_go_to_the_load_failure_path(
        prefill_engine: TransferEngine) -> None:
    # Each read takes 0.4 s, the deadline is 1.0 s: layers 0-1 arrive in time, layer 2 is
    # read while the blocks already have their new occupant.
    invalid, stats = run_shape(prefill_engine, stall_s=0.4, deadline_s=1.0)
    assert set(DST_BLOCKS) <= invalid
    assert stats["stale_reads"] >= 1 and stats["received"] == 0


def test_unhurried_pull_is_received_intact(prefill_engine: TransferEngine) -> None:
    prefill = Prefill(prefill_engine, deadline_s=10.0)
    puller, kv = make_puller(0.0)
    try:
        register(puller, "t2")
        prefill.fill(occupant=1)
        prefill.publish(puller.endpoint, "t2")
        _, invalid = collect_until(puller, "req-t2")
        assert invalid == set() and received_correctly(kv)
    finally:
        prefill.close()
        puller.close()


def test_an_idle_step_sleeps_for_the_pull_instead_of_polling(
        prefill_engine: TransferEngine) -> None:
    """A step with nothing to compute waits in ``collect`` (up to IDLE_WAIT_S) for a pull to
    end instead of returning at once: vLLM would step again after 1 ms, each empty step
    costing CPU time the prefill needs on a shared host. Polled back to back during the
    4 x 0.1 s of reads, the worker now answers at most once per wait (without the wait: as
    often as the loop can call it), and the pull still arrives intact."""
    prefill = Prefill(prefill_engine, deadline_s=10.0)
    puller, kv = make_puller(0.1)
    try:
        register(puller, "t5")
        prefill.fill(occupant=1)
        prefill.publish(puller.endpoint, "t5")
        started, calls, done = time.monotonic(), 0, set()
        while "req-t5" not in done and time.monotonic() - started < WAIT:
            puller.start_step(RemoteD2HMetadata(idle=True))
            done, invalid = puller.collect()
            calls += 1
        elapsed = time.monotonic() - started
        assert "req-t5" in done and invalid == set() and received_correctly(kv)
        assert calls <= elapsed / IDLE_WAIT_S + 2
    finally:
        prefill.close()
        puller.close()


def test_an_idle_prefill_step_sleeps_for_the_reads_instead_of_polling() -> None:
    """kvo-vllm's prefill worker, its request's layers published and the decode reading them
    slowly (4 x 0.1 s): each step with nothing to compute waits in ``finished_sending`` (up to
    IDLE_WAIT_S) for a send to end instead of returning at once. Polled back to back, the
    worker answers at most once per wait (without the wait: as often as the loop can call it;
    a TP 2 prefill doing that starved a decode on the same 2-CPU host of CPU time), and the
    request is reported once its reads are done."""
    from kvo_vllm.remote_d2h.metadata import SendChunk
    from kvo_vllm.remote_d2h.prefill_worker import PrefillSender

    sender = PrefillSender(config=RemoteD2HConfig(kv_port=free_port(), layer_deadline_s=30.0,
                                                  handshake_timeout_s=30.0),
                           tp_rank=0, tp_size=1, instance_id="prefill-idle")
    puller, _ = make_puller(0.1)
    try:
        sender.register_kv_caches({layer(i): torch.ones(BLOCKS, *BLOCK_SHAPE)
                                   for i in range(LAYERS)})
        register(puller, "t10")
        sender.start_step(RemoteD2HMetadata(sends=(SendChunk(
            request_id="req-t10", transfer_id="t10", decode_endpoints=(puller.endpoint,),
            start_block=0, block_ids=SRC_BLOCKS, last=True),)))
        for i in range(LAYERS):
            sender.publish_layer(layer(i))
        done = sender.finished_sending({"req-t10"})
        started, calls = time.monotonic(), 0
        while "req-t10" not in done and time.monotonic() - started < WAIT:
            sender.start_step(RemoteD2HMetadata(idle=True))
            done = sender.finished_sending(set())
            calls += 1
        elapsed = time.monotonic() - started
        assert "req-t10" in done and sender.stats.sends_done == 1, sender.stats
        assert elapsed >= 0.3  # the reads took their time: the loop really polled meanwhile
        assert calls <= elapsed / IDLE_WAIT_S + 2, (calls, elapsed)
    finally:
        sender.close()
        puller.close()


def test_revoking_a_stalled_pull_never_blocks_and_returns_blocks_after_the_read(
        prefill_engine: TransferEngine) -> None:
    """Checked by events, not clocks: the read stalls 5 s inside the engine call; the step that
    revokes the request returns while that read is still in flight (it did not wait behind it),
    and the request's blocks are reported back only after the read ended."""
    prefill = Prefill(prefill_engine, deadline_s=30.0)
    engines: list[SlowEngine] = []
    puller, _ = make_puller(5.0, engines)
    try:
        register(puller, "t3")
        prefill.fill(occupant=1)
        prefill.publish(puller.endpoint, "t3")
        assert engines and engines[0].data_read_started.wait(WAIT)  # a read is now stalled
        slow = engines[0]
        puller.start_step(RemoteD2HMetadata(revoked_recvs=("req-t3",)))  # vLLM's abort
        done, _ = puller.collect()
        assert slow.data_reads_in_flight >= 1  # the step thread did not wait for the read
        assert "req-t3" not in done  # a read may still write the blocks: not handed back
        done, _ = collect_until(puller, "req-t3")
        assert slow.data_reads_ended >= 1 and slow.data_reads_in_flight == 0  # ... until it ended
    finally:
        prefill.close()
        puller.close()


def test_an_abort_crossing_the_report_is_not_answered_twice(
        prefill_engine: TransferEngine) -> None:
    """vLLM aborted the request before it processed the output that reported its pull (async
    scheduling): the revoke finds nothing to stop and must not report the request again (vLLM's
    scheduler asserts on a report for a request it already freed). A revoke of a request the
    worker never saw is still answered once."""
    prefill = Prefill(prefill_engine, deadline_s=10.0)
    puller, _ = make_puller(0.0)
    try:
        register(puller, "t4")
        prefill.fill(occupant=1)
        prefill.publish(puller.endpoint, "t4")
        collect_until(puller, "req-t4")
        puller.start_step(RemoteD2HMetadata(revoked_recvs=("req-t4", "req-never-seen")))
        reports: list[str] = []
        for _ in range(5):
            done, _ = puller.collect()
            reports += sorted(done)
            time.sleep(0.02)
        assert reports == ["req-never-seen"]
    finally:
        prefill.close()
        puller.close()


def test_a_request_the_prefill_gives_up_goes_to_the_load_failure_path_at_once(
        prefill_engine: TransferEngine) -> None:
    """The prefill publishes two of four layers, then gives the request up (its store load
    failed) and says so (SEND_ABORTED): the worker reports it to vLLM's load-failure path
    now, with its 30 s layer deadline far away. A second request is given up before decode
    registered its blocks: it fails the moment they are registered, never advertised."""
    prefill = Prefill(prefill_engine, deadline_s=10.0)
    puller, _ = make_puller(0.0)
    try:
        register(puller, "t7")
        prefill.fill(occupant=1)
        request = prefill.publisher.ready_request("t7", 0, SRC_BLOCKS)
        for i in range(2):
            prefill.publisher.publish_layer(i, (i + 1,), {puller.endpoint: [request]})
        assert prefill.publisher.abort(puller.endpoint, ["t7", "t8"], "store load failed")
        started = time.monotonic()
        _, invalid = collect_until(puller, "req-t7")
        assert time.monotonic() - started < 10.0  # well before the worker's own deadline
        assert set(DST_BLOCKS) <= invalid
        stats = puller.snapshot()
        assert stats["aborted_by_prefill"] == 2
        assert stats["received"] == 0 and stats["failed"] == 1
        register(puller, "t8")  # its blocks arrive after the abort did
        _, invalid = collect_until(puller, "req-t8")
        assert set(DST_BLOCKS) <= invalid
        assert puller.snapshot()["failed"] == 2
    finally:
        prefill.close()
        puller.close()


def test_the_prefill_workers_give_up_reaches_the_decode_worker() -> None:
    """kvo-vllm's own prefill worker: a request it gives up after publishing layer 0 (as
    KvoMultiConnector does when a layerwise store load failed) is failed by the decode worker
    at once, its blocks on vLLM's load-failure path."""
    from kvo_vllm.remote_d2h.metadata import SendChunk
    from kvo_vllm.remote_d2h.prefill_worker import PrefillSender

    sender = PrefillSender(config=RemoteD2HConfig(kv_port=free_port(), layer_deadline_s=30.0,
                                                  handshake_timeout_s=30.0),
                           tp_rank=0, tp_size=1, instance_id="prefill-give-up")
    puller, _ = make_puller(0.0)
    try:
        source = {layer(i): torch.ones(BLOCKS, *BLOCK_SHAPE) for i in range(LAYERS)}
        sender.register_kv_caches(source)
        register(puller, "t9")
        sender.start_step(RemoteD2HMetadata(sends=(SendChunk(
            request_id="req-t9", transfer_id="t9", decode_endpoints=(puller.endpoint,),
            start_block=0, block_ids=SRC_BLOCKS, last=True),)))
        sender.publish_layer(layer(0))
        sender.give_up_requests({"req-t9"}, "layerwise load of layer 1 failed")
        started = time.monotonic()
        _, invalid = collect_until(puller, "req-t9")
        assert time.monotonic() - started < 10.0  # well before the 30 s layer deadline
        assert set(DST_BLOCKS) <= invalid
        assert puller.snapshot()["aborted_by_prefill"] == 1
    finally:
        sender.close()
        puller.close()
