"""The resident main-KV strategy (the seam the offload mode also implements): rows written at
vLLM's slots land in the paged cache, even a strided per-layer view of a shared allocation, and
come back per query token in top-k order, with padding marked invalid; the attention over them
is the reference's."""

from __future__ import annotations

import pytest
import torch

from kvo_core.config import SparseDecodeOffloadConfig
from kvo_core.errors import ConfigError
from kvo_kernels.reference.primitives import sparse_mla_attention
from kvo_vllm.dsa.main_kv import (
    LayerInfo,
    PagedMainKV,
    RowOverlay,
    SelectedRows,
    attend_rows,
    attend_selected,
    make_main_kv_access,
)

BLOCK, LATENT, ROPE = 4, 8, 4
WIDTH = LATENT + ROPE


def _layer(mode: str = "resident") -> LayerInfo:
    config = SparseDecodeOffloadConfig(top_k=3, block_size=BLOCK, hot_capacity=8, mode=mode)
    return LayerInfo(layer_name="model.layers.0.self_attn.attn", kv_lora_rank=LATENT,
                     rope_dim=ROPE, config=config)


class _Metadata:
    def __init__(self, block_table: torch.Tensor, token_request: torch.Tensor) -> None:
        self.block_table = block_table
        self.token_request = token_request


