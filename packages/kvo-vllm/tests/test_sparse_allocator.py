"""The decode host pool's sizing and its layout's checks (pure logic)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from kvo_core.errors import ConfigError
from kvo_transport.host_pool import PAGE_SIZE
from kvo_vllm.sparse import SparseModelLayout, plan_pool
from kvo_vllm.sparse.host_store import pool_bytes_for


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
