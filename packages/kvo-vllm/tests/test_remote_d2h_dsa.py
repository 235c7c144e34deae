"""RemoteD2H's own logic for DSA layouts: how vLLM's caches are grouped into parts, how a pull
into the offload host pool reaches residency, and how an indexer layout mismatch is named."""

from __future__ import annotations

import uuid

import pytest
import torch

from kvo_core.config import RemoteD2HConfig
from kvo_core.errors import ConfigError
from kvo_core.tp import MainShare
from kvo_vllm.dsa.indexer_cache import describe_indexer_block
from kvo_vllm.dsa.offload_manager import OffloadManager
from kvo_vllm.remote_d2h.connector import refuse_untested_dsa
from kvo_vllm.remote_d2h.decode_worker import (
    DecodePuller,
    main_share,
    refuse_untested_dsa_decode_tp,
)
from kvo_vllm.remote_d2h.kv_caches import describe_kv_caches
from kvo_vllm.remote_d2h.pool_destination import PoolDestination
from kvo_vllm.remote_d2h.stats_file import rank_stats_path
from kvo_vllm.sparse.layout import SparseModelLayout

BLOCKS = 6
BS = 4


def _main(blocks: int = BLOCKS) -> torch.Tensor:
    return torch.zeros(blocks, BS, 12)


def _indexer(row_bytes: int = 16, blocks: int = BLOCKS) -> torch.Tensor:
    return torch.zeros(blocks, BS, row_bytes, dtype=torch.uint8)


def _dsa_caches(layers: int = 2, row_bytes: int = 16) -> dict[str, torch.Tensor]:
    caches = {}
    for i in range(layers):
        caches[f"model.layers.{i}.self_attn.indexer.k_cache"] = _indexer(row_bytes)
        caches[f"model.layers.{i}.self_attn.attn"] = _main()
    return caches


def test_dsa_caches_group_into_main_and_indexer_parts() -> None:
    layout = describe_kv_caches(_dsa_caches())
    assert [layer.name for layer in layout.layers] == [
        "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert [layer.indexer_name for layer in layout.layers] == [
        "model.layers.0.self_attn.indexer.k_cache", "model.layers.1.self_attn.indexer.k_cache"]
    assert layout.main_block_bytes == BS * 12 * 4 and layout.indexer_block_bytes == BS * 16
    assert layout.has_indexer
    assert [part for part, _ in layout.layers[0].tensors()] == ["kv", "idx"]
    assert len(layout.spans()) == 4
    dense = describe_kv_caches({"model.layers.0.self_attn.attn": _main()})
    assert not dense.has_indexer and dense.indexer_block_bytes is None


