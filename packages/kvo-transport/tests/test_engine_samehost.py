"""SameHostEngine: direct process_vm_readv/writev copies to a real second process, Mooncake
(a real engine) for every peer it cannot reach that way."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
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
from kvo_transport.errors import TransferArgumentError, TransferError
from kvo_transport.samehost_engine import (
    IOV_MAX,
    MARK,
    SameHostEngine,
    host_key,
    split_session_id,
    start_time,
)

pytestmark = pytest.mark.needs_loopback_netns

PEER_BYTES = 4 << 20
PEER_SEED = 4321


@attrs.frozen
class Peer:
    conn: Connection
    process: mp.process.BaseProcess
    session_id: str
    base: int

    def bytes_at(self, offset: int, length: int) -> bytes:
        self.conn.send(("bytes", offset, length))
        return bytes(self.conn.recv())


def start_peer(same_host: bool) -> Peer:
    ctx = worker_context()
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=serve_region, args=(theirs, PEER_BYTES, PEER_SEED, same_host),
                          daemon=True)
    process.start()
    if not ours.poll(120):
        process.kill()
        pytest.fail("the peer process did not report its session id within 120 s")
    session_id, base, _ = ours.recv()
    return Peer(ours, process, session_id, base)


def stop_peer(peer: Peer) -> None:
    if peer.process.is_alive():
        peer.conn.send(("stop",))
        peer.process.join(30)
    if peer.process.is_alive():
        peer.process.kill()
        peer.process.join()


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    started = start_peer(same_host=True)
    yield started
    stop_peer(started)


@pytest.fixture(scope="module")
def engine() -> Iterator[SameHostEngine]:
    made = SameHostEngine(create_transfer_engine("mooncake"))
    yield made
    made.close()


@pytest.fixture
def local(engine: SameHostEngine) -> Iterator[torch.Tensor]:
    buffer = torch.zeros(PEER_BYTES, dtype=torch.uint8)
    engine.register(buffer.data_ptr(), buffer.numel())
    yield buffer
    engine.unregister(buffer.data_ptr())


def expected(offset: int, length: int) -> torch.Tensor:
    return pattern(PEER_SEED, PEER_BYTES)[offset : offset + length]


def test_session_id_extends_the_inner_one(engine: SameHostEngine) -> None:
    inner, address = split_session_id(engine.session_id)
    assert inner == engine.inner.session_id and inner.startswith("127.0.0.1:")
    assert address is not None and address.pid == os.getpid()
    assert address.start == start_time(os.getpid()) and address.registry.exists()
    assert (engine.backend, engine.protocol) == ("mooncake", "tcp")  # handshakes unchanged


def test_a_same_host_peer_is_read_directly_and_byte_identical(
    engine: SameHostEngine, peer: Peer, local: torch.Tensor
) -> None:
    assert engine.direct_to(peer.session_id)
    offsets = [0, 1 << 20, (3 << 20) + 17]
    engine.read(peer.session_id, [local.data_ptr() + i * 8192 for i in range(3)],
                [peer.base + o for o in offsets], [8192] * 3)
    for i, offset in enumerate(offsets):
        assert torch.equal(local[i * 8192 : (i + 1) * 8192], expected(offset, 8192))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, PEER_BYTES - 1), st.integers(1, 200_000)),
                min_size=1, max_size=24))
def test_random_batches_arrive_intact(
    engine: SameHostEngine, peer: Peer, spans: list[tuple[int, int]]
) -> None:
    dest = torch.zeros(sum(n for _, n in spans) + 1, dtype=torch.uint8)
    clipped = [(o, min(n, PEER_BYTES - o)) for o, n in spans]
    engine.register(dest.data_ptr(), dest.numel())
    try:
        locals_, at = [], 0
        for _, n in clipped:
            locals_.append(dest.data_ptr() + at)
            at += n
        engine.read(peer.session_id, locals_, [peer.base + o for o, _ in clipped],
                    [n for _, n in clipped])
        at = 0
        for o, n in clipped:
            assert torch.equal(dest[at : at + n], expected(o, n))
            at += n
        assert dest[at:].eq(0).all()  # nothing beyond the batch
    finally:
        engine.unregister(dest.data_ptr())


def test_more_descriptors_than_one_system_call_takes(
    engine: SameHostEngine, peer: Peer, local: torch.Tensor
) -> None:
    n, size = IOV_MAX * 2 + 5, 512
    remote = [peer.base + ((i * 7919) % (PEER_BYTES // size)) * size for i in range(n)]
    engine.read(peer.session_id, [local.data_ptr() + i * size for i in range(n)], remote,
                [size] * n)
    for i in (0, IOV_MAX - 1, IOV_MAX, n - 1):
        assert torch.equal(local[i * size : (i + 1) * size],
                           expected(remote[i] - peer.base, size)), f"descriptor {i}"


def test_write_lands_in_peer_memory(
    engine: SameHostEngine, peer: Peer, local: torch.Tensor
) -> None:
    payload = pattern(7, 2 * 4096)
    local[: payload.numel()].copy_(payload)
    try:
        engine.write(peer.session_id, [local.data_ptr(), local.data_ptr() + 4096],
                     [peer.base + 4096, peer.base + (2 << 20)], [4096, 4096])
        assert peer.bytes_at(4096, 4096) == payload[:4096].numpy().tobytes()
        assert peer.bytes_at(2 << 20, 4096) == payload[4096:].numpy().tobytes()
    finally:
        peer.conn.send(("refill",))
        assert peer.conn.recv() == "ok"


def test_unregistered_remote_range_is_refused_before_any_copy(
    engine: SameHostEngine, peer: Peer, local: torch.Tensor
) -> None:
    local.fill_(0xAB)
    with pytest.raises(TransferArgumentError, match=r"descriptor 1: remote range .* not inside "
                       r"memory that peer pid \d+ registered"):
        engine.read(peer.session_id, [local.data_ptr(), local.data_ptr() + 4096],
                    [peer.base, peer.base + PEER_BYTES - 100], [4096, 4096])
    assert local[:8192].eq(0xAB).all()


def test_unregistered_local_range_is_refused(engine: SameHostEngine, peer: Peer) -> None:
    stray = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(TransferArgumentError, match="not inside registered memory"):
        engine.read(peer.session_id, [stray.data_ptr()], [peer.base], [4096])


def test_a_range_the_peer_unmapped_fails_the_copy_naming_the_descriptor(
    engine: SameHostEngine, peer: Peer, local: torch.Tensor
) -> None:
    # A registry that claims a range the peer never mapped (as if it freed a registered buffer):
    # the kernel copies the first descriptor, then fails; the error names the second.
    _, address = split_session_id(peer.session_id)
    assert address is not None
    forged = address.registry.with_name(address.registry.name + "-forged")
    unmapped = 0x10000
    forged.write_text(json.dumps([[peer.base, PEER_BYTES], [unmapped, 1 << 16]]))
    try:
        session = peer.session_id.replace(address.registry.name, forged.name)
        with pytest.raises(TransferError, match=r"failed at descriptor 1 .*short copy"):
            engine.read(session, [local.data_ptr(), local.data_ptr() + 4096],
                        [peer.base, unmapped], [4096, 4096])
        assert torch.equal(local[:4096], expected(0, 4096))
    finally:
        forged.unlink()


def test_a_reused_pid_or_another_host_goes_to_the_inner_engine(
    engine: SameHostEngine, peer: Peer, local: torch.Tensor
) -> None:
    inner, address = split_session_id(peer.session_id)
    assert address is not None
    stale = f"{inner}{MARK}{address.host}/{address.pid}/{address.start + 1}/{address.registry.name}"
    other_host = "f" * 32 + ".1"
    elsewhere = f"{inner}{MARK}{other_host}/{address.pid}/{address.start}/{address.registry.name}"
    for session in (stale, elsewhere):
        assert not engine.direct_to(session)
        local.zero_()
        engine.read(session, [local.data_ptr()], [peer.base + 123], [4096])  # through Mooncake
        assert torch.equal(local[:4096], expected(123, 4096))


def test_a_peer_without_the_same_host_part_is_served_by_the_inner_engine(
    engine: SameHostEngine, local: torch.Tensor
) -> None:
    plain = start_peer(same_host=False)
    try:
        assert MARK not in plain.session_id and not engine.direct_to(plain.session_id)
        engine.read(plain.session_id, [local.data_ptr()], [plain.base + 5], [10_000])
        assert torch.equal(local[:10_000], expected(5, 10_000))
    finally:
        stop_peer(plain)


def test_a_dead_peer_is_not_read_directly() -> None:
    gone = start_peer(same_host=True)
    stop_peer(gone)
    with SameHostEngine(create_transfer_engine("mooncake")) as engine:
        assert not engine.direct_to(gone.session_id)
        buffer = torch.zeros(4096, dtype=torch.uint8)
        engine.register(buffer.data_ptr(), 4096)
        with pytest.raises(TransferError):
            engine.read(gone.session_id, [buffer.data_ptr()], [gone.base], [4096])


def test_malformed_same_host_part_is_refused(engine: SameHostEngine) -> None:
    with pytest.raises(TransferArgumentError, match="malformed same-host part"):
        engine.read(f"127.0.0.1:1{MARK}x/notapid/1/kvo-samehost-a", [1], [1], [1])
    with pytest.raises(TransferArgumentError, match="malformed same-host part"):
        engine.read(f"127.0.0.1:1{MARK}x/1/1/../etc/passwd", [1], [1], [1])


def test_close_removes_the_registry_and_refuses_calls() -> None:
    engine = SameHostEngine(create_transfer_engine("mooncake"))
    _, address = split_session_id(engine.session_id)
    assert address is not None and address.registry.exists()
    engine.close()
    assert not address.registry.exists()
    with pytest.raises(TransferError, match="closed"):
        engine.register(1, 1)


def test_the_factory_wraps_mooncake_only() -> None:
    with create_transfer_engine("mooncake", same_host=True) as made:
        assert isinstance(made, SameHostEngine)
    with pytest.raises(ConfigError, match="same_host=True is for the mooncake backend"):
        create_transfer_engine("memfabric", same_host=True)


def test_a_library_engine_reads_a_same_host_peer_through_mooncake(
    peer: Peer, local: torch.Tensor
) -> None:
    # An engine without the direct path (e.g. device memory) addresses the peer by the inner id.
    with create_transfer_engine("mooncake") as plain:
        plain.register(local.data_ptr(), local.numel())
        local.zero_()
        plain.read(peer.session_id, [local.data_ptr()], [peer.base + 77], [5000])
        assert torch.equal(local[:5000], expected(77, 5000))
        plain.unregister(local.data_ptr())


def test_a_killed_process_registry_is_removed_by_the_next_engine() -> None:
    dead = start_peer(same_host=True)
    _, address = split_session_id(dead.session_id)
    assert address is not None and address.registry.exists()
    dead.process.kill()  # no close: the file stays behind
    dead.process.join()
    assert address.registry.exists()
    SameHostEngine(create_transfer_engine("mooncake")).close()
    assert not address.registry.exists()


def test_the_host_key_names_boot_pid_and_network_namespace() -> None:
    boot, pid_ns, net_ns = host_key().split(".")
    assert len(boot) == 32 and int(boot, 16) >= 0
    assert int(pid_ns) == os.stat("/proc/self/ns/pid").st_ino
    assert int(net_ns) == os.stat("/proc/self/ns/net").st_ino  # netns-separated "hosts" differ


FULL_SHM_SCRIPT = """
import ctypes, json, os, sys
from kvo_transport.engine import create_transfer_engine
from kvo_transport.errors import TransferError
from kvo_transport.samehost_engine import SameHostEngine
engine = SameHostEngine(create_transfer_engine("mooncake"))
memory = ctypes.create_string_buffer(1 << 16)
free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
filler = os.open("/dev/shm/filler", os.O_CREAT | os.O_WRONLY, 0o600)
os.posix_fallocate(filler, 0, free)
report = {}
try:
    engine.register(ctypes.addressof(memory), 1 << 16)
