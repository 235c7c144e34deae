"""The mooncake KVStore backend against a real mooncake_master and real store clients."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from _backend_workers import pattern, put_into_store, worker_context

from kvo_core.errors import ConfigError
from kvo_transport.errors import BackendUnavailableError, StoreArgumentError, StoreError
from kvo_transport.mooncake_master import MooncakeMaster
from kvo_transport.mooncake_store import MooncakeKVStore
from kvo_transport.store import create_kv_store

pytestmark = pytest.mark.needs_loopback_netns

BLOCK = 64 << 10
BUFFER = 64 * BLOCK


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    with MooncakeMaster() as running:
        yield running


@pytest.fixture(scope="module")
def store(master: MooncakeMaster) -> Iterator[MooncakeKVStore]:
    client = create_kv_store("mooncake", master_address=master.address)
    assert isinstance(client, MooncakeKVStore)
    yield client
    client.close()


@pytest.fixture
def buf(store: MooncakeKVStore) -> Iterator[torch.Tensor]:
    tensor = torch.zeros(BUFFER, dtype=torch.uint8)
    store.register(tensor.data_ptr(), tensor.numel())
    yield tensor
    store.unregister(tensor.data_ptr())


def slot(buf: torch.Tensor, i: int) -> int:
    return buf.data_ptr() + i * BLOCK


def block(buf: torch.Tensor, i: int) -> torch.Tensor:
    return buf[i * BLOCK : (i + 1) * BLOCK]


def test_put_get_exists_remove_round_trip(store: MooncakeKVStore, buf: torch.Tensor) -> None:
    keys = ["rt/a", "rt/b", "rt/c"]
    for i in range(3):
        block(buf, i).copy_(pattern(10 + i, BLOCK))
    store.put_from(keys, [slot(buf, i) for i in range(3)], [BLOCK] * 3)
    assert store.exists([*keys, "rt/absent"]) == [True, True, True, False]
    found = store.get_into(["rt/c", "rt/absent", "rt/a"], [slot(buf, 10), slot(buf, 11),
                           slot(buf, 12)], [BLOCK] * 3)
    assert found == [True, False, True]
    assert torch.equal(block(buf, 10), pattern(12, BLOCK))
    assert torch.equal(block(buf, 12), pattern(10, BLOCK))
    store.remove([*keys, "rt/absent"])  # inside the read lease: remove waits it out
    assert store.exists(keys) == [False, False, False]
    assert store.get_into(["rt/a"], [slot(buf, 10)], [BLOCK]) == [False]


def test_a_key_named_twice_in_one_get_fills_both_destinations(
        store: MooncakeKVStore, buf: torch.Tensor) -> None:
    """Mooncake's own batch get reports success for both but writes one destination."""
    block(buf, 0).copy_(pattern(31, BLOCK))
    store.put_from(["dup/a"], [slot(buf, 0)], [BLOCK])
    for i in (20, 21, 22):
        block(buf, i).fill_(0)
    found = store.get_into(["dup/a", "dup/absent", "dup/a"],
                           [slot(buf, 20), slot(buf, 21), slot(buf, 22)], [BLOCK] * 3)
    assert found == [True, False, True]
    assert torch.equal(block(buf, 20), pattern(31, BLOCK))
    assert torch.equal(block(buf, 22), pattern(31, BLOCK))
    assert not block(buf, 21).any()
    store.remove(["dup/a"])


def test_put_overwrites_an_existing_key(store: MooncakeKVStore, buf: torch.Tensor) -> None:
    block(buf, 0).copy_(pattern(1, BLOCK))
    store.put_from(["ow/k"], [slot(buf, 0)], [BLOCK])
    block(buf, 0).copy_(pattern(2, BLOCK))
    store.put_from(["ow/k"], [slot(buf, 0)], [BLOCK])
    assert store.get_into(["ow/k"], [slot(buf, 5)], [BLOCK]) == [True]
    assert torch.equal(block(buf, 5), pattern(2, BLOCK))  # the new value, not the first
    store.remove(["ow/k"])


def test_values_put_by_another_process_are_readable(
    master: MooncakeMaster, store: MooncakeKVStore, buf: torch.Tensor
) -> None:
    ctx = worker_context()
    ours, theirs = ctx.Pipe()
    keys = [f"xp/{i}" for i in range(4)]
    writer = ctx.Process(target=put_into_store, args=(theirs, master.address, keys, 77))
    writer.start()
    try:
        assert ours.poll(120), "the writer process did not finish its put"
        assert ours.recv() == "stored"
        assert store.get_into(keys, [slot(buf, i) for i in range(4)], [BLOCK] * 4) == [True] * 4
        assert torch.equal(buf[: 4 * BLOCK], pattern(77, 4 * BLOCK))
        store.remove(keys)
    finally:
        ours.send("stop")
        writer.join(60)
        if writer.is_alive():
            writer.kill()
    assert writer.exitcode == 0


