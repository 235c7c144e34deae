"""kvo-vllm's RemoteD2H workers on DSA layouts: prefill's ``PrefillSender`` hands a request's
MLA and indexer blocks to decode's ``DecodePuller``, whose main-KV destination is a real offload
host pool (``OffloadManager``) and whose indexer destination is its own indexer cache tensor.

Real Mooncake engines and real ZMQ on loopback (vLLM's engine is not needed to show what the
workers move): the main rows land in the pool rows of the destination blocks, the indexer rows
in the indexer cache, the placeholder vLLM binds to the MLA layer stays untouched, the pulled
blocks are reported to residency, and the bytes per part are counted; into the fused decode's
pool (latent and rope apart) the rows are split on arrival. A prefill whose indexer layout
differs (C8 vs bf16) is refused at the handshake, naming both layouts.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping

import attrs
import pytest
import torch

from kvo_core.config import RemoteD2HConfig
from kvo_core.errors import ConfigError
from kvo_vllm.dsa.indexer_cache import describe_indexer_block
from kvo_vllm.dsa.offload_manager import OffloadManager
from kvo_vllm.remote_d2h.decode_worker import DecodePuller
from kvo_vllm.remote_d2h.kv_caches import KVLayout
from kvo_vllm.remote_d2h.metadata import RecvTarget, RemoteD2HMetadata, SendChunk
from kvo_vllm.remote_d2h.pool_destination import PoolDestination, manager_destination
from kvo_vllm.remote_d2h.prefill_worker import PrefillSender
from kvo_vllm.sparse.layout import SparseModelLayout

pytestmark = pytest.mark.skipif(
    os.environ.get("KVO_IN_NETNS") != "1",
    reason="starts Mooncake, which listens on every interface: run inside a loopback-only "
           "network namespace (nox -s vllm does this)")

LAYERS = 2
BLOCKS = 8
BS = 4
ROW = 12            # main-KV row: latent 8 + rope 4, float32
HEAD_DIM = 8        # indexer keys: bf16 rows of 16 bytes, C8 rows of 12
SRC_BLOCKS = (1, 2, 5)
DST_BLOCKS = (6, 3, 4)
WAIT = 20.0


def main_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def indexer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.indexer.k_cache"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def config(port: int) -> RemoteD2HConfig:
    return RemoteD2HConfig(kv_port=port, layer_deadline_s=20.0, handshake_timeout_s=20.0,
                           read_retries=0)


def prefill_caches(indexer_row: int) -> dict[str, torch.Tensor]:
    caches = {}
    for i in range(LAYERS):
        main = torch.arange(BLOCKS * BS * ROW, dtype=torch.float32).reshape(BLOCKS, BS, ROW)
        caches[main_name(i)] = main + 10_000 * (i + 1)
        rows = torch.arange(BLOCKS * BS * indexer_row) % 251 + i
        caches[indexer_name(i)] = rows.to(torch.uint8).reshape(BLOCKS, BS, indexer_row)
    return caches


def new_manager(fused: bool = False) -> OffloadManager:
    layout = SparseModelLayout(num_layers=LAYERS, latent_dim=8, rope_dim=4, index_dim=HEAD_DIM,
                               softmax_scale=1.0, kv_dtype=torch.float32)
    return OffloadManager(layout, num_blocks=BLOCKS, block_size=BS, max_rows=2,
                          max_blocks_per_row=4, top_k=4, capacity=8, decode_query_rows=1,
                          pool_name=f"t-pd-{uuid.uuid4().hex[:8]}", fused=fused)


@pytest.fixture
def manager() -> Iterator[OffloadManager]:
    owner = new_manager()
    yield owner
    owner.close()


@pytest.fixture
def fused_manager() -> Iterator[OffloadManager]:
    owner = new_manager(fused=True)
    yield owner
    owner.close()


def decode_caches() -> dict[str, torch.Tensor]:
    """What vLLM binds on an offload decode: a placeholder per MLA layer, bf16 indexer rows."""
    caches = {}
    for i in range(LAYERS):
        caches[main_name(i)] = torch.full((BLOCKS, BS, 1), -7.0)
        caches[indexer_name(i)] = torch.zeros(BLOCKS, BS, 2 * HEAD_DIM, dtype=torch.uint8)
    return caches


def pool_of(manager: OffloadManager, noted: list[int]) -> PoolDestination:
    def note(blocks: Iterable[int]) -> None:
        ids = [b for b in blocks if b >= 0]
        noted.extend(ids)
        manager.note_blocks_written(ids)

    return attrs.evolve(manager_destination(manager, {main_name(i): i for i in range(LAYERS)}),
                        note_pulled=note)


def start_puller(manager: OffloadManager, caches: dict[str, torch.Tensor],
                 noted: list[int]) -> DecodePuller:
    puller = DecodePuller(config=config(free_port()), tp_rank=0, tp_size=1, dp_rank=0)

    def find(kv: Mapping[str, torch.Tensor], layout: KVLayout) -> PoolDestination:
        assert layout.has_indexer
        return pool_of(manager, noted)

    puller.register_kv_caches(caches, find, functools.partial(
        describe_indexer_block, block_size=BS, head_dim=HEAD_DIM))
    return puller


def send(sender: PrefillSender, endpoint: str, transfer_id: str) -> None:
    sender.start_step(RemoteD2HMetadata(sends=(SendChunk(
        request_id=f"p-{transfer_id}", transfer_id=transfer_id, decode_endpoints=(endpoint,),
        start_block=0, block_ids=SRC_BLOCKS, last=True),)))
    for i in range(LAYERS):
        sender.publish_layer(main_name(i))


def collect_until(puller: DecodePuller, request_id: str) -> set[int]:
    invalid: set[int] = set()
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        done, bad = puller.collect()
        invalid |= bad
        if request_id in done:
            return invalid
        time.sleep(0.01)
    raise AssertionError(f"the decode worker never reported {request_id}")


def test_main_kv_lands_in_the_host_pool_and_indexer_in_its_cache(
        manager: OffloadManager) -> None:
    source = prefill_caches(indexer_row=2 * HEAD_DIM)
    caches = decode_caches()
    noted: list[int] = []
    puller = start_puller(manager, caches, noted)
    sender = PrefillSender(config=config(free_port()), tp_rank=0, tp_size=1,
                           instance_id="prefill-dsa")
    try:
        sender.register_kv_caches(source)
        puller.start_step(RemoteD2HMetadata(recvs=(RecvTarget(
            request_id="req-1", transfer_id="t1", block_ids=DST_BLOCKS, skip_blocks=0),)))
        send(sender, puller.endpoint, "t1")
        assert collect_until(puller, "req-1") == set()
        for i in range(LAYERS):
            pool = manager.pool_layer(i).view(BLOCKS, BS, ROW)
            for src, dst in zip(SRC_BLOCKS, DST_BLOCKS, strict=True):
                assert torch.equal(pool[dst], source[main_name(i)][src])
                assert torch.equal(caches[indexer_name(i)][dst], source[indexer_name(i)][src])
            untouched = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
            assert bool((pool[untouched] == 0).all())
            assert bool((caches[main_name(i)] == -7.0).all())  # the placeholder
        assert sorted(noted) == sorted(DST_BLOCKS)
        assert all(int(identity._versions[list(DST_BLOCKS)].min()) > 0
                   for identity in manager.layers.identity)
        stats = puller.snapshot()
        assert stats["main_into_host_pool"] is True and stats["received"] == 1
        per_part = stats["per_part"]
        assert isinstance(per_part, dict)
        assert per_part["kv"]["bytes"] == LAYERS * len(DST_BLOCKS) * BS * ROW * 4
        assert per_part["idx"]["bytes"] == LAYERS * len(DST_BLOCKS) * BS * 2 * HEAD_DIM
        assert sender.stats.published_bytes == per_part["kv"]["bytes"] + per_part["idx"]["bytes"]
        # Device KV as the demo reports it: the placeholder and the indexer caches vLLM bound,
        # the hot buffers, against the same blocks' main KV resident on the device.
        assert stats["device_kv"] == {
            "main_cache": LAYERS * BLOCKS * BS * 4, "indexer": LAYERS * BLOCKS * BS * 2 * HEAD_DIM,
            "hot_buffers": manager.hot_buffer_bytes, "host_pool": manager.pool_region[1],
            "main_resident": LAYERS * BLOCKS * BS * ROW * 4}
        assert manager.hot_buffer_bytes == LAYERS * 2 * 8 * ROW * 4  # max_rows x capacity rows
    finally:
        sender.close()
        puller.close()


def test_main_kv_lands_split_in_the_fused_pool(fused_manager: OffloadManager) -> None:
    """``kernel_backend="fused"``: the pool keeps latent and rope apart; the pulled rows land
    in both arrays at the destination blocks' rows, and nothing else of the pool changes."""
    manager = fused_manager
    source = prefill_caches(indexer_row=2 * HEAD_DIM)
    caches = decode_caches()
    noted: list[int] = []
    puller = start_puller(manager, caches, noted)
    sender = PrefillSender(config=config(free_port()), tp_rank=0, tp_size=1,
                           instance_id="prefill-dsa-fused")
    try:
        sender.register_kv_caches(source)
        puller.start_step(RemoteD2HMetadata(recvs=(RecvTarget(
            request_id="req-f", transfer_id="tf", block_ids=DST_BLOCKS, skip_blocks=0),)))
        send(sender, puller.endpoint, "tf")
        assert collect_until(puller, "req-f") == set()
        for i in range(LAYERS):
            latent, rope = manager.pool_parts(i)
            rows = source[main_name(i)]
            for src, dst in zip(SRC_BLOCKS, DST_BLOCKS, strict=True):
                assert torch.equal(latent[dst], rows[src][:, :8])
                assert torch.equal(rope[dst], rows[src][:, 8:])
                assert torch.equal(caches[indexer_name(i)][dst], source[indexer_name(i)][src])
            untouched = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
            assert bool((latent[untouched] == 0).all()) and bool((rope[untouched] == 0).all())
            slot = DST_BLOCKS[0] * BS + 1  # one row by vLLM slot id: latent then rope again
            row = torch.cat([latent.flatten(0, 1)[slot], rope.flatten(0, 1)[slot]])
            assert torch.equal(row, rows[SRC_BLOCKS[0]][1])
        assert sorted(noted) == sorted(DST_BLOCKS)
        stats = puller.snapshot()
        assert stats["received"] == 1
        per_part = stats["per_part"]
        assert isinstance(per_part, dict)
        assert per_part["kv"]["bytes"] == LAYERS * len(DST_BLOCKS) * BS * ROW * 4
        wrapper = stats["engine_wrapper"]
        assert isinstance(wrapper, dict)
        assert wrapper["fused_pool_split_rows"] == LAYERS * len(DST_BLOCKS) * BS
    finally:
        sender.close()
        puller.close()


