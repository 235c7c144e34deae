"""The decode host pool's sizing and layout header (pure logic plus one shared-memory pool)."""

from __future__ import annotations

import os
import uuid

import attrs
import pytest
import torch

from kvo_core.errors import ConfigError
from kvo_transport.host_pool import PAGE_SIZE
from kvo_vllm.sparse import (
    HostKVStore,
    SparseModelLayout,
    TensorParallelError,
    plan_pool,
    pool_bytes_for,
)

SMALL = SparseModelLayout(num_layers=2, latent_dim=8, rope_dim=4, index_dim=4,
                          softmax_scale=0.25, kv_dtype=torch.float32)


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


@pytest.mark.parametrize("rope_apart", [False, True])
def test_an_attaching_rank_sees_rank_0s_rows_and_refuses_another_layout(
        rope_apart: bool) -> None:
    """A TP rank > 0 attaches by name and reads the rows rank 0 wrote; one with another model
    layout, block size or rope placement fails at once, naming the fields that differ."""
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    nbytes = pool_bytes_for(64, SMALL, 16)
    owner = HostKVStore.create(name, nbytes, SMALL, 16, rope_apart=rope_apart)
    try:
        owner.latent(1)[5] = torch.arange(8, dtype=torch.float32)
        reader = HostKVStore.attach(name, SMALL, 16, rope_apart=rope_apart)
        try:
            assert torch.equal(reader.latent(1)[5], torch.arange(8, dtype=torch.float32))
        finally:
            reader.close()
        wrong = [((attrs.evolve(SMALL, latent_dim=16), 16, rope_apart), "row_dim"),
                 ((SMALL, 32, rope_apart), "block_size"),
                 ((SMALL, 16, not rope_apart), "rope_apart")]
        for (layout, block_size, apart), field in wrong:
            with pytest.raises(TensorParallelError,
                               match=f"created for another layout.*'{field}'"):
                HostKVStore.attach(name, layout, block_size, rope_apart=apart)
    finally:
        owner.close()
