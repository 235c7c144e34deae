"""HostPool: named POSIX shared memory shared between processes, freed on close and exit."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _backend_workers import (
    create_pool_and_exit,
    hold_pool,
    pattern,
    worker_context,
    write_pool,
)

from kvo_transport.errors import HostPoolError, TransferArgumentError
from kvo_transport.host_pool import (
    PAGE_SIZE,
    HostPool,
    leaked_segments,
    reclaim_orphaned_pools,
    shm_path,
)
from kvo_transport.regions import RegionRegistry


def unique(tag: str) -> str:
    return f"test-{tag}-{os.getpid()}"


def mapped(path: Path) -> bool:
    """Whether this process still maps the file (per /proc/self/maps)."""
    return str(path) in Path("/proc/self/maps").read_text()


def spawn(target: object, *args: object) -> tuple[mp.connection.Connection, mp.Process]:
    ctx = worker_context()
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=target, args=(theirs, *args))
    process.start()
    return ours, process


def test_creator_and_attacher_in_two_processes_see_each_others_writes() -> None:
    nbytes = 3 * PAGE_SIZE
    with HostPool.create(unique("share"), nbytes) as pool:
        half = nbytes // 2
        pool.view(torch.uint8, (half,)).copy_(pattern(1, half))
        conn, process = spawn(write_pool, pool.name, half, 2, half)
        assert conn.poll(120), "the attaching process did not answer"
        their_size, their_view = conn.recv()
        process.join(30)
        assert process.exitcode == 0
        assert their_size == pool.nbytes
        assert their_view == pattern(1, half).numpy().tobytes()  # reader saw the writer's bytes
        assert torch.equal(pool.view(torch.uint8, (half,), half), pattern(2, half))
        assert pool.path.exists()  # the attacher's close did not unlink it
    assert not pool.path.exists()


def test_pool_is_page_aligned_and_rounded_to_pages() -> None:
    with HostPool.create(unique("align"), 1000) as pool:
        assert pool.ptr % PAGE_SIZE == 0
        assert pool.nbytes == PAGE_SIZE
        assert pool.is_creator
        assert os.stat(pool.path).st_size == PAGE_SIZE
        assert torch.count_nonzero(pool.view(torch.uint8, (PAGE_SIZE,))) == 0


def test_views_have_the_requested_dtype_shape_and_offset() -> None:
    with HostPool.create(unique("views"), 4 * PAGE_SIZE) as pool:
        floats = pool.view(torch.float32, (4, 8), offset_bytes=64)
        floats.fill_(1.5)
        raw = pool.view(torch.uint8, (4 * PAGE_SIZE,))
        assert torch.count_nonzero(raw[:64]) == 0
        assert torch.equal(raw[64 : 64 + 128].view(torch.float32), torch.full((32,), 1.5))
        assert floats.data_ptr() == pool.ptr + 64
        bf16 = pool.view(torch.bfloat16, (2, 3), offset_bytes=2)
        assert bf16.shape == (2, 3) and bf16.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("dtype", "shape", "offset", "message"),
    [
        (torch.uint8, (PAGE_SIZE + 1,), 0, "exceeds the pool's"),
        (torch.float32, (4,), 2, "multiple of the torch.float32 item size 4"),
        (torch.uint8, (4,), -4, "must be >= 0"),
        (torch.uint8, (-1, 4), 0, "negative dimension"),
    ],
)
def test_bad_views_are_refused(
    dtype: torch.dtype, shape: tuple[int, ...], offset: int, message: str
) -> None:
    with HostPool.create(unique("badview"), PAGE_SIZE) as pool:
        with pytest.raises(HostPoolError, match=message):
            pool.view(dtype, shape, offset)


def test_attach_errors_name_the_pool() -> None:
    missing = unique("missing")
    with pytest.raises(HostPoolError, match=f"host pool '{missing}' does not exist"):
        HostPool.attach(missing)
    with HostPool.create(unique("size"), 2 * PAGE_SIZE) as pool:
        with pytest.raises(HostPoolError, match=f"has {2 * PAGE_SIZE} bytes, expected {PAGE_SIZE}"):
            HostPool.attach(pool.name, nbytes=100)
        with HostPool.attach(pool.name, nbytes=2 * PAGE_SIZE - 5) as same:
            assert not same.is_creator and same.nbytes == pool.nbytes
        with pytest.raises(HostPoolError, match="already exists"):
            HostPool.create(pool.name, PAGE_SIZE)


@pytest.mark.parametrize("name", ["", "a/b", "../etc", "-x", "x" * 201, "sp ace"])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(HostPoolError, match="is not allowed"):
        shm_path(name)


@pytest.mark.parametrize("nbytes", [0, -1, 2.5, True])
def test_bad_sizes_are_refused(nbytes: object) -> None:
    with pytest.raises(HostPoolError, match="nbytes must be a positive int"):
        HostPool.create(unique("badsize"), nbytes)  # type: ignore[arg-type]


def test_close_unmaps_and_unlinks() -> None:
    pool = HostPool.create(unique("close"), PAGE_SIZE)
    path = pool.path
    assert mapped(path)
    pool.close()
    gc.collect()
    assert not path.exists()
    assert not mapped(path)
    assert pool.closed
    with pytest.raises(HostPoolError, match="is closed"):
        pool.view(torch.uint8, (1,))
    pool.close()  # idempotent


def test_a_view_alive_after_close_keeps_its_memory_valid() -> None:
    pool = HostPool.create(unique("alive"), PAGE_SIZE)
    view = pool.view(torch.int64, (4,))
    view.copy_(torch.arange(4))
    pool.close()
    assert not pool.path.exists()  # the name is gone at once ...
    assert view.tolist() == [0, 1, 2, 3]  # ... but the view never dangles
    path = pool.path
    del view
    gc.collect()
    assert not mapped(path)


@pytest.mark.parametrize("close", [True, False])
def test_segment_does_not_outlive_its_creating_process(close: bool) -> None:
    conn, process = spawn(create_pool_and_exit, unique(f"exit-{close}"), close)
    assert conn.poll(120)
    path = Path(conn.recv())
    process.join(60)
    assert process.exitcode == 0
    assert not path.exists()


def test_a_killed_creators_segment_is_reclaimed_by_the_next_create(caplog) -> None:
    name = unique("killed")
    conn, process = spawn(hold_pool, name, True)
    assert conn.poll(120)
    path = Path(conn.recv())
    process.kill()  # SIGKILL: no close, no atexit, no finalizer
    process.join(30)
    assert path.exists()  # leaked, as a crashed run leaves it
    with caplog.at_level("WARNING", logger="kvo.transport.host_pool"):
        with HostPool.create(name, PAGE_SIZE) as pool:
            assert pool.nbytes == PAGE_SIZE
            assert torch.count_nonzero(pool.view(torch.uint8, (16,))) == 0  # a fresh segment
    assert "left behind by a run that ended without closing it" in caplog.text
    assert not path.exists()


def test_a_segment_still_in_use_is_not_reclaimed() -> None:
    name = unique("in-use")
    conn, creator = spawn(hold_pool, name, True)
    assert conn.poll(120)
    path = Path(conn.recv())
    attach_conn, attacher = spawn(hold_pool, name, False)
    try:
        assert attach_conn.poll(120)
        creator.kill()  # the creator is gone, but a TP rank still maps the pool
        creator.join(30)
        with pytest.raises(HostPoolError, match=rf"in use by process\(es\) \[{attacher.pid}\]"):
            HostPool.create(name, PAGE_SIZE)
        assert path.exists()
    finally:
        attacher.kill()
        attacher.join(30)
        path.unlink(missing_ok=True)


def test_register_with_an_engine_and_unregister_on_close() -> None:
    registry = RegionRegistry()  # records exactly what an engine's register/unregister receive

    class Recorder:
        def register(self, ptr: int, length: int) -> None:
            registry.add(ptr, length)

        def unregister(self, ptr: int) -> None:
            registry.remove(ptr)

    pool = HostPool.create(unique("reg"), 2 * PAGE_SIZE)
    pool.register_with(Recorder())
    assert [(r.ptr, r.length) for r in registry.regions()] == [(pool.ptr, pool.nbytes)]
    with pytest.raises(TransferArgumentError, match="overlaps"):
        pool.register_with(Recorder())
    pool.close()
    assert len(registry) == 0


def test_leaked_segments_lists_only_kvo_pools() -> None:
    with HostPool.create(unique("list"), PAGE_SIZE) as pool:
        assert pool.path.name in leaked_segments()
    assert pool.path.name not in leaked_segments()


def test_orphans_of_other_names_are_swept_only_when_nobody_holds_them(caplog) -> None:
    """A per-process pool name (the DSA backend's) is never created again: the sweep is what
    frees a killed server's segment. Held and freshly created segments are left alone."""
    conn, killed = spawn(hold_pool, unique("orphan"), True)
    assert conn.poll(120)
    orphan = Path(conn.recv())
    killed.kill()
    killed.join(30)
    held = shm_path(unique("held"))
    held_conn, holder = spawn(hold_pool, unique("held"), True)
    try:
        assert held_conn.poll(120)
        assert Path(held_conn.recv()) == held
        assert orphan.name not in reclaim_orphaned_pools()     # too young for the default
        assert orphan.exists()
        with caplog.at_level("WARNING", logger="kvo.transport.host_pool"):
            removed = reclaim_orphaned_pools(min_age_s=0)
        assert orphan.name in removed and not orphan.exists()
        assert held.name not in removed and held.exists()      # its creator still runs
        assert f"removed {orphan}" in caplog.text
    finally:
        holder.kill()
        holder.join(30)
        held.unlink(missing_ok=True)


SMALL_SHM_SCRIPT = """
import sys
from kvo_transport.errors import HostPoolError
from kvo_transport.host_pool import HostPool
try:
    pool = HostPool.create("test-small-shm", 32 * 2**20, sized_by="the_test_setting")
except HostPoolError as exc:
    print("ERROR:", exc)
    sys.exit(3)
pool.view(torch.uint8, (pool.nbytes,)).fill_(1)  # touches every page: SIGBUS on a short tmpfs
print("CREATED", pool.nbytes)
"""


def _in_small_shm(script: str, size: str = "8M") -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a private mount namespace whose /dev/shm is a ``size`` tmpfs."""
    shell = (f"mount -t tmpfs -o size={size} tmpfs /dev/shm && "
             f"exec {shlex.quote(sys.executable)} -c {shlex.quote('import torch' + script)}")
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounting a small tmpfs in a private mount namespace needs root "
                           "and util-linux unshare")
def test_a_pool_larger_than_dev_shm_fails_at_create_naming_the_numbers() -> None:
    result = _in_small_shm(SMALL_SHM_SCRIPT)
    assert result.returncode == 3, (result.returncode, result.stdout, result.stderr)  # no SIGBUS
    message = result.stdout
    assert f"needs {32 * 2**20} bytes" in message
    assert "free of 8388608" in message  # the tmpfs's size, in bytes
    assert "make the pool smaller (the_test_setting)" in message and "--shm-size" in message
    # the failed create left nothing behind in the small /dev/shm
    check = _in_small_shm(SMALL_SHM_SCRIPT.replace("32 * 2**20", "4 * 2**20"))
    assert check.returncode == 0 and f"CREATED {4 * 2**20}" in check.stdout, check.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounting a small tmpfs in a private mount namespace needs root "
                           "and util-linux unshare")
def test_pages_taken_after_the_size_check_still_fail_the_create_cleanly() -> None:
    """The free-space check passes, then another pool takes the room: reserving the pages
    (not a later touch) is what fails."""
    script = SMALL_SHM_SCRIPT.replace(
        "try:\n", "import kvo_transport.host_pool as hp\nhp.os.statvfs = lambda _p: "
        "(_ for _ in ()).throw(OSError('no statvfs'))\ntry:\n", 1)
    result = _in_small_shm(script)
    assert result.returncode == 3, (result.returncode, result.stdout, result.stderr)
    assert "reserving its pages failed: no space" in result.stdout
    assert "an unknown number of bytes free" in result.stdout