def test_a_fused_pool_at_decode_tp2_is_refused_naming_the_combination(
        fused_manager: OffloadManager) -> None:
    puller = DecodePuller(config=config(free_port()), tp_rank=0, tp_size=2, dp_rank=0)
    try:
        with pytest.raises(ConfigError, match="kernel_backend 'fused' at decode TP 2"):
            puller.register_kv_caches(decode_caches(),
                                      lambda kv, layout: pool_of(fused_manager, []))
    finally:
        puller.close()


def test_an_indexer_layout_mismatch_is_refused_naming_both(
        manager: OffloadManager, caplog: pytest.LogCaptureFixture) -> None:
    puller = start_puller(manager, decode_caches(), [])
    sender = PrefillSender(config=config(free_port()), tp_rank=0, tp_size=1,
                           instance_id="prefill-c8")
    try:
        sender.register_kv_caches(prefill_caches(indexer_row=HEAD_DIM + 4))  # C8 rows
        with caplog.at_level(logging.ERROR, logger="kvo_vllm.remote_d2h.prefill_worker"):
            send(sender, puller.endpoint, "t2")
        assert sender.stats.handshake_failures == 1 and sender.stats.published_layers == 0
        text = caplog.text
        assert "rejected" in text and "indexer tensor 0" in text
        assert "prefill: C8: int8 keys with their fp16 scale, indexer_kv_dtype='int8'" in text
        assert "decode: bfloat16 keys, indexer_kv_dtype='bfloat16'" in text
    finally:
        sender.close()
        puller.close()