def test_rows_round_trip_through_a_strided_paged_cache() -> None:
    shared = torch.zeros(6, 2, BLOCK, WIDTH)  # two layers interleaved per block
    cache = shared[:, 1]                     # this layer's view: [6, BLOCK, WIDTH], strided
    assert not cache.is_contiguous()
    table = torch.tensor([[5, 2], [0, 3]], dtype=torch.int32)  # request -> blocks
    lengths = [6, 5]
    rows = {r: torch.randn(n, WIDTH) for r, n in enumerate(lengths)}
    strategy = PagedMainKV(_layer())
    for r, n in enumerate(lengths):
        positions = torch.arange(n)
        slots = table.long()[r, positions // BLOCK] * BLOCK + positions % BLOCK
        slots[1] = -1  # an unwritten slot (vLLM pads with -1) is skipped
        strategy.write(cache, rows[r], slots, None)
    assert torch.equal(shared[:, 0], torch.zeros(6, BLOCK, WIDTH))  # the other layer untouched
    topk = torch.tensor([[5, 0, -1], [4, 2, 3], [1, -1, -1]])
    metadata = _Metadata(table, torch.tensor([0, 1, 1]))
    selected = strategy.gather(cache, topk, metadata)
    assert selected.rows.shape == (3, 3, WIDTH)
    assert selected.valid.tolist() == [[True, True, False], [True, True, True],
                                       [True, False, False]]
    assert torch.equal(selected.rows[0, 0], rows[0][5])
    assert torch.equal(selected.rows[0, 1], rows[0][0])
    assert torch.equal(selected.rows[1], rows[1][[4, 2, 3]])
    assert torch.equal(selected.rows[2, 0], torch.zeros(WIDTH))  # position 1 was never written


def test_attention_over_gathered_rows_is_the_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 3, WIDTH, generator=generator)
    valid = torch.tensor([[True, False, True], [False, False, False]])
    query = torch.randn(2, 2, LATENT, generator=generator)
    query_rope = torch.randn(2, 2, ROPE, generator=generator)
    got = attend_rows(query, query_rope, rows, valid, LATENT, 0.3)
    cache = torch.cat([rows[0, [0, 2]], torch.randn(1, WIDTH, generator=generator)])
    want = sparse_mla_attention(query[:1], query_rope[:1], cache[:, :LATENT], cache[:, LATENT:],
                                torch.tensor([[0, 1]]), 0.3)
    torch.testing.assert_close(got[:1], want)
    assert torch.equal(got[1], torch.zeros(2, LATENT))  # nothing selected: zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_hot_slots_is_the_same_bits_as_over_gathered_rows(
        dtype: torch.dtype) -> None:
    """The offload decode step hands attention a hot buffer and slots instead of a gathered
    copy: the same rows in the same order, so identical output (not merely close)."""
    generator = torch.Generator().manual_seed(1)
    hot = torch.randn(12, WIDTH, generator=generator).to(dtype)
    slots = torch.tensor([[7, 2, -1, 11], [-1, -1, -1, -1], [0, 0, 5, 3]])
    query = torch.randn(3, 2, LATENT, generator=generator).to(dtype)
    query_rope = torch.randn(3, 2, ROPE, generator=generator).to(dtype)
    selected = SelectedRows(rows=hot, valid=slots >= 0, slots=slots)
    rows, valid = selected.materialized()
    assert torch.equal(rows[slots >= 0], hot[slots[slots >= 0]])
    got = attend_selected(query, query_rope, selected, LATENT, 0.3)
    want = attend_rows(query, query_rope, rows, valid, LATENT, 0.3)
    assert torch.equal(got, want)
    assert torch.equal(attend_selected(query, query_rope, SelectedRows(rows=rows, valid=valid),
                                       LATENT, 0.3), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_two_caches_is_the_same_bits_as_over_gathered_rows(
        dtype: torch.dtype) -> None:
    """A mixed offload step: prefill tokens read the pool by slot, decode tokens (the
    overlay) the hot buffer; the same rows in the same order as the gathered copy, so the
    same output bits."""
    generator = torch.Generator().manual_seed(2)
    pool = torch.randn(20, WIDTH, generator=generator).to(dtype)
    hot = torch.randn(12, WIDTH, generator=generator).to(dtype)
    pool_slots = torch.tensor([[7, 2, 0, 19], [0, 0, 0, 0], [4, 4, 9, 3], [1, 0, 0, 0]])
    valid = torch.tensor([[True, True, False, True], [True, True, True, False],
                          [True, True, True, True], [True, False, False, False]])
    overlay = RowOverlay(tokens=torch.tensor([1, 3]), rows=hot,
                         slots=torch.tensor([[11, 0, 5, 0], [6, 0, 0, 0]]))
    query = torch.randn(4, 2, LATENT, generator=generator).to(dtype)
    query_rope = torch.randn(4, 2, ROPE, generator=generator).to(dtype)
    selected = SelectedRows(rows=pool, valid=valid, slots=pool_slots, overlay=overlay)
    rows, _ = selected.materialized()
    assert torch.equal(rows[0], pool[[7, 2, 0, 19]]) and torch.equal(rows[2], pool[[4, 4, 9, 3]])
    assert torch.equal(rows[1], hot[[11, 0, 5, 0]]) and torch.equal(rows[3], hot[[6, 0, 0, 0]])
    got = attend_selected(query, query_rope, selected, LATENT, 0.3)
    assert torch.equal(got, attend_rows(query, query_rope, rows, valid, LATENT, 0.3))


def test_make_main_kv_access_follows_the_mode() -> None:
    assert isinstance(make_main_kv_access(_layer()), PagedMainKV)
    with pytest.raises(ConfigError, match="mode"):
        make_main_kv_access(LayerInfo(layer_name="x", kv_lora_rank=LATENT, rope_dim=ROPE,
                                      config=_bad_mode_config()))


def _bad_mode_config() -> SparseDecodeOffloadConfig:
    config = SparseDecodeOffloadConfig(top_k=3, block_size=BLOCK, hot_capacity=8)
    object.__setattr__(config, "mode", "remote")  # bypass validation: the factory checks too
    return config


def _written_cache(cache: torch.Tensor, table: torch.Tensor, lengths: list[int],
                   seed: int) -> dict[int, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    rows = {r: torch.randn(n, WIDTH, generator=generator) for r, n in enumerate(lengths)}
    strategy = PagedMainKV(_layer())
    for r, n in enumerate(lengths):
        positions = torch.arange(n)
        slots = table.long()[r, positions // BLOCK] * BLOCK + positions % BLOCK
        strategy.write(cache, rows[r], slots, None)
    return rows


@pytest.mark.parametrize("layout", ["own allocation", "layer-major shared allocation"])
def test_an_evenly_spaced_cache_is_read_by_slot_with_the_same_bits(layout: str) -> None:
    """A layer cache whose rows are evenly spaced (its own tensor, or one layer's contiguous
    part of a layer-major allocation, at a storage offset) is answered as a flat view plus
    slots, never copied; attention over it gives the bits of attention over gathered rows."""
    if layout == "own allocation":
        cache = torch.zeros(6, BLOCK, WIDTH)
    else:
        cache = torch.zeros(2, 6, BLOCK, WIDTH)[1]
        assert cache.storage_offset() > 0
    table = torch.tensor([[5, 2], [0, 3]], dtype=torch.int32)
    rows = _written_cache(cache, table, [7, 5], seed=2)
    topk = torch.tensor([[5, 0, -1, 6], [4, 2, 3, 0], [1, -1, -1, -1]])
    metadata = _Metadata(table, torch.tensor([0, 1, 1]))
    selected = PagedMainKV(_layer()).gather(cache, topk, metadata)
    assert selected.slots is not None
    assert selected.rows.data_ptr() == cache.data_ptr()  # a view of vLLM's cache, no copy
    assert selected.slots.tolist()[0][2] == -1 and selected.slots.tolist()[2][1:] == [-1] * 3
    gathered, valid = selected.materialized()
    assert torch.equal(valid, topk >= 0)
    assert torch.equal(gathered[0, [0, 1, 3]], rows[0][[5, 0, 6]])
    assert torch.equal(gathered[1], rows[1][[4, 2, 3, 0]])
    assert torch.equal(gathered[2, 0], rows[1][1])

    generator = torch.Generator().manual_seed(3)
    query = torch.randn(3, 2, LATENT, generator=generator)
    query_rope = torch.randn(3, 2, ROPE, generator=generator)
    got = attend_selected(query, query_rope, selected, LATENT, 0.3)
    want = attend_rows(query, query_rope, gathered, valid, LATENT, 0.3)
    assert torch.equal(got, want)


def test_an_interleaved_cache_is_gathered_as_a_copy() -> None:
    cache = torch.zeros(6, 2, BLOCK, WIDTH)[:, 0]  # rows of two layers interleaved per block
    table = torch.tensor([[5, 2]], dtype=torch.int32)
    rows = _written_cache(cache, table, [6], seed=4)
    selected = PagedMainKV(_layer()).gather(cache, torch.tensor([[5, 1, -1]]),
                                            _Metadata(table, torch.tensor([0])))
    assert selected.slots is None
    assert torch.equal(selected.rows[0, :2], rows[0][[5, 1]])
