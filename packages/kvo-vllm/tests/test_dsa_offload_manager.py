"""The offload manager's rules against a fake scheduler: rows equal the pool's, bytes = misses.

A small simulation plays vLLM's part (blocks handed out LIFO so freed blocks come back at once,
requests joining, finishing, being preempted and recomputed, moving between batch rows,
prefix-cache block sharing, chunked prefill, two query rows with a rejected draft rewritten in
the next step) and checks that every row the manager returns for a valid top-k entry is the
row last written at that position, whichever path (hot buffer or pool) served it.
"""

from __future__ import annotations

import logging
import random
import threading
import uuid
from typing import Any

import pytest
import torch

from kvo_core.errors import ConfigError
from kvo_vllm.dsa.main_kv import attend_rows, attend_selected
from kvo_vllm.dsa.offload_identity import RowIdentity
from kvo_vllm.dsa.offload_manager import OffloadManager
from kvo_vllm.dsa.offload_stats import OffloadStats
from kvo_vllm.sparse.layout import SparseModelLayout

BS = 4
LAYERS = 2
K = 6
MAX_ROWS = 4
NUM_BLOCKS = 48
MAX_BLOCKS = 12


def _layout() -> SparseModelLayout:
    return SparseModelLayout(num_layers=LAYERS, latent_dim=8, rope_dim=4, index_dim=4,
                             softmax_scale=1.0, kv_dtype=torch.float32)


def _manager(**overrides: object) -> OffloadManager:
    kwargs: dict[str, object] = dict(
        num_blocks=NUM_BLOCKS, block_size=BS, max_rows=MAX_ROWS, max_blocks_per_row=MAX_BLOCKS,
        top_k=K, capacity=2 * K, decode_query_rows=2, pool_name=f"t-dsa-{uuid.uuid4().hex[:8]}")
    kwargs.update(overrides)
    return OffloadManager(_layout(), **kwargs)  # type: ignore[arg-type]


class _Request:
    def __init__(self, rid: int, prompt: int) -> None:
        self.rid = rid
        self.prompt = prompt
        self.blocks: list[int] = []
        self.computed = 0     # tokens whose rows are in the pool and accepted


