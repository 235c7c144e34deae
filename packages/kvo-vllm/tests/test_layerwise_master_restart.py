"""A Mooncake master that restarts empty: vLLM's local prefix hit is no longer promised.

The shared-buffer layers of a block in vLLM's own prefix cache are reloaded from the store. A
restarted master has none of them; before, the request's load failed and vLLM
(``kv_load_failure_policy="fail"``) failed it (issue 13's soak: 11 unfaulted requests). Now the
scheduler half finds the lost blocks, drops them from vLLM's prefix cache and defers the
request once, so it recomputes them. Real master (killed and restarted), real store client;
vLLM's prefix cache is stood in for by the eviction callback.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from kvo_transport.mooncake_master import MooncakeMaster
from kvo_transport.store import create_kv_store
from kvo_vllm.layerwise.keys import StoreKeys, hashed_block_name
from kvo_vllm.layerwise.scheduler_side import LayerwiseScheduler

pytestmark = pytest.mark.skipif(
    os.environ.get("KVO_IN_NETNS") != "1",
    reason="starts Mooncake, which listens on every interface: run inside a loopback-only "
           "network namespace (nox -s vllm does this)")

BS = 4
PARTS = [(layer, "kv") for layer in range(3)]
KEYS = StoreKeys(namespace="restart")
BLOCK = 256


class Prompt:
    """What the scheduler half reads of a vLLM request."""

    def __init__(self, request_id: str, num_tokens: int) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_computed_tokens = 0
        self.block_hashes = [f"prefix-{i}".encode() for i in range(num_tokens // BS)]


@pytest.fixture
def memory() -> Iterator[int]:
    region = mmap.mmap(-1, 1 << 20)
    anchor = ctypes.c_char.from_buffer(region)
    yield ctypes.addressof(anchor)
    del anchor
    region.close()


def kill(master: MooncakeMaster) -> None:
    assert master._process is not None
    master._process.send_signal(signal.SIGKILL)
    master._process.wait()
    master._cleanup()


def wait_answering(store: Any, timeout_s: float = 30.0) -> None:
    """Until the client talks to the restarted master again (it remounts on its own)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.exists(["probe"])
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_local_hit_the_restarted_master_lost_is_recomputed_not_promised(memory: int) -> None:
    evicted: list[list[bytes]] = []

    def evict(block_hashes: Sequence[Any]) -> int:
        evicted.append(list(block_hashes))
        return len(block_hashes)

    master = MooncakeMaster().start()
    store = create_kv_store("mooncake", master_address=master.address)
    try:
        scheduler = LayerwiseScheduler(
            block_size=BS, stored_parts=PARTS, keys=KEYS, tp_size=1, engine_id="E",
            store_exists=store.exists, block_ids_of=lambda rid: [], evict_local=evict)
        store.register(memory, 1 << 20)
        first = Prompt("first", 13)  # 3 full blocks, saved by an earlier request
        keys = [KEYS.key(hashed_block_name(h), layer, part)
                for h in first.block_hashes for layer, part in PARTS]
        store.put_from(keys, [memory + i * BLOCK for i in range(len(keys))],
                       [BLOCK] * len(keys))

        # Master up: vLLM's local hit of 2 blocks is kept, the third block is a store hit.
        scheduler.on_new_request(before := Prompt("before", 13))
        assert scheduler.num_new_matched_tokens(before, 2 * BS) == BS
        assert evicted == []

        port = master.rpc_port
        kill(master)
        master = MooncakeMaster(rpc_port=port).start()
        wait_answering(store)

        # Restarted, empty: the local hit is cut where the store lost it, the request waits.
        scheduler.on_new_request(after := Prompt("after", 13))
        assert scheduler.num_new_matched_tokens(after, 2 * BS) is None
        assert evicted == [after.block_hashes[:2]]
        assert scheduler.stats.local_hits_dropped == 1
        # Asked again (vLLM found no local hit now): a plain miss, computed from scratch.
        assert scheduler.num_new_matched_tokens(after, 0) == 0
        # Deferred once only: were vLLM to keep the hit, the lookup does not loop.
        assert scheduler.num_new_matched_tokens(after, 2 * BS) == 0
        assert len(evicted) == 1
    finally:
        store.close()
        master.stop()
