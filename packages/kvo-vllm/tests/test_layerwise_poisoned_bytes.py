"""A save whose source was overwritten while read never reaches another engine.

Two layerwise workers (engines A and B) share one real Mooncake store (real master, one real
store client each). B loads a block A saved, which gives B a read lease on its keys (3 s here;
mooncake_master's default is 10 s). A saves the block again, and this time a slot is given up on
while the put waits (a layer deadline passes; a later layer overwrites the buffer): the bytes
A's put would read are another layer's. A poisons those keys and tries to remove them, but
B's lease makes the removal give up (``remove_timeout_s`` 0.5 s here, 5 s by default: both
shorter than the lease). Before the fix, B then loaded the wrong bytes A had stored; now A's
put leaves such keys out (``savers``: a value is published only from a copy its source was
confirmed unchanged after), so B loads the block's right bytes. A retries the removal once
the lease is over (``poisoned_keys``).

The only stand-in is ``GatedStore``: it holds A's puts on an event (a slow store) and passes
every call to the real client.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_layerwise_worker import KEYS, NAMES, forward, make_rig, step_meta

from kvo_core.errors import SlotTimeoutError
from kvo_transport.mooncake_master import MooncakeMaster
from kvo_transport.store import create_kv_store

pytestmark = pytest.mark.skipif(
    os.environ.get("KVO_IN_NETNS") != "1",
    reason="starts Mooncake, which listens on every interface: run inside a loopback-only "
           "network namespace (nox -s vllm does this)")

WAIT_S = 30.0
LEASE_TTL_MS = 3_000
"""The master's read lease: longer than A's removal waits (mooncake_master's default: 10 s)."""
DEADLINE_S = 0.3
"""Engine A's layer deadline: a slot whose save is held longer is given up on."""


class GatedStore:
    """A real store client whose puts wait for ``gate`` (when set) before they start."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.gate: threading.Event | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def put_from(self, *args: Any, **kwargs: Any) -> None:
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        self.store.put_from(*args, **kwargs)


@pytest.fixture
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[Any, ...]]:
    """(worker A, its gated store, A's caches, worker B, B's caches)."""
    master = MooncakeMaster(default_kv_lease_ttl_ms=LEASE_TTL_MS).start()
    stores: list[Any] = []
    workers: list[Any] = []
    try:
        stores.append(create_kv_store("mooncake", master_address=master.address,
                                      remove_timeout_s=0.5))
        stores.append(create_kv_store("mooncake", master_address=master.address))
        gated = GatedStore(stores[0])
        a, a_caches = make_rig(gated, staging_bytes=request.param,
                               layer_deadline_s=DEADLINE_S)
        workers.append(a)
        b, b_caches = make_rig(stores[1])
        workers.append(b)
        yield a, gated, a_caches, b, b_caches
    finally:
        for worker in workers:
            worker.close()
        for store in stores:
            store.close()
        master.stop()


def b_loads_block_1(b: Any, b_caches: dict) -> dict[int, torch.Tensor]:
    """Engine B loads block ``b1`` into its block 3, every layer; what each layer saw."""
    seen: dict[str, torch.Tensor] = {}
    forward(b, b_caches, step_meta(every=[(3, "b1")]), {}, seen)
    assert b.take_load_errors() == set()
    return {int(name.split(".")[2]): seen[name][3] for name in NAMES}


def right_bytes(layer: int) -> float:
    return 100.0 + layer


@pytest.mark.parametrize("engines", [0], ids=["direct-saves"], indirect=True)
def test_bytes_of_a_slot_given_up_during_a_direct_save_never_reach_another_engine(
        engines) -> None:
    a, gated, a_caches, b, b_caches = engines
    forward(a, a_caches, step_meta(save=[(1, "b1")]), {1: 100.0})
    for layer, value in b_loads_block_1(b, b_caches).items():  # B now holds read leases
        assert torch.all(value == right_bytes(layer)), layer

    # A saves b1 again (a recompute of the same prefix); its puts wait until the last layer
    # ran. Meanwhile layers 3 to 5 give up waiting for their shared slot (the deadline) and
    # write their own KV into it: the held saves of layers 1 to 3 would read that.
    gated.gate = threading.Event()

    def open_gate(name: str) -> None:
        if name == NAMES[-1]:
            assert gated.gate is not None
            gated.gate.set()

    forward(a, a_caches, step_meta(save=[(1, "b1")]), {1: 100.0}, before_save=open_gate)
    a.poisoned.settle(WAIT_S)
    poisoned = a.poisoned.poisoned_among(KEYS.key("b1", layer) for layer in range(6))
    assert poisoned, "no slot was given up on: the test did not tear a save"
    assert a.stats.poisoned_keys == len(poisoned)
    # B's lease kept them in the store (the removal gave up); whatever B loads is right.
    for layer, value in b_loads_block_1(b, b_caches).items():
        assert torch.all(value == right_bytes(layer)), (
            f"engine B loaded layer {layer} bytes {value.flatten()[0].item()} that engine A "
            f"poisoned (right: {right_bytes(layer)})")
    # Once B's lease is over, A's retried removal takes the poisoned keys out. (Polled on
    # A's side: Mooncake's exists() renews a key's read lease as a get does.)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        a.poisoned.settle(WAIT_S)  # no removal running: none waits, or one waits its retry
        if not a.poisoned.retries_waiting():
            break
        time.sleep(0.1)
    assert not any(b.store.exists(sorted(poisoned)))
    assert a.stats.removal_retries >= 1 and a.stats.removals_given_up == 0


@pytest.mark.parametrize("engines", [1 << 20], ids=["staged-saves"], indirect=True)
def test_bytes_of_a_held_slot_given_up_during_a_staged_put_never_reach_another_engine(
        engines) -> None:
    a, gated, a_caches, b, b_caches = engines
    forward(a, a_caches, step_meta(save=[(1, "b1")]), {1: 100.0})
    a.wait_staged_puts()
    for layer, value in b_loads_block_1(b, b_caches).items():
        assert torch.all(value == right_bytes(layer)), layer

    gated.gate = threading.Event()
    forward(a, a_caches, step_meta(save=[(1, "b1")]), {1: 100.0})
    # Layer 0's buffer is put in place by the step's batched put, which waits. Its round is
    # given up on (a waiter's deadline passed) and the waiter writes the slot.
    slot = a.slot_key(NAMES[0])
    for part in a.gates.pending(slot):
        a.gates.mark_failed(slot, part, SlotTimeoutError("test: a waiter's deadline passed"))
    a_caches[NAMES[0]][1].fill_(-7.0)
    gated.gate.set()
    a.wait_staged_puts()
    a.poisoned.settle(WAIT_S)
    assert a.poisoned.poisoned_among([KEYS.key("b1", 0)]) == {KEYS.key("b1", 0)}
    for layer, value in b_loads_block_1(b, b_caches).items():
        assert torch.all(value == right_bytes(layer)), (
            f"engine B loaded layer {layer} bytes {value.flatten()[0].item()} that engine A "
            f"poisoned (right: {right_bytes(layer)})")
