"""The decode host pool's layout header, as a TP rank that attaches to rank 0's pool sees it."""

from __future__ import annotations

import os
import uuid

import attrs
import pytest
import torch

from kvo_vllm.sparse import (
    HostKVStore,
    SparseModelLayout,
    TensorParallelError,
    pool_bytes_for,
)

SMALL = SparseModelLayout(num_layers=2, latent_dim=8, rope_dim=4, index_dim=4,
                          softmax_scale=0.25, kv_dtype=torch.float32)


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
