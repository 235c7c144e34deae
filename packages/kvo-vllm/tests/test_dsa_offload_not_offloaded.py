"""NOT_OFFLOADED rows of the offload manager: a request whose sequence fits its hot row is read
at identity slots with no residency and no miss copy, leaves that state once (FIRST_OFFLOAD:
exactly its selection copied, ascending), and every row served equals the resident path's
(``PagedMainKV`` over a paged cache written with the same rows), through preemption, a
prefix-cache hit and a P/D pull into the pool.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch

from kvo_core.config import SparseDecodeOffloadConfig
from kvo_kernels import ops
from kvo_vllm.dsa.gather import decode_step, native_lane
from kvo_vllm.dsa.gather.contract import LayerCall
from kvo_vllm.dsa.main_kv import LayerInfo, PagedMainKV, attend_selected
from kvo_vllm.dsa.offload_manager import OffloadManager
from kvo_vllm.dsa.offload_stats import OffloadLayerStats, OffloadStats
from kvo_vllm.sparse.layout import SparseModelLayout

BS, LAYERS, K, CAP, LATENT, ROPE = 4, 2, 6, 12, 8, 4
WIDTH = LATENT + ROPE
NUM_BLOCKS, MAX_BLOCKS, MAX_ROWS = 24, 8, 2


class _Metadata:
    def __init__(self, block_table: torch.Tensor, token_request: torch.Tensor) -> None:
        self.block_table = block_table
        self.token_request = token_request


@attrs.define
class _Req:
    blocks: list[int]
    computed: int = 0     # positions written and accepted


class _Harness:
    """Drives an offload manager and the resident path with the same rows; checks equality."""

    def __init__(self, manager: OffloadManager, seed: int = 0) -> None:
        self.m = manager
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.resident = PagedMainKV(LayerInfo(
            layer_name="x", kv_lora_rank=LATENT, rope_dim=ROPE,
            config=SparseDecodeOffloadConfig(top_k=K, block_size=BS, hot_capacity=CAP)))
        self.caches = [torch.zeros(NUM_BLOCKS, BS, WIDTH) for _ in range(LAYERS)]
        self.copied_rows = 0
        self.host_copy_calls = 0       # copy_residency_misses calls
        self.identity_lane_calls = 0   # identity_decode_lane calls that served the step

    def step(self, batch: list[tuple[_Req, int]], topk: list[list[int]] | None = None
             ) -> list[OffloadLayerStats]:
        """One call per layer for ``batch`` [(request, query tokens)]; returns layer stats."""
        positions = [r.computed + j for r, q in batch for j in range(q)]
        owners = [r for r, q in batch for _ in range(q)]
        seq_lens = torch.tensor([r.computed + q for r, q in batch])
        qsl = torch.zeros(len(batch) + 1, dtype=torch.int64)
        qsl[1:] = torch.cumsum(torch.tensor([q for _, q in batch]), 0)
        table = torch.zeros(len(batch), MAX_BLOCKS, dtype=torch.int32)
        for i, (r, _) in enumerate(batch):
            table[i, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        slots = torch.tensor([r.blocks[p // BS] * BS + p % BS
                              for r, p in zip(owners, positions, strict=True)])
        if topk is None:
            topk = []
            for p in positions:
                pick = self.rng.sample(range(p + 1), min(K, p + 1))
                topk.append(pick + [-1] * (K - len(pick)))
        picks = torch.tensor(topk)
        token_request = torch.repeat_interleave(torch.arange(len(batch)),
                                                torch.tensor([q for _, q in batch]))
        stats = []
        for layer in range(LAYERS):
            rows = torch.randn(len(positions), WIDTH, generator=self.gen)
            self.m.write(layer, rows, slots)
            self.resident.write(self.caches[layer], rows, slots, None)
            # What OffloadManager.gather does, keeping the answer.
            selected = self.m.select_rows(layer, picks, self.m.step_inputs(qsl, seq_lens, table))
            out, valid = selected.materialized()
            resident = self.resident.gather(self.caches[layer], picks,
                                            _Metadata(table, token_request))
            want_rows, want_valid = resident.materialized()
            assert torch.equal(valid, want_valid)
            assert torch.equal(out[valid], want_rows[want_valid])
            assert bool(torch.isfinite(out[~valid]).all())  # padding: anything (main_kv)
            if selected.slots is not None:  # slots name no row where valid is False
                assert torch.equal(selected.slots >= 0, valid)
            # The attention over the answer as given (by slot, two caches) is the resident's.
            query = torch.randn(len(positions), 2, LATENT, generator=self.gen)
            query_rope = torch.randn(len(positions), 2, ROPE, generator=self.gen)
            assert torch.equal(attend_selected(query, query_rope, selected, LATENT, 0.5),
                               attend_selected(query, query_rope, resident, LATENT, 0.5))
            stats.append(self.m.stats.last[layer])
        for r, q in batch:
            r.computed += q
        return stats


@pytest.fixture(params=["torch", "native"])
def harness(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
            ) -> Iterator[_Harness]:
    """Torch residency (identity fills through index_copy_) and native residency (the C++
    host ops: identity fills through ``copy_residency_misses``)."""
    layout = SparseModelLayout(num_layers=LAYERS, latent_dim=LATENT, rope_dim=ROPE,
                               index_dim=4, softmax_scale=1.0, kv_dtype=torch.float32)
    manager = OffloadManager(
        layout, num_blocks=NUM_BLOCKS, block_size=BS, max_rows=MAX_ROWS,
        max_blocks_per_row=MAX_BLOCKS, top_k=K, capacity=CAP, decode_query_rows=1,
        pool_name=f"t-notoff-{uuid.uuid4().hex[:8]}", stats=OffloadStats(),
        residency_backend=request.param)
    if request.param == "native" and not manager.layers.native:
        manager.close()
        pytest.skip("kvo-kernels' native ops do not build here")
    h = _Harness(manager)
    copy = ops.sparse_copy

    def counted(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor,
                dst_rows: torch.Tensor, **kwargs: Any) -> None:
        h.copied_rows += int(dst_rows.numel())
        copy(src, dst, src_rows, dst_rows, **kwargs)

    monkeypatch.setattr(ops, "sparse_copy", counted)
    host_copy = decode_step.copy_residency_misses_host

    def counted_host(*args: Any, **kwargs: Any) -> int:
        h.host_copy_calls += 1
        return host_copy(*args, **kwargs)

    monkeypatch.setattr(decode_step, "copy_residency_misses_host", counted_host)
    identity_lane = native_lane.identity_decode_lane_host

    def counted_lane(*args: Any, **kwargs: Any) -> tuple[int, int] | None:
        answer = identity_lane(*args, **kwargs)
        h.identity_lane_calls += answer is not None
        return answer

    monkeypatch.setattr(native_lane, "identity_decode_lane_host", counted_lane)
    try:
        yield h
    finally:
        manager.close()


def test_short_request_reads_identity_slots_without_copies(harness: _Harness) -> None:
    req = _Req(blocks=[5, 9, 2])
    harness.step([(req, 5)])                        # prefill: read from the pool
    first = harness.step([(req, 1)])                # first decode: the prompt enters the row
    assert [s.identity_fills for s in first] == [6] * LAYERS
    steady = 0
    while req.computed < CAP:
        for s in harness.step([(req, 1)]):
            assert (s.identity_rows, s.identity_fills, s.misses, s.h2d_bytes) == (1, 1, 0, 0)
            assert s.hits == s.selected > 0
        steady += 1
    assert harness.copied_rows == 0                 # no miss copy while NOT_OFFLOADED
    # native: each steady step went through one identity_decode_lane call a layer (the
    # serials and the identity step in one)
    native = harness.m.layers.native
    assert harness.identity_lane_calls == (steady * LAYERS if native else 0)
    assert harness.host_copy_calls == 0
    hot = harness.m.layers.hot[1][:CAP]                    # batch row 0: position p at slot p
    for p in range(CAP):
        slot = req.blocks[p // BS] * BS + p % BS
        assert torch.equal(hot[p], harness.m.pool_layer(1)[slot])


def test_outgrowing_the_hot_row_copies_the_selection_once(harness: _Harness) -> None:
    req = _Req(blocks=[3, 7, 11, 4, 9])
    harness.step([(req, 4)])
    while req.computed < CAP:
        harness.step([(req, 1)])
    pick = [11, 0, 7, 3, 11, -1]                    # seq_len 13 > CAP: the transition
    stats = harness.step([(req, 1)], [pick])
    for s in stats:
        assert (s.first_offloads, s.identity_rows, s.identity_fills) == (1, 0, 0)
        assert s.misses == 4 == s.selected - 1      # distinct selected: 0 3 7 11
    assert harness.copied_rows == 4 * LAYERS
    result = harness.m.layers.residency.results[0]
    assert result.miss_tokens[0, :4].tolist() == [0, 3, 7, 11]   # laid in ascending order
    assert result.miss_slots[0, :4].tolist() == [0, 1, 2, 3]
    stats = harness.step([(req, 1)], [[13, 0, 3, 7, 11, 12]])    # STEADY from here on
    for s in stats:
        assert (s.first_offloads, s.identity_rows, s.misses) == (0, 0, 2)
    for _ in range(3):
        harness.step([(req, 1)])                    # random picks: rows still the resident's


def test_two_rows_one_short_one_offloaded_in_one_batch(harness: _Harness) -> None:
    long, short = _Req(blocks=[1, 2, 3, 4, 6, 23]), _Req(blocks=[8, 10, 9])
    harness.step([(long, 15), (short, 3)])
    for _ in range(8):
        stats = harness.step([(long, 1), (short, 1)])
        assert all(s.identity_rows == (1 if short.computed <= CAP else 0) for s in stats)
    assert harness.copied_rows > 0                  # the long row went through residency


def test_preempted_request_and_a_new_one_in_its_blocks_get_their_own_rows(
        harness: _Harness) -> None:
    a = _Req(blocks=[5, 6])
    harness.step([(a, 6)])
    for _ in range(2):
        harness.step([(a, 1)])
    b = _Req(blocks=[5, 6, 18, 19])         # a preempted: its blocks and row go to b
    harness.step([(b, 5)])
    for _ in range(3):
        stats = harness.step([(b, 1)])
    assert all(s.identity_rows == 1 for s in stats)
    resumed = _Req(blocks=[12, 13, 14, 20])             # a resumes: recomputed into new blocks
    harness.step([(b, 1), (resumed, 8)])
    for _ in range(6):                              # both cross CAP on the way
        harness.step([(b, 1), (resumed, 1)])


def test_prefix_cache_hit_and_pulled_prompt_fill_from_the_pool(harness: _Harness) -> None:
    a = _Req(blocks=[7, 8, 21, 23])
    harness.step([(a, 6)])
    harness.step([(a, 1)])
    shared = _Req(blocks=[7, 15], computed=BS)      # prefix hit on a's first block
    harness.step([(a, 1), (shared, 2)])
    stats = harness.step([(a, 1), (shared, 1)])
    assert [s.identity_fills for s in stats] == [1 + 7] * LAYERS   # a's new row, shared's 7
    # A P/D pull: whole blocks written into the pool behind write's back, then decode.
    pulled = _Req(blocks=[16, 17, 22], computed=7)
    for layer in range(LAYERS):
        for p in range(7):
            slot = pulled.blocks[p // BS] * BS + p % BS
            row = torch.randn(WIDTH, generator=harness.gen)
            harness.m.pool_layer(layer)[slot] = row
            harness.caches[layer][slot // BS, slot % BS] = row
    harness.m.note_blocks_written(pulled.blocks)
    stats = harness.step([(a, 1), (pulled, 1)])
    assert [s.identity_rows for s in stats] == [2] * LAYERS
    for _ in range(3):
        harness.step([(a, 1), (pulled, 1)])


def test_the_one_call_lane_declines_what_is_not_its_steady_state(harness: _Harness) -> None:
    """The lane answers only a plain decode step of rows it already holds; anything else
    (here: a top-k with a padded row, two query tokens, a row filled to another length) is
    left to the two-call path with nothing changed."""
    if not harness.m.layers.native:
        pytest.skip("the lane is a native op (this parameter runs the torch residency)")
    req = _Req(blocks=[5, 9, 2])
    harness.step([(req, 5)])
    harness.step([(req, 1)])                        # the prompt enters the row
    table = torch.zeros(1, MAX_BLOCKS, dtype=torch.int32)
    table[0, :3] = torch.tensor(req.blocks, dtype=torch.int32)
    one = torch.tensor([[0, 1, 2, 3, 4, 5]])
    held = harness.m.layers.held[0]
    lane = next(s for s in harness.m.sources if s.name == "native_lane")
    before = (held.held_serials.clone(), held.filled.clone())
    cases = {
        "padded top-k": (torch.cat([one, one]), torch.tensor([0, 1]), 7),
        "two query tokens": (one, torch.tensor([0, 2]), 8),
        "a length its row is not filled to": (one, torch.tensor([0, 1]), 3),
    }
    for name, (topk, qsl, seq_len) in cases.items():
        step = harness.m.step_inputs(qsl, torch.tensor([seq_len]), table)
        assert lane.select_rows(LayerCall(layer=0, padded_topk=topk, step=step)) is None, name
        assert torch.equal(held.held_serials, before[0]) and torch.equal(held.filled, before[1])
    step = harness.m.step_inputs(torch.tensor([0, 1]), torch.tensor([7]), table)
    taken = lane.select_rows(LayerCall(layer=0, padded_topk=one, step=step))
    assert taken is not None                        # the steady step itself: taken
    assert held.filled[0] == 7
