"""The drafter's (MTP) layer through RemoteD2H, with vLLM 0.32's speculative-decoding hook order.

With ``speculative_config`` vLLM runs, per prefill step: ``start_load_kv``, the model's forward
(``save_kv_layer`` per model layer), ``get_transfer_results`` (``finished_sending``), then the
drafter (``save_kv_layer`` of its layer once per draft token), then ``wait_for_save``
(``end_step``). Real Mooncake engines and ZMQ on loopback, a real offload host pool on the
decode (helpers of ``test_remote_d2h_dsa_pull``): layer 1 plays the draft layer
(``first_draft_layer=1``). The draft layer is published once, after ``finished_sending``, and
counted in the request's completion; a step whose drafter did not run gives its requests up
(the decode fails the pull at once) instead of leaving them to the decode's deadline.
Without ``end_step`` or with the model's pass publishing past ``finished_sending`` these fail.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from test_remote_d2h_dsa_pull import (
    BLOCKS,
    BS,
    DST_BLOCKS,
    HEAD_DIM,
    LAYERS,
    ROW,
    SRC_BLOCKS,
    WAIT,
    collect_until,
    config,
    decode_caches,
    free_port,
    indexer_name,
    main_name,
    manager,
    prefill_caches,
    start_puller,
)

from kvo_vllm.dsa.offload_manager import OffloadManager
from kvo_vllm.remote_d2h.decode_worker import DecodePuller
from kvo_vllm.remote_d2h.metadata import RecvTarget, RemoteD2HMetadata, SendChunk
from kvo_vllm.remote_d2h.prefill_worker import PrefillSender

pytestmark = pytest.mark.skipif(
    os.environ.get("KVO_IN_NETNS") != "1",
    reason="starts Mooncake, which listens on every interface: run inside a loopback-only "
           "network namespace (nox -s vllm does this)")

__all__ = ["manager"]   # the pool fixture, shared with test_remote_d2h_dsa_pull

DRAFT = LAYERS - 1      # the draft layer's index


def _speculative_step(sender: PrefillSender, metadata: RemoteD2HMetadata, drafter_passes: int,
                      released: set[str], finished: set[str]) -> None:
    """One prefill step in vLLM 0.32's order with a drafter (module docstring)."""
    sender.start_step(metadata)
    for i in range(DRAFT):
        sender.publish_layer(main_name(i))
    released |= sender.finished_sending(finished)
    for _ in range(drafter_passes):
        sender.publish_layer(main_name(DRAFT))
    sender.end_step()


def _expect(puller: DecodePuller, sender: PrefillSender, transfer_id: str) -> RemoteD2HMetadata:
    puller.start_step(RemoteD2HMetadata(recvs=(RecvTarget(
        request_id=f"req-{transfer_id}", transfer_id=transfer_id, block_ids=DST_BLOCKS,
        skip_blocks=0),)))
    return RemoteD2HMetadata(sends=(SendChunk(
        request_id=f"p-{transfer_id}", transfer_id=transfer_id,
        decode_endpoints=(puller.endpoint,), start_block=0, block_ids=SRC_BLOCKS, last=True),))


def _released(sender: PrefillSender, request_id: str, released: set[str]) -> None:
    deadline = time.monotonic() + WAIT
    while request_id not in released and time.monotonic() < deadline:
        sender.end_step()   # the idle steps vLLM runs while a send is pending
        released |= sender.finished_sending(set())
        time.sleep(0.01)
    assert request_id in released, sender.snapshot()


def test_the_draft_layer_is_published_once_after_the_model_and_completes_the_request(
        manager: OffloadManager) -> None:
    source = prefill_caches(indexer_row=2 * HEAD_DIM)
    caches = decode_caches()
    puller = start_puller(manager, caches, [])
    sender = PrefillSender(config=config(free_port()), tp_rank=0, tp_size=1,
                           instance_id="prefill-mtp", first_draft_layer=DRAFT)
    released: set[str] = set()
    try:
        sender.register_kv_caches(source)
        assert sender.has_draft_layers
        _speculative_step(sender, _expect(puller, sender, "t1"), 3, released, {"p-t1"})
        assert collect_until(puller, "req-t1") == set()
        _released(sender, "p-t1", released)
        # The next step has nothing to send: vLLM starts it after the forward, so the model's
        # layers see the spent chunk; they must not publish it again (nor the drafter).
        sender.publish_layer(main_name(0))
        sender.start_step(RemoteD2HMetadata())
        sender.finished_sending(set())
        sender.publish_layer(main_name(DRAFT))
        sender.end_step()
        assert sender.stats.published_layers == LAYERS, sender.snapshot()
        assert (sender.stats.sends_done, sender.stats.sends_failed) == (1, 0)
        for i in range(LAYERS):   # the draft layer's rows too
            pool = manager.pool_layer(i).view(BLOCKS, BS, ROW)
            for src, dst in zip(SRC_BLOCKS, DST_BLOCKS, strict=True):
                assert torch.equal(pool[dst], source[main_name(i)][src])
                assert torch.equal(caches[indexer_name(i)][dst], source[indexer_name(i)][src])
        per_layer = puller.snapshot()["per_layer"]
        assert isinstance(per_layer, dict)
        assert per_layer[str(DRAFT)]["reads"] > 0
    finally:
        sender.close()
        puller.close()


def test_a_step_without_the_drafter_gives_its_requests_up_at_once(
        manager: OffloadManager) -> None:
    puller = start_puller(manager, decode_caches(), [])
    sender = PrefillSender(config=config(free_port()), tp_rank=0, tp_size=1,
                           instance_id="prefill-mtp", first_draft_layer=DRAFT)
    released: set[str] = set()
    try:
        sender.register_kv_caches(prefill_caches(indexer_row=2 * HEAD_DIM))
        started = time.monotonic()
        _speculative_step(sender, _expect(puller, sender, "t2"), 0, released, {"p-t2"})
        invalid = collect_until(puller, "req-t2")
        assert invalid == set(DST_BLOCKS)       # the decode recomputes (or fails) them
        assert time.monotonic() - started < 10   # the decode deadline is 20 s
        # The prefill keeps the blocks until the published layer's reads are past their
        # deadline (a read may still be in flight), as for any request given up.
        assert sender.snapshot()["in_flight_sends"] == 1
    finally:
        sender.close()
        puller.close()
