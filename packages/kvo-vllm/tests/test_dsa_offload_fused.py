"""``kernel_backend="fused"`` at the manager: the fused ops' layer output equals the non-fused
path's on the same inputs.

Two managers see the same writes, through the fake scheduler of ``test_dsa_offload_manager``
(requests joining, finishing, preempted, moving between batch rows, chunked prefill, two query
rows with a rejected draft). The non-fused one gets its top-k from kvo-kernels' reference
indexer (``indexer_scores`` + ``topk_indices``) and attends with ``attend_rows``; the fused one
gets the indexer operands and runs ``lightning_indexer_manage`` (C8:
``quant_lightning_indexer_manage``) + ``scatter_copy_sparse_flash_attention`` for its decode
rows. Outputs agree to fp32 rounding, not bit for bit: the fused op attends the selected rows
in its misses-first order, so the softmax sums in another order.
"""

from __future__ import annotations

import random
import uuid

import pytest
import torch
from test_dsa_offload_manager import BS, LAYERS, MAX_BLOCKS, MAX_ROWS, NUM_BLOCKS, K, _FakeScheduler

from kvo_core.errors import ConfigError
from kvo_kernels.reference.primitives import hadamard_quant_int8, indexer_scores, topk_indices
from kvo_vllm.dsa.main_kv import attend_rows
from kvo_vllm.dsa.offload_fused import IndexerInputs
from kvo_vllm.dsa.offload_manager import OffloadManager
from kvo_vllm.sparse.layout import SparseModelLayout

LATENT, ROPE, HEADS, INDEX_HEADS, INDEX_DIM = 8, 4, 2, 2, 4
SCALE = 0.4


def _manager(fused: bool) -> OffloadManager:
    layout = SparseModelLayout(num_layers=LAYERS, latent_dim=LATENT, rope_dim=ROPE,
                               index_dim=INDEX_DIM, softmax_scale=1.0, kv_dtype=torch.float32)
    return OffloadManager(layout, num_blocks=NUM_BLOCKS, block_size=BS, max_rows=MAX_ROWS,
                          max_blocks_per_row=MAX_BLOCKS, top_k=K, capacity=2 * K,
                          decode_query_rows=2, pool_name=f"t-fused-{uuid.uuid4().hex[:8]}",
                          fused=fused)