@pytest.mark.parametrize(("caches", "message"), [
    ({"model.layers.0.self_attn.indexer.k_cache": _indexer()},
     r"layer 0 has an indexer cache .* but no attention KV cache"),
    ({**_dsa_caches(1), "model.layers.1.self_attn.attn": _main()},
     r"an indexer cache on every layer or on none; layers \[0\] of 2"),
    ({**_dsa_caches(1), "model.layers.1.self_attn.attn": _main(),
      "model.layers.1.self_attn.indexer.k_cache": _indexer(row_bytes=8)},
     r"one block size for every layer's indexer cache, got \[32, 64\]"),
    ({**_dsa_caches(1), "model.layers.1.self_attn.attn": _main(blocks=5),
      "model.layers.1.self_attn.indexer.k_cache": _indexer(blocks=5)},
     r"same number of blocks in every cache .* got \[5, 6\]"),
    ({"model.layers.1.self_attn.attn": _main()}, r"layers 0..N-1; vLLM registered layers \[1\]"),
    ({"model.layers.0.self_attn.attn": torch.zeros(BLOCKS, 12, BS).transpose(1, 2)},
     "a KV block is not one contiguous run"),
])
def test_layouts_it_cannot_move_are_refused(caches: dict[str, torch.Tensor],
                                            message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        describe_kv_caches(caches)


def test_a_dsa_handoff_with_a_drafter_other_than_mtp_is_refused() -> None:
    class Speculative:
        def __init__(self, method: str) -> None:
            self.method = method

    with pytest.raises(ConfigError, match=r"method 'mtp' only, got 'ngram'"):
        refuse_untested_dsa(_dsa_caches(), Speculative("ngram"))
    refuse_untested_dsa(_dsa_caches(), Speculative("mtp"))   # shown: test_pd_dsa_mtp.py
    refuse_untested_dsa(_dsa_caches(), None)   # a DSA layout without speculation passes
    refuse_untested_dsa({"model.layers.0.self_attn.attn": _main()}, Speculative("ngram"))


def test_a_dsa_decode_above_the_tested_tp_is_refused_naming_its_tp() -> None:
    puller = DecodePuller(config=RemoteD2HConfig(kv_port=29000), tp_rank=0, tp_size=4,
                          dp_rank=0)
    try:
        with pytest.raises(ConfigError, match=r"decode with TP 4; tested up to decode TP 2"):
            puller.register_kv_caches(_dsa_caches())
    finally:
        puller.close()


def test_decode_tp_refusal_lets_tested_and_dense_layouts_through() -> None:
    refuse_untested_dsa_decode_tp(has_indexer=True, tp_size=2)
    refuse_untested_dsa_decode_tp(has_indexer=False, tp_size=4)


def test_ranks_share_the_main_kv_only_when_it_lands_in_the_shared_pool() -> None:
    pool = PoolDestination(region=(4096, 64), bases={}, block_bytes=8, num_blocks=8,
                           note_pulled=lambda blocks: None)
    assert main_share(pool, 1, 2) == MainShare(2, 1)
    assert main_share(None, 1, 2) == MainShare()


def test_indexer_block_sizes_are_named_by_layout() -> None:
    assert "bfloat16 keys" in describe_indexer_block(64 * 256, 64, 128)
    assert "C8: int8 keys" in describe_indexer_block(64 * 132, 64, 128)
    assert "unknown indexer layout" in describe_indexer_block(64 * 100, 64, 128)


def _manager() -> OffloadManager:
    layout = SparseModelLayout(num_layers=2, latent_dim=8, rope_dim=4, index_dim=4,
                               softmax_scale=1.0, kv_dtype=torch.float32)
    return OffloadManager(layout, num_blocks=8, block_size=BS, max_rows=2,
                          max_blocks_per_row=4, top_k=4, capacity=8, decode_query_rows=1,
                          pool_name=f"t-pull-{uuid.uuid4().hex[:8]}")


@pytest.mark.parametrize("noted", [True, False])
def test_pulled_blocks_are_seen_as_written_by_residency(noted: bool) -> None:
    """Request A decodes in batch row 0 over blocks 1, 2, 3 and finishes; B's prompt is pulled
    into the same blocks (written past ``write``) and B decodes in row 0. Only if the pull is
    noted does B read its own rows; otherwise residency serves A's hot copies (the hazard)."""
    manager = _manager()
    try:
        table = torch.tensor([[1, 2, 3, 0]])
        qsl = torch.tensor([0, 1])
        slots = torch.tensor([table[0, p // BS].item() * BS + p % BS for p in range(12)])
        a_rows = torch.arange(12 * 12, dtype=torch.float32).reshape(12, 12)
        b_rows = -a_rows - 1.0
        topk = torch.tensor([[0, 3, 5, 7]])
        for layer in range(2):
            manager.write(layer, a_rows[:9], slots[:9])
            out, _ = manager.gather(layer, topk, qsl, torch.tensor([9]), table)
            assert torch.equal(out[0], a_rows[[0, 3, 5, 7]])
        for layer in range(2):  # the pull: whole blocks 1 and 2 of every layer
            manager.pool_layer(layer)[slots[:8]] = b_rows[:8]
        if noted:
            manager.note_blocks_written([1, 2, -1])
        for layer in range(2):  # B's first decode step: its token 8, then attention
            manager.write(layer, b_rows[8:9], slots[8:9])
            out, _ = manager.gather(layer, topk, qsl, torch.tensor([9]), table)
            want = b_rows if noted else a_rows
            assert torch.equal(out[0], want[[0, 3, 5, 7]])
            assert manager.stats.last[layer].misses == (4 if noted else 0)
        with pytest.raises(ValueError, match="block 8 is outside the pool's 8 blocks"):
            manager.note_blocks_written([8])
    finally:
        manager.close()



def test_each_tp_rank_writes_its_own_stats_file() -> None:
    assert rank_stats_path("/tmp/d.json", 0) == "/tmp/d.json"
    assert rank_stats_path("/tmp/d.json", 1) == "/tmp/d.json.tp1"
    assert rank_stats_path(None, 1) is None