class _HeldReads:
    """Decode's engine, whose data reads wait until the test lets them through: the decode
    answers a step's READYs only after the prefill's step is over (a slow decode)."""

    def __init__(self, engine: object) -> None:
        self._engine = engine
        self.open = threading.Event()
        self.open.set()

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def read(self, *args: object) -> None:
        assert self.open.wait(WAIT), "the test never let the decode's reads through"
        self._engine.read(*args)  # type: ignore[attr-defined]


def _vllm_step(senders: list[PrefillSender], metadata: RemoteD2HMetadata,
               finished: set[str], released: list[set[str]]) -> None:
    """One prefill step as vLLM drives each TP member's worker: ``start_load_kv`` before the
    forward only when the step has sends (``build_connector_meta`` asks for it), else after it;
    ``save_kv_layer`` per layer in the forward; ``get_transfer_results`` at the end (what it
    releases is added to ``released[rank]``)."""
    for rank, sender in enumerate(senders):
        if metadata.has_sends:
            sender.start_step(metadata)
        for i in range(LAYERS):
            sender.publish_layer(main_name(i))
        if not metadata.has_sends:
            sender.start_step(metadata)
        released[rank] |= sender.finished_sending(finished)


def _finish_sends(senders: list[PrefillSender], request_id: str,
                  released: list[set[str]]) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        for rank, sender in enumerate(senders):
            released[rank] |= sender.finished_sending(set())
        if all(request_id in ids for ids in released):
            return
        time.sleep(0.01)
    raise AssertionError(f"prefill members never all released {request_id}: {released}, "
                         f"{[sender.snapshot() for sender in senders]}")


