"""The mooncake TransferEngine backend against a real Mooncake engine in a second process."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection

import attrs
import pytest
import torch
from _backend_workers import pattern, serve_region, worker_context
from hypothesis import given, settings
from hypothesis import strategies as st

from kvo_core.errors import ConfigError
from kvo_transport.engine import create_transfer_engine
from kvo_transport.errors import BackendUnavailableError, TransferArgumentError, TransferError
from kvo_transport.host_pool import HostPool
from kvo_transport.mooncake_engine import MooncakeTransferEngine

pytestmark = pytest.mark.needs_loopback_netns

PEER_BYTES = 4 << 20
PEER_SEED = 1234
BLOCK = 72 << 10  # one layer block of the target model (61 layers x 16 blocks in the bench)


@attrs.frozen
class Peer:
    conn: Connection
    process: mp.process.BaseProcess
    session_id: str
    base: int
    nbytes: int

    def bytes_at(self, offset: int, length: int) -> bytes:
        self.conn.send(("bytes", offset, length))
        return self.conn.recv()


def start_peer(nbytes: int = PEER_BYTES, seed: int = PEER_SEED) -> Peer:
    ctx = worker_context()
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=serve_region, args=(theirs, nbytes, seed), daemon=True)
    process.start()
    if not ours.poll(120):
        process.kill()
        pytest.fail("the peer process did not report its session id within 120 s")
    session_id, base, size = ours.recv()
    return Peer(ours, process, session_id, base, size)


def stop_peer(peer: Peer) -> None:
    if peer.process.is_alive():
        peer.conn.send(("stop",))
        peer.process.join(30)
    if peer.process.is_alive():
        peer.process.kill()
        peer.process.join()


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    started = start_peer()
    yield started
    stop_peer(started)


@pytest.fixture(scope="module")
def engine() -> Iterator[MooncakeTransferEngine]:
    made = create_transfer_engine("mooncake")
    assert isinstance(made, MooncakeTransferEngine)
    yield made
    made.close()


@pytest.fixture
def local() -> Iterator[torch.Tensor]:
    yield torch.zeros(PEER_BYTES, dtype=torch.uint8)


def test_session_id_is_loopback_host_and_rpc_port(engine: MooncakeTransferEngine) -> None:
    host, port = engine.session_id.split(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert engine.backend == "mooncake" and engine.protocol == "tcp"


def test_layer_batch_read_into_host_pool_is_byte_identical(
    engine: MooncakeTransferEngine, peer: Peer
) -> None:
    # 16 blocks of 72 KiB read from shuffled remote positions into a shared host pool.
    order = torch.randperm(PEER_BYTES // BLOCK, generator=torch.Generator().manual_seed(5))[:16]
    remote = [peer.base + int(b) * BLOCK for b in order]
    pool = HostPool.create(f"test-engine-{os.getpid()}", 16 * BLOCK)
    try:
        pool.register_with(engine)
        dest = pool.view(torch.uint8, (16 * BLOCK,))
        engine.read(peer.session_id, [pool.ptr + i * BLOCK for i in range(16)], remote,
                    [BLOCK] * 16)
        expected = pattern(PEER_SEED, PEER_BYTES)
        for i, b in enumerate(order.tolist()):
            assert torch.equal(dest[i * BLOCK : (i + 1) * BLOCK],
                               expected[b * BLOCK : (b + 1) * BLOCK]), f"block {i} differs"
    finally:
        pool.close()
    assert engine.raw_engine is not None  # the pool unregistered itself; the engine stays open


def test_write_lands_in_peer_memory(
    engine: MooncakeTransferEngine, peer: Peer, local: torch.Tensor
) -> None:
    payload = pattern(99, 3 * 4096)
    local[: payload.numel()].copy_(payload)
    engine.register(local.data_ptr(), local.numel())
    try:
        offsets = [0, 1 << 20, (3 << 20) + 17]
        engine.write(peer.session_id, [local.data_ptr() + i * 4096 for i in range(3)],
                     [peer.base + o for o in offsets], [4096] * 3)
        for i, offset in enumerate(offsets):
            got = peer.bytes_at(offset, 4096)
            assert got == payload[i * 4096 : (i + 1) * 4096].numpy().tobytes()
    finally:
        engine.unregister(local.data_ptr())
        peer.conn.send(("refill",))
        assert peer.conn.recv() == "ok"


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, PEER_BYTES - 1), st.integers(1, 200_000)),
                min_size=1, max_size=24))
def test_random_batches_arrive_intact(
    engine: MooncakeTransferEngine, peer: Peer, spans: list[tuple[int, int]]
) -> None:
    spans = [(start, min(length, PEER_BYTES - start)) for start, length in spans]
    total = sum(length for _, length in spans)
    dest = torch.zeros(total, dtype=torch.uint8)
    engine.register(dest.data_ptr(), total)
    try:
        offsets = [sum(length for _, length in spans[:i]) for i in range(len(spans))]
        engine.read(peer.session_id, [dest.data_ptr() + o for o in offsets],
                    [peer.base + start for start, _ in spans], [length for _, length in spans])
    finally:
        engine.unregister(dest.data_ptr())
    expected = pattern(PEER_SEED, PEER_BYTES)
    want = torch.cat([expected[start : start + length] for start, length in spans])
    assert torch.equal(dest, want)


# Destinations of batches that failed part-way: Mooncake reports the failure at the first failed
# slice while the others may still land, so their memory must outlive the engine. Freed, it
# was written after free (one CI run in ~25 crashed in malloc, and 1 in 200 such batches here
# was seen landing after read() raised).
_LATE_WRITE_TARGETS: list[torch.Tensor] = []


def test_unregistered_remote_range_raises_transfer_error(
    engine: MooncakeTransferEngine, peer: Peer
) -> None:
    local = torch.zeros(4096, dtype=torch.uint8)
    _LATE_WRITE_TARGETS.append(local)
    engine.register(local.data_ptr(), local.numel())
    try:
        with pytest.raises(TransferError, match=r"(?s)peer '127\.0\.0\.1:\d+', 2 descriptors"
                                                r".*may still land in the local ranges"):
            engine.read(peer.session_id, [local.data_ptr(), local.data_ptr() + 8],
                        [peer.base + peer.nbytes, peer.base], [8, 8])
    finally:
        engine.unregister(local.data_ptr())


def test_dead_peer_raises_transfer_error_naming_it(
    engine: MooncakeTransferEngine, local: torch.Tensor
) -> None:
    doomed = start_peer(1 << 20, seed=7)
    engine.register(local.data_ptr(), local.numel())
    try:
        engine.read(doomed.session_id, [local.data_ptr()], [doomed.base], [4096])
        assert local[:4096].numpy().tobytes() == pattern(7, 1 << 20)[:4096].numpy().tobytes()
        doomed.process.kill()
        doomed.process.join()
        with pytest.raises(TransferError, match=doomed.session_id):
            engine.read(doomed.session_id, [local.data_ptr()], [doomed.base], [4096])
    finally:
        engine.unregister(local.data_ptr())
        stop_peer(doomed)


@pytest.mark.parametrize(
    ("locals_", "remotes", "lengths", "message"),
    [
        ([0], [1, 2], [1], "differ in length"),
        ([], [], [], "empty transfer batch"),
        ([0], [4096], [0], r"length 0 is not > 0"),
        ([0], [4096], [-5], r"length -5 is not > 0"),
        ([PEER_BYTES - 8], [4096], [16], "not inside registered memory"),
        ([-1], [4096], [8], "not inside registered memory"),
        ([0], [0], [8], r"remote address 0x0 is not > 0"),
        ([0.5], [4096], [8], "sequence of integers"),
    ],
)
def test_bad_batches_are_refused_before_the_engine(
    engine: MooncakeTransferEngine, local: torch.Tensor, locals_: list[int], remotes: list[int],
    lengths: list[int], message: str,
) -> None:
    engine.register(local.data_ptr(), local.numel())
    try:
        base = local.data_ptr()
        shifted = [base + a if isinstance(a, int) and a >= 0 else a for a in locals_]
        with pytest.raises(TransferArgumentError, match=message):
            engine.read("127.0.0.1:1", shifted, remotes, lengths)
    finally:
        engine.unregister(local.data_ptr())


def test_peer_must_be_a_session_id(engine: MooncakeTransferEngine) -> None:
    with pytest.raises(TransferArgumentError, match="non-empty session id"):
        engine.read("", [1], [1], [1])


def test_registration_rules(engine: MooncakeTransferEngine, local: torch.Tensor) -> None:
    base = local.data_ptr()
    engine.register(base, 4096)
    try:
        with pytest.raises(TransferArgumentError, match="overlaps"):
            engine.register(base + 100, 4096)
        engine.register(base + 4096, 4096)  # adjacent is fine
        engine.unregister(base + 4096)
        with pytest.raises(TransferArgumentError, match="no registered region starts at"):
            engine.unregister(base + 1)
        with pytest.raises(TransferArgumentError, match="length must be > 0"):
            engine.register(base + 8192, 0)
    finally:
        engine.unregister(base)


def test_closed_engine_refuses_calls() -> None:
    closing = create_transfer_engine("mooncake")
    buf = torch.zeros(4096, dtype=torch.uint8)
    closing.register(buf.data_ptr(), 4096)
    closing.close()
    closing.close()  # idempotent
    with pytest.raises(TransferError, match="is closed"):
        closing.read("127.0.0.1:1", [buf.data_ptr()], [1], [8])


def test_factory_rejects_unknown_backend_and_options() -> None:
    with pytest.raises(ConfigError, match="'nccl' is not known; allowed: mooncake, memfabric"):
        create_transfer_engine("nccl")
    with pytest.raises(ConfigError, match=r"transfer engine option\(s\) \['prot'\]"):
        create_transfer_engine("mooncake", prot="tcp")
    with pytest.raises(ConfigError, match="protocol='udp' is not supported"):
        create_transfer_engine("mooncake", protocol="udp")


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'kvo-transport\[mooncake\]'"):
        create_transfer_engine("mooncake")
