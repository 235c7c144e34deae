"""The decode host pool's sizing and its layout's checks (pure logic)."""

from __future__ import annotations

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