except TransferError as error:
    report["error"] = str(error)
report["files_when_full"] = sorted(os.listdir("/dev/shm"))
registry = [f for f in report["files_when_full"] if f.startswith("kvo-samehost-")]
report["listed_when_full"] = json.load(open("/dev/shm/" + registry[0]))
os.close(filler)
os.unlink("/dev/shm/filler")
engine.register(ctypes.addressof(memory), 1 << 16)
report["listed_after"] = json.load(open("/dev/shm/" + registry[0]))
report["address"] = ctypes.addressof(memory)
engine.close()
print(json.dumps(report))
"""


def test_a_full_dev_shm_fails_registration_with_an_error_naming_it_and_leaves_nothing_behind(
        ) -> None:
    """A real tmpfs of 64 KiB on /dev/shm (a private mount namespace), filled to the last
    byte: registering memory fails with an error naming /dev/shm and its free bytes, the region
    list peers read keeps its previous content, no half-written file stays, and registration
    works once there is room again."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a mount namespace with a small tmpfs on /dev/shm)")
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size=64k kvo-test-shm /dev/shm && exec {sys.executable} -c "
         f"'{FULL_SHM_SCRIPT}'"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "/dev/shm" in report["error"] and "No space left on device" in report["error"]
    assert "0 bytes free in /dev/shm" in report["error"]
    assert not [f for f in report["files_when_full"] if f.endswith(".tmp")]
    assert report["listed_when_full"] == []  # the previous list (nothing registered yet)
    assert report["listed_after"] == [[report["address"], 1 << 16]]
