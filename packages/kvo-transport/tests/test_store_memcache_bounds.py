"""Memcache store calls are bounded like Mooncake's (bounded_calls.py).

Memcache's data path needs an Ascend driver, so these tests run kvo's MemcacheKVStore over a
stand-in client (``StandInClient``: a dict of values that copies bytes to and from the
addresses it is given, and can be frozen like an unanswering MetaService). They test kvo's own
logic: the per-call bound, the breaker, and that a late call only ever touches bounce memory.
Not tested here: Memcache itself.
"""

from __future__ import annotations

import ctypes
import socket
import threading
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from kvo_transport import memcache_store
from kvo_transport.circuit_breaker import BreakerState
from kvo_transport.errors import StoreUnavailableError
from kvo_transport.memcache_store import MemcacheKVStore

BOUND_S = 0.3
SIZE = 4096


class StandInClient:
    """What kvo calls of memcache_hybrid's DistributedObjectStore; ``frozen`` holds every
    data-path call until cleared. Records each address range it was handed."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.answering = threading.Event()
        self.answering.set()
        self.registered: dict[int, int] = {}
        self.touched: list[tuple[int, int]] = []
        self.returned = threading.Event()

    def setup(self, config: Any) -> int:
        return 0

    def init(self, device_id: int) -> int:
        return 0

    def close(self) -> int:
        return 0

    def register_buffer(self, ptr: int, length: int) -> int:
        self.registered[ptr] = length
        return 0

    def unregister_buffer(self, ptr: int, length: int) -> int:
        self.registered.pop(ptr, None)
        return 0

    def _wait(self) -> None:
        self.answering.wait()

    def batch_put_from(self, keys: Sequence[str], addrs: Sequence[int],
                       lengths: Sequence[int]) -> list[int]:
        self._wait()
        for key, addr, length in zip(keys, addrs, lengths, strict=True):
            self.touched.append((addr, length))
            self.values[key] = ctypes.string_at(addr, length)
        return [0] * len(keys)

    def batch_get_into(self, keys: Sequence[str], addrs: Sequence[int],
                       lengths: Sequence[int]) -> list[int]:
        self._wait()
        codes = []
        for key, addr, length in zip(keys, addrs, lengths, strict=True):
            value = self.values.get(key)
            if value is None or len(value) != length:
                codes.append(-1)
                continue
            self.touched.append((addr, length))
            ctypes.memmove(addr, value, length)
            codes.append(0)
        self.returned.set()
        return codes

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        self._wait()
        return [int(key in self.values) for key in keys]

    def remove_batch(self, keys: Sequence[str]) -> None:
        self._wait()
        for key in keys:
            self.values.pop(key, None)


@pytest.fixture
def urls() -> Iterator[dict[str, str]]:
    """Two loopback listeners standing in for the MetaService's ports (the store checks that
    they accept connections before its set-up)."""
    listeners = []
    for _ in range(2):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listeners.append(listener)
    yield {"meta_service_url": f"tcp://127.0.0.1:{listeners[0].getsockname()[1]}",
           "config_store_url": f"tcp://127.0.0.1:{listeners[1].getsockname()[1]}"}
    for listener in listeners:
        listener.close()


def open_store(monkeypatch: pytest.MonkeyPatch, urls: dict[str, str], call_timeout_s: float
               ) -> tuple[MemcacheKVStore, StandInClient]:
    monkeypatch.setattr(memcache_store, "_process_config", None)  # one config per process
    client = StandInClient()
    memcache = types.SimpleNamespace(DistributedObjectStore=lambda: client,
                                     LocalConfig=types.SimpleNamespace)
    memfabric = types.SimpleNamespace(set_extern_logger=lambda logger: None)
    store = MemcacheKVStore(modules=(memcache, memfabric), call_timeout_s=call_timeout_s,
                            **urls)
    return store, client


def buffer(fill: int) -> tuple[ctypes.Array[ctypes.c_char], int]:
    memory = ctypes.create_string_buffer(bytes([fill]) * SIZE, SIZE)
    return memory, ctypes.addressof(memory)


@pytest.mark.parametrize("call_timeout_s", [0, 5.0], ids=["direct", "bounded"])
def test_bounded_and_direct_calls_move_the_same_bytes(monkeypatch, urls,
                                                      call_timeout_s: float) -> None:
    store, client = open_store(monkeypatch, urls, call_timeout_s)
    _source, source_ptr = buffer(7)
    dest, dest_ptr = buffer(0)
    store.register(source_ptr, SIZE)
    store.register(dest_ptr, SIZE)
    store.put_from(["a", "b"], [source_ptr, source_ptr + 100], [100, 200])
    assert store.exists(["a", "b", "c"]) == [True, True, False]
    assert store.get_into(["b", "a", "c"], [dest_ptr, dest_ptr + 1000, dest_ptr + 2000],
                          [200, 100, 50]) == [True, True, False]
    assert dest.raw[:200] == bytes([7]) * 200 and dest.raw[1000:1100] == bytes([7]) * 100
    assert dest.raw[2000:2050] == bytes(50)  # a missing key writes nothing
    store.remove(["a"])
    assert store.exists(["a", "b"]) == [False, True]
    caller = range(dest_ptr, dest_ptr + SIZE)
    handed_caller_memory = any(addr in caller for addr, _ in client.touched)
    assert handed_caller_memory == (call_timeout_s == 0)  # bounded: only bounce memory
    store.close()


def test_a_frozen_service_fails_a_call_within_the_bound_and_the_late_get_never_writes_the_caller(
        monkeypatch, urls) -> None:
    store, client = open_store(monkeypatch, urls, BOUND_S)
    _source, source_ptr = buffer(9)
    dest, dest_ptr = buffer(0)
    store.register(source_ptr, SIZE)
    store.register(dest_ptr, SIZE)
    store.put_from(["k"], [source_ptr], [SIZE])
    client.returned.clear()

    client.answering.clear()  # the MetaService stops answering
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=r"get of 1 keys did not finish within 0.3 s"):
        store.get_into(["k"], [dest_ptr], [SIZE])
    assert time.monotonic() - started < BOUND_S + 0.5
    assert store.breaker.state is BreakerState.OPEN
    with pytest.raises(StoreUnavailableError, match="failing fast"):
        store.exists(["k"])  # refused at once while the breaker is open

    client.answering.set()  # it answers again: the abandoned get completes late
    assert client.returned.wait(5)
    time.sleep(0.1)
    assert dest.raw == bytes(SIZE), "the abandoned get wrote the caller's destination"
    time.sleep(store.breaker.retry_after_s)
    assert store.get_into(["k"], [dest_ptr], [SIZE]) == [True]  # the trial call closes it
    assert dest.raw == bytes([9]) * SIZE
    assert store.breaker.state is BreakerState.CLOSED
    store.close()
