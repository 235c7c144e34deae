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