def test_tp2_members_publish_a_chunk_once_when_vllm_starts_a_step_after_its_forward(
        manager: OffloadManager, caplog: pytest.LogCaptureFixture) -> None:
    """TP 2 prefill -> TP 1 decode with the step order vLLM uses: the request's last chunk
    is published, the decode answers only after that step ended, and the next step (the
    prompt's tail: nothing to send, so vLLM calls ``start_load_kv`` after the forward) must
    not publish the spent chunk again. Before the fix it did: both members' READYs reached a
    decode that had completed and released the request ("no destination on this decode
    rank"), and such a READY can also race the fence release of the prefill's blocks."""
    source = prefill_caches(indexer_row=2 * HEAD_DIM)
    caches = decode_caches()
    held: list[_HeldReads] = []

    def hold(engine: object, regions: object) -> _HeldReads:
        held.append(_HeldReads(engine))
        return held[-1]

    puller = DecodePuller(config=config(free_port()), tp_rank=0, tp_size=1, dp_rank=0,
                          engine_wrapper=hold)  # type: ignore[arg-type]
    puller.register_kv_caches(caches, lambda kv, layout: pool_of(manager, []),
                              functools.partial(describe_indexer_block, block_size=BS,
                                                head_dim=HEAD_DIM))
    senders = [PrefillSender(config=config(free_port()), tp_rank=rank, tp_size=2,
                             instance_id="prefill-tp2") for rank in range(2)]
    released: list[set[str]] = [set(), set()]
    try:
        for sender in senders:
            sender.register_kv_caches(source)
        endpoint = puller.endpoint

        def chunk(transfer_id: str, blocks: tuple[int, ...]) -> RemoteD2HMetadata:
            return RemoteD2HMetadata(sends=(SendChunk(
                request_id=f"p-{transfer_id}", transfer_id=transfer_id,
                decode_endpoints=(endpoint,), start_block=0, block_ids=blocks, last=True),))

        # A first request connects both members (the decode's one thread answers the
        # handshakes, so it must not be held while they run).
        puller.start_step(RemoteD2HMetadata(recvs=(RecvTarget(
            request_id="req-0", transfer_id="t0", block_ids=(5,), skip_blocks=0),)))
        _vllm_step(senders, chunk("t0", (6,)), {"p-t0"}, released)
        assert collect_until(puller, "req-0") == set()
        _finish_sends(senders, "p-t0", released)
        puller.start_step(RemoteD2HMetadata(recvs=(RecvTarget(
            request_id="req-1", transfer_id="t1", block_ids=DST_BLOCKS, skip_blocks=0),)))
        with caplog.at_level(logging.WARNING):
            held[0].open.clear()
            _vllm_step(senders, chunk("t1", SRC_BLOCKS), set(), released)  # the last chunk
            held[0].open.set()
            assert collect_until(puller, "req-1") == set()  # received, destination released
            _vllm_step(senders, RemoteD2HMetadata(), {"p-t1"}, released)  # the tail: no sends
            _finish_sends(senders, "p-t1", released)
            # A next request through the same connections: answered in order, so every
            # answer to the steps above has arrived once this one settled.
            puller.start_step(RemoteD2HMetadata(recvs=(RecvTarget(
                request_id="req-2", transfer_id="t2", block_ids=(0, 7), skip_blocks=0),)))
            _vllm_step(senders, chunk("t2", (3, 4)), {"p-t2"}, released)
            assert collect_until(puller, "req-2") == set()
            _finish_sends(senders, "p-t2", released)
        for sender in senders:
            assert sender.stats.published_layers == 3 * LAYERS, sender.snapshot()
            assert (sender.stats.sends_done, sender.stats.sends_failed) == (3, 0)
        assert "no destination" not in caplog.text
        stats = puller.snapshot()
        assert (stats["received"], stats["failed"]) == (3, 0)
        # Member 0 sent the main KV, the members split the indexer: one copy of each.
        for i in range(LAYERS):
            pool = manager.pool_layer(i).view(BLOCKS, BS, ROW)
            for src, dst in zip((6, *SRC_BLOCKS, 3, 4), (5, *DST_BLOCKS, 0, 7), strict=True):
                assert torch.equal(pool[dst], source[main_name(i)][src])
                assert torch.equal(caches[indexer_name(i)][dst], source[indexer_name(i)][src])
        per_part = stats["per_part"]
        assert isinstance(per_part, dict)
        assert per_part["kv"]["bytes"] == LAYERS * 6 * BS * ROW * 4
        assert per_part["idx"]["bytes"] == LAYERS * 6 * BS * 2 * HEAD_DIM
    finally:
        for sender in senders:
            sender.close()
        puller.close()


