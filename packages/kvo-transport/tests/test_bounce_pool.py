"""The bounded calls' bounce-buffer pool stays within its cap, and never unmaps a buffer a call
that was given up on may still write (bounded_calls.py).

The first test is a unit test of the pool's own logic over a stand-in call that blocks like a
frozen master; the second runs a real Mooncake master that is frozen (SIGSTOP) while calls of
several sizes are in flight, so each maps a buffer of its own, and checks the pool shrinks back
to its cap once the late calls returned.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from kvo_transport.bounded_calls import MIN_BOUNCE_BYTES, BoundedCalls
from kvo_transport.errors import StoreUnavailableError
from kvo_transport.mooncake_master import MooncakeMaster
from kvo_transport.mooncake_store import MooncakeKVStore
from kvo_transport.store import create_kv_store

MiB = 1 << 20


@pytest.fixture
def memory() -> Iterator[int]:
    region = mmap.mmap(-1, 16 * MiB)
    anchor = ctypes.c_char.from_buffer(region)
    yield ctypes.addressof(anchor)
    del anchor
    region.close()


def test_a_given_up_call_keeps_its_buffer_until_it_returns_and_the_free_pool_keeps_its_cap(
        memory: int) -> None:
    registered: dict[int, int] = {}
    unregistered: list[int] = []

    def register(ptr: int, length: int) -> int:
        registered[ptr] = length
        return 0

    def unregister(ptr: int, length: int) -> int:
        assert registered.pop(ptr) == length
        unregistered.append(ptr)
        return 0

    calls = BoundedCalls("stand-in", 0.1, register, unregister,
                         max_pooled_bytes=2 * MIN_BOUNCE_BYTES)
    frozen = threading.Event()
    late_wrote = threading.Event()

    def frozen_get(places: list[int]) -> list[int]:
        frozen.wait(10)
        ctypes.memset(places[0], 0x5A, MIN_BOUNCE_BYTES)  # a late write into its bounce buffer
        late_wrote.set()
        return [MIN_BOUNCE_BYTES]

    sizes = [MIN_BOUNCE_BYTES, 2 * MIN_BOUNCE_BYTES, 4 * MIN_BOUNCE_BYTES]
    for size in sizes:  # each given up on its bound: each holds a buffer of its own
        with pytest.raises(StoreUnavailableError, match="did not finish within"):
            calls.get_into("get", frozen_get, [memory], [size])
    assert calls.busy_bytes == sum(sizes) and calls.free_bytes == 0
    assert unregistered == []  # nothing a late call may write is released

    frozen.set()
    deadline = time.monotonic() + 10
    while calls.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late_wrote.is_set() and calls.late_returns == 3
    assert calls.busy_bytes == 0
    assert calls.free_bytes <= 2 * MIN_BOUNCE_BYTES
    assert calls.released >= 1 and len(registered) == len(sizes) - calls.released
    assert ctypes.string_at(memory, 16) == bytes(16)  # the caller's memory was never written

    calls.close(client_closes=True)
    assert registered == {}


@pytest.mark.needs_loopback_netns
def test_a_frozen_master_grows_the_pool_only_until_the_late_calls_return(memory: int) -> None:
    master = MooncakeMaster().start()
    store = create_kv_store("mooncake", master_address=master.address,
                            global_segment_size=64 * MiB)
    assert isinstance(store, MooncakeKVStore) and master.pid is not None
    cap = 2 * MiB
    store._calls.max_pooled_bytes = cap
    sizes = [MiB, 2 * MiB, 4 * MiB]
    try:
        store.register(memory, 16 * MiB)
        ctypes.memset(memory, 0x33, 8 * MiB)
        for size in sizes:
            store.put_from([f"v{size}"], [memory], [size])
        assert store._calls.free_bytes <= cap

        os.kill(master.pid, signal.SIGSTOP)
        start = threading.Barrier(len(sizes))
        errors: list[BaseException] = []

        def get(size: int) -> None:
            start.wait()
            try:
                store.get_into([f"v{size}"], [memory + 8 * MiB], [size])
            except StoreUnavailableError as error:
                errors.append(error)

        threads = [threading.Thread(target=get, args=(size,)) for size in sizes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(errors) == len(sizes), errors
        assert store._calls.busy_bytes >= sum(sizes)  # more than the cap, held by late calls

        os.kill(master.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while store._calls.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store._calls.running == 0
        assert store._calls.busy_bytes == 0
        assert store._calls.free_bytes <= cap
        assert store._calls.released >= 1
    finally:
        os.kill(master.pid, signal.SIGCONT)
        store.close()
        master.stop()