class _IndexerCache:
    """One layer's indexer keys in the manage ABI's layout (bf16, or C8 int8 + fp16 scale)."""

    def __init__(self, quantised: bool) -> None:
        self.quantised = quantised
        dtype = torch.int8 if quantised else torch.bfloat16
        self.keys = torch.zeros(NUM_BLOCKS, BS, 1, INDEX_DIM, dtype=dtype)
        self.scales = torch.ones(NUM_BLOCKS, BS, 1, dtype=torch.float16)

    def write(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        flat_keys, flat_scales = self.keys.view(-1, INDEX_DIM), self.scales.view(-1)
        if self.quantised:
            values, scales = hadamard_quant_int8(keys)
            flat_keys[slots], flat_scales[slots] = values, scales[:, 0]
        else:
            flat_keys[slots] = keys.to(torch.bfloat16)

    def dequantised(self) -> torch.Tensor:
        """Keys [slots, D] fp32 as the indexer scores them."""
        keys = self.keys.view(-1, INDEX_DIM).float()
        return keys * self.scales.view(-1, 1).float() if self.quantised else keys

    def inputs(self, query: torch.Tensor, weights: torch.Tensor) -> IndexerInputs:
        if self.quantised:
            values, scales = hadamard_quant_int8(query)
            return IndexerInputs(query=values, query_scale=scales[..., 0], weights=weights,
                                 key_cache=self.keys, key_scale=self.scales, quantised=True)
        return IndexerInputs(query=query.to(torch.bfloat16),
                             query_scale=torch.ones(query.shape[:2]), weights=weights,
                             key_cache=self.keys, key_scale=self.scales, quantised=False)


def _reference_topk(inputs: IndexerInputs, cache: _IndexerCache, owners_slots: list[list[int]],
                    positions: list[int]) -> torch.Tensor:
    """Each token's causal top-k over its request's keys, as kvo-kernels' reference selects."""
    query = inputs.query.float()
    if inputs.quantised:
        query = query * inputs.query_scale.float()[..., None]
    keys = cache.dequantised()
    rows = []
    for t, (slots, position) in enumerate(zip(owners_slots, positions, strict=True)):
        scores = indexer_scores(query[t:t + 1], inputs.weights[t:t + 1], keys[slots])
        rows.append(topk_indices(scores, K, torch.tensor([position + 1])))
    return torch.cat(rows)


def _run(quantised: bool, steps: int, seed: int) -> tuple[OffloadManager, int]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sched = _FakeScheduler(rng)
    plain, fused = _manager(False), _manager(True)
    caches = [_IndexerCache(quantised) for _ in range(LAYERS)]
    compared = 0
    try:
        for _step in range(steps):
            if len(sched.running) < MAX_ROWS and rng.random() < 0.4:
                sched.admit()
            if rng.random() < 0.15:
                rng.shuffle(sched.running)
            batch, qlens = [], []
            for req in list(sched.running):
                q = (min(req.prompt - req.computed, rng.randint(3, 7))
                     if req.computed < req.prompt else rng.choice([1, 1, 2]))
                if not sched.grow(req, req.computed + q):
                    sched.release(req)
                    sched.running.remove(req)
                    continue
                batch.append(req)
                qlens.append(q)
            if not batch:
                continue
            seq_lens = torch.tensor([r.computed + q for r, q in zip(batch, qlens, strict=True)])
            qsl = torch.zeros(len(batch) + 1, dtype=torch.int64)
            qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
            table = torch.zeros(len(batch), MAX_BLOCKS + 3, dtype=torch.int32)
            for i, r in enumerate(batch):
                table[i, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
            owners = [r for r, q in zip(batch, qlens, strict=True) for _ in range(q)]
            positions = [r.computed + j for r, q in zip(batch, qlens, strict=True)
                         for j in range(q)]
            slots = torch.tensor([sched.slot(r, p) for r, p in zip(owners, positions,
                                                                     strict=True)])
            owner_slots = [[sched.slot(r, s) for s in range(p + 1)]
                           for r, p in zip(owners, positions, strict=True)]
            count = len(positions)
            for layer in range(LAYERS):
                rows = torch.randn(count, LATENT + ROPE, generator=gen)
                plain.write(layer, rows, slots)
                fused.write(layer, rows, slots)
                caches[layer].write(slots, torch.randn(count, INDEX_DIM, generator=gen))
                inputs = caches[layer].inputs(
                    torch.randn(count, INDEX_HEADS, INDEX_DIM, generator=gen),
                    torch.rand(count, INDEX_HEADS, generator=gen))
                topk = _reference_topk(inputs, caches[layer], owner_slots, positions)
                query = torch.randn(count, HEADS, LATENT, generator=gen)
                query_rope = torch.randn(count, HEADS, ROPE, generator=gen)
                got, valid = plain.gather(layer, topk, qsl, seq_lens, table)
                want = attend_rows(query, query_rope, got, valid, LATENT, SCALE)
                # The fused manager never sees the decode rows' top-k: only the indexer inputs.
                decode_tok = torch.tensor([q <= 2 for q in qlens]).repeat_interleave(
                    torch.tensor(qlens))
                blind = torch.where(decode_tok[:, None], torch.full_like(topk, 12345), topk)
                out = fused.attend(layer, query, query_rope, blind, qsl, seq_lens, table,
                                   inputs, SCALE)
                torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
                last = fused.stats.last[layer]
                assert last.selected == plain.stats.last[layer].selected
                assert last.h2d_bytes == last.misses * fused.row_bytes
                compared += int(decode_tok.sum())
            for req, q in zip(batch, qlens, strict=True):
                rejected = q == 2 and req.computed >= req.prompt and rng.random() < 0.5
                req.computed += q - 1 if rejected else q
                if req.computed >= req.prompt and rng.random() < 0.08:
                    sched.release(req)
                    sched.running.remove(req)
    finally:
        plain.close()
    return fused, compared


@pytest.mark.parametrize("quantised", [False, True], ids=["bf16", "c8"])
def test_fused_output_equals_non_fused_through_joins_moves_and_drafts(quantised: bool) -> None:
    fused, compared = _run(quantised, steps=70, seed=11)
    try:
        totals = fused.stats.totals
        assert compared > 200                           # decode tokens through the fused ops
        assert totals.hits > 0 and totals.misses > 0    # residency really kept rows
        assert totals.h2d_bytes == totals.misses * fused.row_bytes
        assert totals.h2d_bytes < totals.full_reload_bytes
    finally:
        fused.close()


def test_fused_manager_keeps_latent_and_rope_apart_and_refuses_gather() -> None:
    manager = _manager(True)
    try:
        latent, rope = manager.pool_parts(0)
        assert latent.is_contiguous() and rope.is_contiguous()
        assert latent.shape == (NUM_BLOCKS, BS, LATENT) and rope.shape == (NUM_BLOCKS, BS, ROPE)
        rows = torch.arange(2 * (LATENT + ROPE), dtype=torch.float32).view(2, -1)
        manager.write(1, rows, torch.tensor([5, 9]))
        latent, rope = (part.flatten(0, 1) for part in manager.pool_parts(1))
        assert torch.equal(torch.cat([latent[[5, 9]], rope[[5, 9]]], dim=-1), rows)
        assert manager.layers.hot == [] and manager.hot_buffer_bytes == (
            LAYERS * MAX_ROWS * 2 * K * (LATENT + ROPE) * 4)
        with pytest.raises(RuntimeError, match="attend"):
            manager.gather(0, torch.zeros(1, K, dtype=torch.int64), torch.tensor([0, 1]),
                           torch.tensor([1]), torch.zeros(1, 4, dtype=torch.int32))
        # a P/D pull's interleaved rows reach this pool only through the row splitter
        with pytest.raises(ConfigError, match="fused_pool_split"):
            manager.pool_layer_base(0)
    finally:
        manager.close()