class _FailingReads:
    """Decode's engine whose data reads all fail (a lost peer), as Mooncake reports one."""

    def __init__(self, engine: object) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def read(self, *args: object) -> None:
        from kvo_transport.errors import TransferError

        raise TransferError("injected: the read of this decode rank failed")


def _tp2_pullers(manager: OffloadManager, caches: list[dict[str, torch.Tensor]],
                 noted: list[list[int]], wrap: dict[int, type] | None = None
                 ) -> list[DecodePuller]:
    """Decode TP ranks 0 and 1 of one DP rank: one host pool (``manager``'s, which both
    ranks' engines register), each rank its own indexer caches and its own pulled-block log."""
    kv_port = free_port()
    pullers = []
    for rank in range(2):
        wrapper = None if wrap is None or rank not in wrap else (
            lambda engine, regions, cls=wrap[rank]: cls(engine))
        puller = DecodePuller(config=config(kv_port), tp_rank=rank, tp_size=2, dp_rank=0,
                              engine_wrapper=wrapper)  # type: ignore[arg-type]
        puller.register_kv_caches(caches[rank],
                                  lambda kv, layout, log=noted[rank]: pool_of(manager, log),
                                  functools.partial(describe_indexer_block, block_size=BS,
                                                    head_dim=HEAD_DIM))
        pullers.append(puller)
    return pullers


def _send_tp2(senders: list[PrefillSender], pullers: list[DecodePuller], transfer_id: str,
              request_id: str) -> None:
    endpoints = tuple(puller.endpoint for puller in pullers)
    for puller in pullers:
        puller.start_step(RemoteD2HMetadata(recvs=(RecvTarget(
            request_id=request_id, transfer_id=transfer_id, block_ids=DST_BLOCKS,
            skip_blocks=0),)))
    for sender in senders:
        sender.start_step(RemoteD2HMetadata(sends=(SendChunk(
            request_id=f"p-{transfer_id}", transfer_id=transfer_id,
            decode_endpoints=endpoints, start_block=0, block_ids=SRC_BLOCKS, last=True),)))
        for i in range(LAYERS):
            sender.publish_layer(main_name(i))


