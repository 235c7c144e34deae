"""kvo-vllm's RemoteD2H workers on DSA layouts: prefill's ``PrefillSender`` hands a request's
MLA and indexer blocks to decode's ``DecodePuller``, whose main-KV destination is a real offload
host pool (``OffloadManager``) and whose indexer destination is its own indexer cache tensor.

Real Mooncake engines and real ZMQ on loopback (vLLM's engine is not needed to show what the
workers move): the main rows land in the pool rows of the destination blocks, the indexer rows
in the indexer cache, the placeholder vLLM binds to the MLA layer stays untouched, the pulled
blocks are reported to residency, and the bytes per part are counted. A prefill whose indexer
layout differs (C8 vs bf16) is refused at the handshake, naming both layouts.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping

import pytest
import torch

from kvo_core.config import RemoteD2HConfig
from kvo_vllm.dsa.indexer_cache import describe_indexer_block
from kvo_vllm.dsa.offload_manager import OffloadManager
from kvo_vllm.remote_d2h.decode_worker import DecodePuller
from kvo_vllm.remote_d2h.kv_caches import KVLayout
from kvo_vllm.remote_d2h.metadata import RecvTarget, RemoteD2HMetadata, SendChunk
from kvo_vllm.remote_d2h.pool_destination import PoolDestination
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


@pytest.fixture
def manager() -> Iterator[OffloadManager]:
    layout = SparseModelLayout(num_layers=LAYERS, latent_dim=8, rope_dim=4, index_dim=HEAD_DIM,
                               softmax_scale=1.0, kv_dtype=torch.float32)
    owner = OffloadManager(layout, num_blocks=BLOCKS, block_size=BS, max_rows=2,
                           max_blocks_per_row=4, top_k=4, capacity=8, decode_query_rows=1,
                           pool_name=f"t-pd-{uuid.uuid4().hex[:8]}")
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

    return PoolDestination(region=manager.pool_region,
                           bases={main_name(i): manager.pool_layer_base(i)
                                  for i in range(LAYERS)},
                           block_bytes=BS * manager.row_bytes, num_blocks=BLOCKS,
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
                   for identity in manager.identity)
        stats = puller.snapshot()
        assert stats["main_into_host_pool"] is True and stats["received"] == 1
        per_part = stats["per_part"]
        assert isinstance(per_part, dict)
        assert per_part["kv"]["bytes"] == LAYERS * len(DST_BLOCKS) * BS * ROW * 4
        assert per_part["idx"]["bytes"] == LAYERS * len(DST_BLOCKS) * BS * 2 * HEAD_DIM
        assert sender.stats.published_bytes == per_part["kv"]["bytes"] + per_part["idx"]["bytes"]
    finally:
        sender.close()
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