def test_size_mismatch_on_get_is_an_error_naming_the_key(
    store: MooncakeKVStore, buf: torch.Tensor
) -> None:
    store.put_from(["sz/k"], [slot(buf, 0)], [BLOCK])
    try:
        with pytest.raises(StoreError, match="sz/k"):
            store.get_into(["sz/k"], [slot(buf, 1)], [BLOCK // 2])
        with pytest.raises(StoreError, match=f"stored value has {BLOCK} bytes, destination has"):
            store.get_into(["sz/k"], [slot(buf, 1)], [2 * BLOCK])
    finally:
        store.remove(["sz/k"])


@pytest.mark.parametrize(
    ("keys", "offsets", "lengths", "message"),
    [
        (["a", "a"], [0, 1], [8, 8], r"keys repeat within one batch: \['a'\]"),
        (["a"], [0, 1], [8], "batch lists differ in length"),
        ([""], [0], [8], "key 0 must be a non-empty str"),
        (["a"], [BUFFER - 4], [8], "not inside registered memory"),
        (["a"], [0], [0], "length 0 is not > 0"),
    ],
)
def test_bad_puts_are_refused_before_the_store(
    store: MooncakeKVStore, buf: torch.Tensor, keys: list[str], offsets: list[int],
    lengths: list[int], message: str,
) -> None:
    with pytest.raises(StoreArgumentError, match=message):
        store.put_from(keys, [buf.data_ptr() + o for o in offsets], lengths)


def test_keys_must_be_a_sequence_not_a_string(store: MooncakeKVStore) -> None:
    with pytest.raises(StoreArgumentError, match="not one str"):
        store.exists("abc")


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="master_address is required"):
        create_kv_store("mooncake")
    with pytest.raises(ConfigError, match="must be host:port"):
        create_kv_store("mooncake", master_address="localhost")
    with pytest.raises(ConfigError, match=r"size=1048576 must be an int >= 16777216"):
        create_kv_store("mooncake", master_address="127.0.0.1:1", global_segment_size=1 << 20)
    with pytest.raises(ConfigError, match=r"unknown mooncake store option\(s\) \['segment'\]"):
        create_kv_store("mooncake", master_address="127.0.0.1:1", segment=1)
    with pytest.raises(ConfigError, match="'redis' is not known; allowed: mooncake, memcache"):
        create_kv_store("redis")
    for bad in (-1, True, "1", 601):
        with pytest.raises(ConfigError, match=rf"call_timeout_s={bad!r} must be between 0 and "
                                              rf"600 seconds \(0: unbounded calls\)"):
            create_kv_store("mooncake", master_address="127.0.0.1:1", call_timeout_s=bad)


@pytest.mark.parametrize("call_timeout_s", [0, 5.0], ids=["direct", "bounded"])
def test_bounded_and_direct_calls_move_the_same_bytes(master: MooncakeMaster,
                                                      buf: torch.Tensor,
                                                      call_timeout_s: float) -> None:
    store = create_kv_store("mooncake", master_address=master.address,
                            call_timeout_s=call_timeout_s)
    try:
        base = buf.data_ptr()
        store.register(base, buf.numel())
        buf[:8192] = torch.randint(0, 256, (8192,), dtype=torch.uint8)
        keys = [f"bounded-{call_timeout_s}-{i}" for i in range(2)]
        store.put_from(keys, [base, base + 4096], [4096, 4096])
        assert store.get_into([keys[1], "absent", keys[0]],
                              [base + 16384, base + 20480, base + 24576],
                              [4096, 4096, 4096]) == [True, False, True]
        assert bytes(buf[16384:20480].tolist()) == bytes(buf[4096:8192].tolist())
        assert bytes(buf[24576:28672].tolist()) == bytes(buf[:4096].tolist())
        assert store.exists([*keys, "absent"]) == [True, True, False]
        store.remove(keys)
        assert store.exists(keys) == [False, False]
    finally:
        store.close()


@pytest.mark.parametrize("call_timeout_s", [0, 5.0], ids=["direct", "bounded"])
def test_a_put_stores_the_copy_settle_saw_and_leaves_out_the_keys_it_names(
        master: MooncakeMaster, buf: torch.Tensor, call_timeout_s: float) -> None:
    """What the layerwise saver relies on to never publish torn bytes: the value stored is
    the copy taken before ``settle`` ran, however the ranges change after (even for an
    unbounded call, which otherwise reads the caller's memory during the transfer); the keys
    ``settle`` names are not stored at all."""
    store = create_kv_store("mooncake", master_address=master.address,
                            call_timeout_s=call_timeout_s)
    try:
        base = buf.data_ptr()
        store.register(base, buf.numel())
        keys = [f"settle-{call_timeout_s}-{i}" for i in range(3)]
        for i in range(3):
            block(buf, i).copy_(pattern(30 + i, BLOCK))

        def settle() -> list[str]:
            for i in range(3):  # the ranges are overwritten once the copy is taken
                block(buf, i).fill_(0xEE)
            return [keys[1]]

        store.put_from(keys, [slot(buf, i) for i in range(3)], [BLOCK] * 3, settle=settle)
        assert store.exists(keys) == [True, False, True]
        assert store.get_into([keys[0], keys[2]], [slot(buf, 10), slot(buf, 12)],
                              [BLOCK] * 2) == [True, True]
        assert torch.equal(block(buf, 10), pattern(30, BLOCK))
        assert torch.equal(block(buf, 12), pattern(32, BLOCK))
        called: list[bool] = []
        store.put_from([], [], [], settle=lambda: called.append(True) or [])
        assert called == [True]  # an empty put still settles
        store.remove([keys[0], keys[2]])
    finally:
        store.close()


def test_closed_store_refuses_calls(master: MooncakeMaster) -> None:
    client = create_kv_store("mooncake", master_address=master.address)
    client.close()
    client.close()
    with pytest.raises(StoreError, match="is closed"):
        client.exists(["k"])


def test_master_reports_its_address_and_stops() -> None:
    master = MooncakeMaster()
    assert master.address == f"127.0.0.1:{master.rpc_port}"
    with master:
        assert master.is_running()
        pid = master.pid
        assert pid is not None
    assert not master.is_running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped: the pid no longer exists


def test_master_that_dies_at_start_reports_its_output() -> None:
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"(?s)exited with code \d+ before.*no_such_flag"):
        MooncakeMaster(extra_args=["--no_such_flag=1"]).start()
    assert time.monotonic() - started < 30


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'kvo-transport\[mooncake\]'"):
        create_kv_store("mooncake", master_address="127.0.0.1:1")