def test_tp2_prefill_into_tp2_decode_writes_the_shared_pool_once(
        manager: OffloadManager) -> None:
    """Prefill TP 2 -> decode TP 2 of one DP rank sharing one host pool: prefill rank r feeds
    decode rank r; the decode ranks pull disjoint parts of the (replicated) main KV into the
    pool, so every main row lands once, and each rank pulls the whole indexer into its own
    cache. Every rank reports all the request's blocks to its own residency bookkeeping."""
    source = prefill_caches(indexer_row=2 * HEAD_DIM)
    caches = [decode_caches(), decode_caches()]
    noted: list[list[int]] = [[], []]
    pullers = _tp2_pullers(manager, caches, noted)
    senders = [PrefillSender(config=config(free_port()), tp_rank=rank, tp_size=2,
                             instance_id="prefill-tp2") for rank in range(2)]
    try:
        for sender in senders:
            sender.register_kv_caches(source)
        _send_tp2(senders, pullers, "t1", "req-1")
        for puller in pullers:
            assert collect_until(puller, "req-1") == set()
        for i in range(LAYERS):
            pool = manager.pool_layer(i).view(BLOCKS, BS, ROW)
            for src, dst in zip(SRC_BLOCKS, DST_BLOCKS, strict=True):
                assert torch.equal(pool[dst], source[main_name(i)][src])
                for rank in range(2):
                    assert torch.equal(caches[rank][indexer_name(i)][dst],
                                       source[indexer_name(i)][src])
        assert [sorted(log) for log in noted] == [sorted(DST_BLOCKS)] * 2
        # One chunk of 3 blocks: rank 0 pulls the main KV of blocks [0, 2), rank 1 of [2, 3).
        block_kv = BS * ROW * 4
        kv = [puller.snapshot()["per_part"]["kv"]["bytes"] for puller in pullers]  # type: ignore[index]
        idx = [puller.snapshot()["per_part"]["idx"]["bytes"] for puller in pullers]  # type: ignore[index]
        assert kv == [LAYERS * 2 * block_kv, LAYERS * 1 * block_kv]
        assert idx == [LAYERS * len(DST_BLOCKS) * BS * 2 * HEAD_DIM] * 2
    finally:
        for sender in senders:
            sender.close()
        for puller in pullers:
            puller.close()


def test_a_failed_pull_on_one_decode_tp_rank_reports_its_blocks_invalid(
        manager: OffloadManager) -> None:
    """Decode rank 1's reads fail while rank 0's succeed: rank 1 reports the request with
    invalid blocks (vLLM unites them over the ranks and recomputes them for every rank), so
    the rows rank 1 was to write into the shared pool are never taken as pulled."""
    source = prefill_caches(indexer_row=2 * HEAD_DIM)
    caches = [decode_caches(), decode_caches()]
    noted: list[list[int]] = [[], []]
    pullers = _tp2_pullers(manager, caches, noted, wrap={1: _FailingReads})
    senders = [PrefillSender(config=config(free_port()), tp_rank=rank, tp_size=2,
                             instance_id="prefill-tp2-fail") for rank in range(2)]
    try:
        for sender in senders:
            sender.register_kv_caches(source)
        _send_tp2(senders, pullers, "t2", "req-2")
        assert collect_until(pullers[0], "req-2") == set()
        invalid = collect_until(pullers[1], "req-2")
        assert DST_BLOCKS[2] in invalid  # rank 1's main share of the chunk
        assert invalid <= set(DST_BLOCKS)
        assert (pullers[1].snapshot()["failed"], pullers[0].snapshot()["failed"]) == (1, 0)
        # Rank 1 wrote none of its share: block 4 (logical block 2) still holds zeros.
        for i in range(LAYERS):
            assert bool((manager.pool_layer(i).view(BLOCKS, BS, ROW)[DST_BLOCKS[2]] == 0).all())
    finally:
        for sender in senders:
            sender.close()
        for puller in pullers:
            puller.close()