class _FakeScheduler:
    """Just enough of vLLM's block bookkeeping to drive the manager."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.free = list(range(1, NUM_BLOCKS))  # block 0 is vLLM's null block
        self.truth = torch.zeros(LAYERS, NUM_BLOCKS * BS, 12)
        self.running: list[_Request] = []
        self.next_id = 0

    def slot(self, req: _Request, pos: int) -> int:
        return req.blocks[pos // BS] * BS + pos % BS

    def grow(self, req: _Request, tokens: int) -> bool:
        need = -(-tokens // BS) - len(req.blocks)
        if need > len(self.free) or -(-tokens // BS) > MAX_BLOCKS:
            return False
        for _ in range(need):
            req.blocks.append(self.free.pop())
        return True

    def release(self, req: _Request) -> None:
        shared = {b for other in self.running if other is not req for b in other.blocks}
        self.free.extend(b for b in reversed(req.blocks) if b not in shared)
        req.blocks = []
        req.computed = 0

    def admit(self) -> None:
        req = _Request(self.next_id, self.rng.randint(1, 11))
        self.next_id += 1
        donors = [r for r in self.running if r.computed >= BS]
        if donors and self.rng.random() < 0.3:   # prefix-cache hit on a full first block
            req.blocks = [donors[0].blocks[0]]
            req.computed = BS
            req.prompt = max(req.prompt, BS + 1)
        self.running.append(req)


def _run_steps(manager: OffloadManager, steps: int, seed: int) -> int:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sched = _FakeScheduler(rng)
    checked = 0
    for _step in range(steps):
        if len(sched.running) < MAX_ROWS and rng.random() < 0.4:
            sched.admit()
        if not sched.running:
            continue
        if rng.random() < 0.15:                  # a finish condenses the batch: rows move
            rng.shuffle(sched.running)
        batch, qlens = [], []
        for req in list(sched.running):
            if req.computed < req.prompt:
                q = min(req.prompt - req.computed, rng.randint(3, 7))
            else:
                q = rng.choice([1, 1, 2])
            if not sched.grow(req, req.computed + q):
                sched.release(req)               # preempted: recompute later
                sched.running.remove(req)
                continue
            batch.append(req)
            qlens.append(q)
        if not batch:
            continue
        seq_lens = torch.tensor([r.computed + q for r, q in zip(batch, qlens, strict=True)])
        qsl = torch.zeros(len(batch) + 1, dtype=torch.int64)
        qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
        table = torch.full((len(batch), MAX_BLOCKS + 3), 0, dtype=torch.int32)
        for i, r in enumerate(batch):
            table[i, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        positions = [r.computed + j for r, q in zip(batch, qlens, strict=True) for j in range(q)]
        owners = [r for r, q in zip(batch, qlens, strict=True) for _ in range(q)]
        slots = torch.tensor([sched.slot(r, p) for r, p in zip(owners, positions, strict=True)])
        topk = torch.full((len(positions), K), -1, dtype=torch.int64)
        for t, p in enumerate(positions):
            pick = rng.sample(range(p + 1), min(K, p + 1))
            topk[t, :len(pick)] = torch.tensor(pick)
        for layer in range(LAYERS):
            rows = torch.randn(len(positions), 12, generator=gen)
            manager.write(layer, rows, torch.cat([slots, torch.tensor([-1])]))
            sched.truth[layer, slots] = rows
            # What manager.gather does, keeping the answer as the attention gets it.
            selected = manager.select_rows(layer, topk, manager.step_inputs(qsl, seq_lens, table))
            out, valid = selected.materialized()
            owner_slots = [[sched.slot(r, int(p)) if p >= 0 else 0 for p in row]
                           for r, row in zip(owners, topk.tolist(), strict=True)]
            want = sched.truth[layer][torch.tensor(owner_slots)]
            assert torch.equal(valid, topk >= 0)
            assert torch.equal(out[valid], want[valid])
            assert bool(torch.isfinite(out[~valid]).all())  # padding: anything finite (main_kv)
            if selected.slots is not None:  # slots name no row where valid is False
                assert torch.equal(selected.slots >= 0, valid)
            # The attention over the answer as given (hot buffer and pool by slot) is the
            # attention over the true rows, bit for bit.
            query = torch.randn(len(positions), 2, 8, generator=gen)
            query_rope = torch.randn(len(positions), 2, 4, generator=gen)
            assert torch.equal(attend_selected(query, query_rope, selected, 8, 0.5),
                               attend_rows(query, query_rope, want, valid, 8, 0.5))
            last = manager.stats.last[layer]
            assert last.h2d_bytes == last.misses * manager.row_bytes
            checked += int(valid.sum())
        for req, q in zip(batch, qlens, strict=True):
            accepted = q - 1 if (q == 2 and req.computed >= req.prompt
                                 and rng.random() < 0.5) else q   # a rejected draft
            req.computed += accepted
            if req.computed >= req.prompt and rng.random() < 0.08:
                sched.release(req)
                sched.running.remove(req)
    return checked


def _count_direct_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the manager's calls of kvo's ``copy_residency_misses`` (the native decode step:
    misses copied straight from the residency result, attention over the hot buffer)."""
    from kvo_vllm.dsa.gather import decode_step

    calls: list[int] = []
    original = decode_step.copy_residency_misses_host

    def counting(*args: Any, **kwargs: Any) -> int:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(decode_step, "copy_residency_misses_host", counting)
    return calls


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_rows_equal_pool_rows_through_joins_moves_preemption_and_drafts(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = _manager(residency_backend=backend, stats=OffloadStats(history_limit=10**6))
    table = manager.layers.residency.tables[0]
    if backend == "native" and type(table).__name__ != "NativeResidencyTable":
        manager.close()
        pytest.skip("kvo-kernels' native residency op does not build here")
    one_pass = _count_direct_copies(monkeypatch)
    try:
        checked = _run_steps(manager, steps=160, seed=7)
        totals = manager.stats.totals
        assert checked > 2000
        # native: the C++ host ops are loaded, so one-token decode steps copy their misses
        # straight from the residency result; torch: index arrays, copy, then gather.
        assert (len(one_pass) >= 5) if backend == "native" else not one_pass
        assert totals.hits > 0 and totals.misses > 0   # both paths really exercised
        assert totals.h2d_bytes == totals.misses * manager.row_bytes
        assert totals.h2d_bytes < totals.full_reload_bytes
        # Short requests were served NOT_OFFLOADED, and some outgrew their hot row on the way.
        history = manager.stats.history
        assert sum(s.identity_rows for s in history) > 100
        assert sum(s.first_offloads for s in history) > 5
    finally:
        manager.close()


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_pool_really_read_and_misses_copied_once(backend: str) -> None:
    """A decode row: first call copies its selection, the same selection again copies nothing;
    a pool row changed behind the manager's back shows only once it is a miss again. (The hot
    row holds K rows, so the 9-token request is offloaded from its first decode step.) With
    the native backend the decode steps take the one-pass copy + gather."""
    manager = _manager(decode_query_rows=1, capacity=K, residency_backend=backend)
    if backend == "native" and not manager.layers.native:
        manager.close()
        pytest.skip("kvo-kernels' native ops do not build here")
    try:
        table = torch.tensor([[1, 2, 3, 0]], dtype=torch.int32)
        qsl = torch.tensor([0, 1])
        rows = torch.arange(11 * 12, dtype=torch.float32).reshape(11, 12)
        slots = torch.tensor([table[0, p // BS].item() * BS + p % BS for p in range(11)])
        manager.write(0, rows[:9], slots[:9])
        topk = torch.tensor([[0, 3, 5, 8, -1, -1]])
        out, _ = manager.gather(0, topk, qsl, torch.tensor([9]), table)
        assert manager.stats.last[0].misses == 4
        assert torch.equal(out[0, :4], rows[[0, 3, 5, 8]])
        manager.pool_layer(0)[slots[5]] = -1.0          # behind the manager's back
        manager.write(0, rows[9:10], slots[9:10])        # the next decode step
        out, _ = manager.gather(0, topk, qsl, torch.tensor([10]), table)
        assert manager.stats.last[0].misses == 0          # all hits: the stale copy is served
        assert torch.equal(out[0, 2], rows[5])
        manager.write(0, rows[10:11], slots[10:11])
        out, _ = manager.gather(0, torch.tensor([[5, 1, 2, 10, -1, -1]]), qsl,
                                torch.tensor([11]), table)
        assert manager.stats.last[0].misses == 3          # 1, 2 and the new 10; 5 resident
        assert torch.equal(out[0, 0], rows[5])
        assert torch.equal(out[0, 1:4], rows[[1, 2, 10]])
        # A prefill-length query reads the pool itself (by slot, no gathered copy): the
        # changed row shows.
        prefill_topk = torch.tensor([[5, -1, -1, -1, -1, -1]] * 3)
        out, _ = manager.gather(0, prefill_topk, torch.tensor([0, 3]), torch.tensor([11]), table)
        assert bool((out[:, 0] == -1.0).all())
        step = manager.step_inputs(torch.tensor([0, 3]), torch.tensor([11]), table)
        selected = manager.select_rows(0, prefill_topk, step)
        assert selected.slots is not None
        assert selected.rows.data_ptr() == manager.pool_layer(0).data_ptr()
        assert selected.slots[:, 0].tolist() == [int(slots[5])] * 3
        assert bool((selected.slots[:, 1:] == -1).all())
    finally:
        manager.close()


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("prefill", [4, 8])
def test_a_mixed_step_reads_decode_rows_in_the_hot_buffer_and_prefill_rows_in_the_pool(
        backend: str, prefill: int) -> None:
    """A step with a decode row and a prefill chunk (of 4 tokens: it fits a hot row, the
    NOT_OFFLOADED path; of 8: the general path): the attention reads the prefill tokens'
    rows in the pool and the decode token's in the hot buffer, both by slot (no gathered
    copy): a pool row changed behind the manager's back after it was copied to the hot
    buffer is not seen by the decode token (a hit), and the attention over the answer is
    the attention over the rows each token should see, bit for bit."""
    manager = _manager(decode_query_rows=1, capacity=K, residency_backend=backend)
    if backend == "native" and not manager.layers.native:
        manager.close()
        pytest.skip("kvo-kernels' native ops do not build here")
    try:
        table = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]], dtype=torch.int32)
        rows = torch.arange((10 + prefill) * 12, dtype=torch.float32).reshape(-1, 12)
        a_slots = torch.tensor([int(table[0, p // BS]) * BS + p % BS for p in range(10)])
        b_slots = torch.tensor([int(table[1, p // BS]) * BS + p % BS for p in range(prefill)])
        manager.write(0, rows[:9], a_slots[:9])
        a_topk = torch.tensor([[0, 3, 5, 8, -1, -1]])
        manager.gather(0, a_topk, torch.tensor([0, 1]), torch.tensor([9]), table[:1])
        manager.pool_layer(0)[a_slots[5]] = -1.0      # behind the manager's back
        # The mixed step: A decodes its 10th token, B prefills.
        manager.write(0, rows[9:], torch.cat([a_slots[9:], b_slots]))
        topk = torch.tensor([[0, 3, 5, 8, 9, -1]]
                            + [[0, p, -1, -1, -1, -1] for p in range(prefill)])
        step = manager.step_inputs(torch.tensor([0, 1, 1 + prefill]),
                                   torch.tensor([10, prefill]), table)
        selected = manager.select_rows(0, topk, step)
        assert selected.slots is not None and selected.overlay is not None
        assert selected.rows.data_ptr() == manager.pool_layer(0).data_ptr()
        assert selected.overlay.tokens.tolist() == [0]
        out, valid = selected.materialized()
        assert torch.equal(out[0, :5], rows[[0, 3, 5, 8, 9]])    # the hot copy of 5
        for t in range(1, 1 + prefill):
            assert torch.equal(out[t, :2], rows[[10, 10 + t - 1]])
        assert manager.stats.last[0].decode_rows == 1 and manager.stats.last[0].pool_rows == 1
        generator = torch.Generator().manual_seed(4)
        query = torch.randn(1 + prefill, 2, 8, generator=generator)
        query_rope = torch.randn(1 + prefill, 2, 4, generator=generator)
        assert torch.equal(attend_selected(query, query_rope, selected, 8, 0.5),
                           attend_rows(query, query_rope, out, valid, 8, 0.5))
    finally:
        manager.close()


def test_new_request_in_reused_blocks_never_hits_stale_rows() -> None:
    """Request B gets A's freed block and A's batch row: B's rows, not A's copies."""
    ident = RowIdentity(max_rows=2, num_blocks=8, block_size=BS, max_blocks_per_row=4)
    table = torch.tensor([[3, 0, 0, 0]])
    ident.note_writes(torch.tensor([12, 13]))
    a = ident.serials(table, torch.tensor([2]), torch.tensor([2]))
    ident.note_writes(torch.tensor([14]))
    assert torch.equal(ident.serials(table, torch.tensor([3]), torch.tensor([1])), a)
    ident.note_writes(torch.tensor([12, 13, 14]))       # B re-fills block 3 from its first row
    b = ident.serials(table, torch.tensor([3]), torch.tensor([3]))
    ident.note_writes(torch.tensor([15]))
    assert not torch.equal(b, a)
    assert torch.equal(ident.serials(table, torch.tensor([4]), torch.tensor([1])), b)


def test_capacity_must_hold_the_query_rows_selection() -> None:
    with pytest.raises(ConfigError, match=r"hot_capacity 10 .* 2 query rows x top-k 6"):
        _manager(capacity=10)
    with pytest.raises(ConfigError, match="max_rows must be an integer >= 1, got 0"):
        _manager(max_rows=0)


def test_a_native_residency_that_cannot_build_falls_back_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The default residency_backend "native" on a host where the op cannot load: kvo-core's
    table, one WARNING (not one per layer) naming why, the fallback and its cost, and the miss
    copies stay with the dispatcher's choice (the C++ host copy lives in the library that did
    not load)."""
    from kvo_core.residency import ResidencyTable
    from kvo_kernels import native_residency
    from kvo_vllm.sparse import residency_backend

    class Unbuildable:
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("no compiler here")

    monkeypatch.setattr(native_residency, "NativeResidencyTable", Unbuildable)
    monkeypatch.setattr(residency_backend, "_fallback_logged", threading.Event())
    with caplog.at_level(logging.WARNING, logger=residency_backend.logger.name):
        manager = _manager(residency_backend="native")
        second = _manager(residency_backend="native")
    try:
        tables = manager.layers.residency.tables
        assert len(tables) > 1
        assert all(isinstance(table, ResidencyTable) for table in tables)
        assert manager.layers.copy_implementation is None
        warnings = [r.getMessage() for r in caplog.records
                    if r.levelno == logging.WARNING and r.name == residency_backend.logger.name]
        assert len(warnings) == 1, warnings
        assert "no compiler here" in warnings[0]
        assert "falling back to kvo-core's torch ResidencyTable" in warnings[0]
        assert "slower" in warnings[0] and "kvo-build-native-ops" in warnings[0]
    finally:
        manager.close()
        second.close()
