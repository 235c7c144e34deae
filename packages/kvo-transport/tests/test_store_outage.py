"""A Mooncake master that dies: later store calls fail fast (circuit breaker), close is bounded,
and the store works again once the master is back. Real master, real client.

The bounds asserted here are generous correctness bounds ("fails rather than hangs"); the
measured times are in kvo_tools.bench.store_outage.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvo_transport.circuit_breaker import BreakerState
from kvo_transport.errors import StoreLeaseHeldError, StoreUnavailableError
from kvo_transport.mooncake_master import MooncakeMaster
from kvo_transport.mooncake_store import MooncakeKVStore
from kvo_transport.store import create_kv_store

pytestmark = pytest.mark.needs_loopback_netns

FAST_S = 1.0  # the bound per call; asserted as "well below the RPC timeouts (4-11 s)"
BLOCK = 4096


def kill(master: MooncakeMaster) -> None:
    assert master._process is not None
    master._process.send_signal(signal.SIGKILL)
    master._process.wait()
    master._cleanup()


@pytest.fixture
def memory() -> Iterator[int]:
    region = mmap.mmap(-1, 1 << 20)
    anchor = ctypes.c_char.from_buffer(region)
    yield ctypes.addressof(anchor)
    del anchor
    region.close()


def timed(call: Callable[[], Any]) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        call()
    except Exception as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


def wait_state(store: MooncakeKVStore, state: BreakerState, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while store.breaker.state is not state and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.breaker.state is state


def test_killed_master_fails_calls_fast_and_recovery_closes_the_breaker(memory: int) -> None:
    master = MooncakeMaster().start()
    store = create_kv_store("mooncake", master_address=master.address)
    assert isinstance(store, MooncakeKVStore)
    try:
        store.register(memory, 1 << 20)
        store.put_from(["a"], [memory], [BLOCK])
        port = master.rpc_port
        kill(master)
        wait_state(store, BreakerState.OPEN)  # the probe noticed; no call had to
        calls = {"get": lambda: store.get_into(["a"], [memory + BLOCK], [BLOCK]),
                 "put": lambda: store.put_from(["b"], [memory], [BLOCK]),
                 "exists": lambda: store.exists(["a"]),
                 "remove": lambda: store.remove(["a"])}
        for name, call in calls.items():
            took, error = timed(call)
            assert isinstance(error, StoreUnavailableError), (name, error)
            assert "unavailable" in str(error) and took < FAST_S, (name, took)
        assert store.breaker.fast_failures >= len(calls)

        master = MooncakeMaster(rpc_port=port).start()
        wait_state(store, BreakerState.HALF_OPEN)
        deadline = time.monotonic() + 20
        while True:  # the client remounts its segment at the new master on its own
            took, error = timed(lambda: store.put_from(["c"], [memory], [BLOCK]))
            if error is None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert error is None, error
        assert store.breaker.state is BreakerState.CLOSED
        assert store.get_into(["c"], [memory + BLOCK], [BLOCK]) == [True]
    finally:
        store.close()
        master.stop()


def test_close_with_a_dead_master_is_bounded(memory: int) -> None:
    master = MooncakeMaster().start()
    store = create_kv_store("mooncake", master_address=master.address)
    store.register(memory, 1 << 20)
    kill(master)
    took, error = timed(store.close)  # before the probe noticed: close probes itself
    assert error is None and took < FAST_S * 2, took
    assert "closed" in repr(store)


def test_a_call_that_finds_the_master_dead_opens_the_breaker(memory: int) -> None:
    master = MooncakeMaster().start()
    store = create_kv_store("mooncake", master_address=master.address,
                            health_probe_interval_s=0)  # no probe: the call finds out
    try:
        store.register(memory, 1 << 20)
        kill(master)
        took, error = timed(lambda: store.get_into(["x"], [memory], [BLOCK]))
        assert isinstance(error, StoreUnavailableError), error
        # RPC_FAIL when the client sees the dead connection in time, else the call's bound.
        assert "RPC_FAIL" in str(error) or "did not finish within" in str(error), error
        assert took < FAST_S, took
        assert store.breaker.state is BreakerState.OPEN
        took, error = timed(lambda: store.exists(["x"]))
        assert isinstance(error, StoreUnavailableError) and took < FAST_S
    finally:
        store.close()


def test_a_frozen_master_fails_calls_within_a_second_and_recovery_closes_the_breaker(
        memory: int) -> None:
    """SIGSTOP: the kernel still accepts the master's connections, but nothing answers."""
    master = MooncakeMaster().start()
    store = create_kv_store("mooncake", master_address=master.address)
    assert isinstance(store, MooncakeKVStore)
    assert master.pid is not None
    value = bytes(range(256)) * (BLOCK // 256)
    ctypes.memmove(memory, value, BLOCK)
    try:
        store.register(memory, 1 << 20)
        store.put_from(["a"], [memory], [BLOCK])
        os.kill(master.pid, signal.SIGSTOP)
        late = memory + 2 * BLOCK  # the destination of a get the frozen master never answers
        took, error = timed(lambda: store.get_into(["a"], [late], [BLOCK]))
        assert isinstance(error, StoreUnavailableError), error
        assert took < FAST_S, took
        assert "did not finish within" in str(error)
        assert store.breaker.state is BreakerState.OPEN
        # The probe asks the master something: a frozen one keeps the breaker open.
        time.sleep(1.5)
        assert store.breaker.state is BreakerState.OPEN
        for call in (lambda: store.exists(["a"]), lambda: store.put_from(["b"], [memory],
                                                                          [BLOCK])):
            took, error = timed(call)
            assert isinstance(error, StoreUnavailableError) and took < FAST_S, (took, error)

        os.kill(master.pid, signal.SIGCONT)
        wait_state(store, BreakerState.HALF_OPEN)
        deadline = time.monotonic() + 20
        while True:
            took, error = timed(lambda: store.get_into(["a"], [memory + BLOCK], [BLOCK]))
            if error is None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert error is None, error
        assert store.breaker.state is BreakerState.CLOSED
        assert ctypes.string_at(memory + BLOCK, BLOCK) == value
        # The abandoned get returned once the master woke up: into memory kept aside, never
        # into the destination it was given up for.
        deadline = time.monotonic() + 10
        while store._calls.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store._calls.abandoned >= 1 and store._calls.late_returns >= 1
        assert ctypes.string_at(late, BLOCK) == bytes(BLOCK)
    finally:
        os.kill(master.pid, signal.SIGCONT)
        store.close()
        master.stop()


def test_a_frozen_master_opens_the_breaker_before_any_call(memory: int) -> None:
    master = MooncakeMaster().start()
    store = create_kv_store("mooncake", master_address=master.address)
    assert isinstance(store, MooncakeKVStore) and master.pid is not None
    try:
        store.register(memory, 1 << 20)
        os.kill(master.pid, signal.SIGSTOP)
        wait_state(store, BreakerState.OPEN, timeout_s=3.0)
        assert "probe RPC" in store.breaker.last_error
        os.kill(master.pid, signal.SIGCONT)
        wait_state(store, BreakerState.HALF_OPEN)
        store.put_from(["x"], [memory], [BLOCK])
        assert store.breaker.state is BreakerState.CLOSED
    finally:
        os.kill(master.pid, signal.SIGCONT)
        store.close()
        master.stop()


def test_a_remove_that_gives_up_on_a_read_lease_is_no_outage(memory: int) -> None:
    """The master answers every try of the remove with OBJECT_HAS_LEASE: the remove fails after
    remove_timeout_s (longer than the breaker's slow-call bound), but the breaker stays closed."""
    master = MooncakeMaster(default_kv_lease_ttl_ms=4000).start()
    store = create_kv_store("mooncake", master_address=master.address, remove_timeout_s=1.5)
    assert isinstance(store, MooncakeKVStore)
    try:
        store.register(memory, 1 << 20)
        store.put_from(["leased"], [memory], [BLOCK])
        assert store.get_into(["leased"], [memory + BLOCK], [BLOCK]) == [True]  # a read lease
        took, error = timed(lambda: store.remove(["leased"]))
        assert isinstance(error, StoreLeaseHeldError), error
        assert "read lease" in str(error) and took > store.breaker.slow_call_s
        assert store.breaker.state is BreakerState.CLOSED and store.breaker.times_opened == 0
        assert store.exists(["leased"]) == [True]  # not removed, and calls still go through
    finally:
        store.close()
        master.stop()


def test_a_remove_waiting_out_a_lease_holds_no_half_open_trial(memory: int) -> None:
    """After a frozen master wakes up, the half-open breaker's trial call may be a remove of a
    leased key. Its first try is answered (OBJECT_HAS_LEASE): that closes the breaker, and
    other calls go through while it waits out the lease, instead of failing fast for
    remove_timeout_s."""
    master = MooncakeMaster(default_kv_lease_ttl_ms=6000).start()
    store = create_kv_store("mooncake", master_address=master.address, remove_timeout_s=4.0)
    assert isinstance(store, MooncakeKVStore) and master.pid is not None
    try:
        store.register(memory, 1 << 20)
        store.put_from(["leased", "other"], [memory, memory], [BLOCK, BLOCK])
        assert store.get_into(["leased"], [memory + BLOCK], [BLOCK]) == [True]  # a read lease
        os.kill(master.pid, signal.SIGSTOP)
        wait_state(store, BreakerState.OPEN, timeout_s=3.0)
        os.kill(master.pid, signal.SIGCONT)
        wait_state(store, BreakerState.HALF_OPEN)

        removal: list[BaseException | None] = []
        remover = threading.Thread(target=lambda: removal.append(timed(
            lambda: store.remove(["leased"]))[1]))
        remover.start()  # the trial call
        time.sleep(0.3)
        _, error = timed(lambda: store.get_into(["other"], [memory + 2 * BLOCK], [BLOCK]))
        assert error is None, error  # not failed fast behind the remove's lease wait
        assert store.breaker.state is BreakerState.CLOSED
        assert remover.is_alive()  # still waiting out the lease meanwhile
        remover.join(10)
        assert removal and (removal[0] is None or isinstance(removal[0], StoreLeaseHeldError))
        assert store.breaker.state is BreakerState.CLOSED
    finally:
        os.kill(master.pid, signal.SIGCONT)
        store.close()
        master.stop()
