"""The host-pool row allocator and pool sizing of the sparse decode engine (pure logic)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvo_core.errors import ConfigError
from kvo_transport.host_pool import PAGE_SIZE
from kvo_vllm.sparse import RowRange, RowRangeAllocator, SparseModelLayout, plan_pool
from kvo_vllm.sparse.host_store import pool_bytes_for

BLOCK = 16
TOTAL = 40

operations = st.lists(st.tuples(st.booleans(), st.integers(1, 12 * BLOCK), st.integers(0, 99)),
                      max_size=60)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_ranges_never_overlap_and_free_space_is_conserved(ops: list) -> None:
    allocator = RowRangeAllocator(TOTAL, BLOCK)
    held: list[RowRange] = []
    for allocate, rows, pick in ops:
        if allocate or not held:
            taken = allocator.allocate(rows)
            largest = allocator.largest_free_rows
            if taken is None:
                assert largest < rows  # refused only when no contiguous run fits
                continue
            assert taken.rows == -(-rows // BLOCK) * BLOCK and taken.start % BLOCK == 0
            assert 0 <= taken.start and taken.end <= TOTAL * BLOCK
            assert all(taken.end <= h.start or h.end <= taken.start for h in held)
            held.append(taken)
        else:
            allocator.free(held.pop(pick % len(held)))
        assert allocator.free_rows == TOTAL * BLOCK - sum(h.rows for h in held)
    for taken in held:
        allocator.free(taken)
    assert allocator.largest_free_rows == TOTAL * BLOCK  # neighbours merged back into one run


def test_first_fit_is_deterministic_and_reuses_freed_ranges() -> None:
    allocator = RowRangeAllocator(8, BLOCK)
    a, b, c = (allocator.allocate(n) for n in (2 * BLOCK, 3 * BLOCK, BLOCK))
    assert (a.start, b.start, c.start) == (0, 2 * BLOCK, 5 * BLOCK)
    allocator.free(a)
    assert allocator.allocate(BLOCK + 1) == RowRange(0, 2 * BLOCK)
    assert allocator.allocate(3 * BLOCK) is None  # 2 blocks free at the end only
    with pytest.raises(ConfigError, match="freed twice"):
        allocator.free(c)
        allocator.free(c)


def test_pool_plan_fits_the_bytes_and_refuses_a_pool_without_one_block() -> None:
    layout = SparseModelLayout(num_layers=3, latent_dim=512, rope_dim=64, index_dim=128,
                               softmax_scale=0.1)
    for rows in (1, 128, 5000, 32768 * 16):
        nbytes = pool_bytes_for(rows, layout, 128)
        plan = plan_pool(nbytes, layout, 128)
        assert plan.total_rows >= rows
        assert plan.header_bytes % PAGE_SIZE == 0
        assert plan.header_bytes + plan.total_rows * layout.host_bytes_per_token <= nbytes
    with pytest.raises(ConfigError, match="host_pool_bytes must hold at least one block"):
        plan_pool(PAGE_SIZE, layout, 128)


def test_layout_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="latent_dim must be an integer >= 1, got 0"):
        SparseModelLayout(num_layers=1, latent_dim=0, rope_dim=1, index_dim=1,
                          softmax_scale=1.0)
    with pytest.raises(ConfigError, match="kv_dtype must be one of"):
        SparseModelLayout(num_layers=1, latent_dim=1, rope_dim=1, index_dim=1,
                          softmax_scale=1.0, kv_dtype=torch.int8)


SMALL_SHM_STORE = """
import sys
from kvo_transport.errors import HostPoolError
from kvo_vllm.sparse import SparseModelLayout
from kvo_vllm.sparse.host_store import HostKVStore, pool_bytes_for
layout = SparseModelLayout(num_layers=3, latent_dim=512, rope_dim=64, index_dim=128,
                           softmax_scale=0.1)
try:
    HostKVStore.create("test-small-shm-store", pool_bytes_for(8192, layout, 64), layout, 64)
except HostPoolError as exc:
    print("ERROR:", exc)
    sys.exit(3)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounting a small tmpfs in a private mount namespace needs root "
                           "and util-linux unshare")
def test_a_host_store_larger_than_dev_shm_names_the_setting_that_sizes_it() -> None:
    """The sparse offload's host pool in an 8 MiB /dev/shm: a clean error at create naming
    kvo_sparse.host_pool_bytes, not a SIGBUS when the rows are first written."""
    shell = ("mount -t tmpfs -o size=8M tmpfs /dev/shm && "
             f"exec {shlex.quote(sys.executable)} -c {shlex.quote(SMALL_SHM_STORE)}")
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "make the pool smaller (additional_config.kvo_sparse.host_pool_bytes, or " \
           "max_num_seqs x max_model_len when it is unset)" in done.stdout
