"""The soak's footprint splits each engine's resident memory by kind (kvo_tools.pd.footprint), so
a growth over a soak says whether heaps, mapped files or shared memory grew."""

from __future__ import annotations

import os
import subprocess
import sys

from kvo_tools.pd.footprint import footprint

CHILD = """
import mmap, sys
shared = mmap.mmap(-1, 64 << 20)      # shared anonymous memory, as kvo's bounce buffers
shared.write(b"x" * (64 << 20))
private = bytearray(b"y" * (32 << 20))  # anonymous heap memory
print("ready", flush=True)
sys.stdin.read()
"""


def test_the_footprint_counts_shared_and_anonymous_memory_of_the_group_apart() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        seen = footprint(os.getpgid(child.pid))
        assert seen["pids"] == 1
        assert seen["rss_shmem_bytes"] >= 64 << 20
        assert seen["rss_anon_bytes"] >= 32 << 20
        assert seen["rss_bytes"] == (seen["rss_anon_bytes"] + seen["rss_file_bytes"]
                                     + seen["rss_shmem_bytes"])
    finally:
        child.kill()
        child.wait()


def test_the_dev_shm_listing_names_every_file(tmp_path) -> None:
    """So that a soak's leftovers say whose they are (vLLM's psm_*, kvo's kvo-*)."""
    from kvo_tools.pd.footprint import shm_listing

    (tmp_path / "psm_1234abcd").write_bytes(b"x" * 100)
    (tmp_path / "sem.mp-xyz").write_bytes(b"y" * 32)
    assert shm_listing(str(tmp_path)) == {"files": 2, "bytes": 132,
                                          "names": ["psm_1234abcd", "sem.mp-xyz"]}
