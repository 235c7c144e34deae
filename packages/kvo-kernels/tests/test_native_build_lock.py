"""A build lock left by a builder that died is removed; a fresh one (a build running) is kept."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvo_kernels.native_build import STALE_LOCK_S, reclaim_stale_lock


def test_a_lock_older_than_any_build_is_removed(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert reclaim_stale_lock(tmp_path)
    assert not lock.exists()


def test_a_fresh_lock_is_kept(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    assert not reclaim_stale_lock(tmp_path)
    assert lock.exists()
    assert reclaim_stale_lock(tmp_path, now=time.time() + STALE_LOCK_S + 1)


def test_no_lock_is_fine(tmp_path: Path) -> None:
    assert not reclaim_stale_lock(tmp_path)


def test_a_built_op_loads_while_a_fresh_lock_is_held(tmp_path: Path) -> None:
    """A process that only loads the built op never waits on the build lock (PyTorch's own
    load would wait on it for ever: a killed process leaves it behind)."""
    import subprocess
    import sys

    import pytest

    from kvo_kernels.native_build import build_directory, extension_name, load_native_ops

    try:
        load_native_ops()  # built now if this machine has not built it yet
    except Exception as error:  # no compiler here: nothing to load either
        pytest.skip(f"native op cannot be built here: {error}")
    lock = build_directory() / extension_name() / "lock"
    lock.touch()
    try:
        code = ("from kvo_kernels.native_build import load_native_ops; "
                "print(hasattr(load_native_ops(), 'residency_update'))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=True)
    finally:
        lock.unlink(missing_ok=True)
    assert done.stdout.strip() == "True"
