"""Every offload gather implementation against the reference, on the same scheduled steps.

One seeded schedule (a small stand-in for vLLM's scheduler: requests joining with prompts
shorter and longer than a hot row, chunked prefill next to decode rows, plain decode steps,
MTP steps of two query rows with a rejected draft rewritten in the next step, preemption and
recompute into other blocks, prefix-cache hits on a shared first block, rows moving when the
batch is condensed) is replayed into two managers: one whose chain is the implementation
under test followed by the reference (which answers what it declines), one with the
reference alone. Per layer call the two must agree on everything a later call or the
attention can see: the rows (PyTorch indexing of the pool's truth as the oracle, and
``attend_rows`` over them bit for bit), the call's counters, the hot buffer, the residency
table and the NOT_OFFLOADED bookkeeping. Each implementation must really answer calls of
the schedule (counted), and decline some.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Iterator

import attrs
import pytest
import torch

from kvo_vllm.dsa.gather.choose import choose_row_sources
from kvo_vllm.dsa.gather.contract import Gathered, LayerCall, RowSource
from kvo_vllm.dsa.gather.decode_step import DecodeStepGather
from kvo_vllm.dsa.gather.identity_step import IdentityStepGather
from kvo_vllm.dsa.gather.native_lane import NativeLaneGather
from kvo_vllm.dsa.gather.reference import ReferenceGather
from kvo_vllm.dsa.main_kv import attend_rows, attend_selected
from kvo_vllm.dsa.offload_manager import OffloadManager
from kvo_vllm.dsa.offload_stats import OffloadStats
from kvo_vllm.sparse.layout import SparseModelLayout

BS, LAYERS, K, QUERY_ROWS = 4, 2, 6, 2
CAP = QUERY_ROWS * K                      # 12 positions per hot row
LATENT, ROPE = 8, 4
WIDTH = LATENT + ROPE
NUM_BLOCKS, MAX_BLOCKS, MAX_ROWS = 64, 10, 4
STEPS = 220


@attrs.frozen(eq=False)
class Step:
    """One scheduled step as vLLM's metadata would describe it, plus the rows it writes."""

    query_start_loc: torch.Tensor   # [R + 1]
    seq_lens: torch.Tensor          # [R]
    block_table: torch.Tensor       # [R, MAX_BLOCKS + 2] int32
    slots: torch.Tensor             # [T] where each query token's row is written
    owner_slots: torch.Tensor       # [T, K] pool slot of each top-k entry (0 where padding)
    topk: torch.Tensor              # [T, K] request-local positions, -1 padding
    rows: torch.Tensor              # [LAYERS, T, WIDTH] the rows written
    kinds: frozenset[str]           # what the step holds (coverage of the schedule)


@attrs.define
class _Req:
    prompt: int
    stop: int                 # finishes once this many positions are accepted
    blocks: list[int] = attrs.Factory(list)
    computed: int = 0


def _schedule(seed: int) -> list[Step]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    free = list(range(1, NUM_BLOCKS))          # block 0: vLLM's null block
    running: list[_Req] = []
    steps: list[Step] = []

    def release(req: _Req) -> None:
        shared = {b for other in running if other is not req for b in other.blocks}
        free.extend(b for b in reversed(req.blocks) if b not in shared)
        req.blocks, req.computed = [], 0

    while len(steps) < STEPS:
        kinds: set[str] = set()
        if len(running) < MAX_ROWS and rng.random() < 0.12:
            if rng.random() < 0.6:              # short: finishes inside its hot row
                prompt = rng.randint(2, CAP - 4)
                req = _Req(prompt=prompt, stop=rng.randint(prompt + 2, CAP))
            else:
                prompt = rng.randint(CAP - 3, 30)
                req = _Req(prompt=prompt, stop=prompt + rng.randint(4, 12))
            donors = [r for r in running if r.computed >= BS]
            if donors and rng.random() < 0.3:   # prefix-cache hit on a full first block
                req.blocks, req.computed = [donors[0].blocks[0]], BS
                req.prompt = max(req.prompt, BS + 1)
                req.stop = max(req.stop, req.prompt + 2)
                kinds.add("prefix hit")
            running.append(req)
            kinds.add("join")
        if not running:
            continue
        if rng.random() < 0.1:
            rng.shuffle(running)                # a finish condenses the batch: rows move
            kinds.add("move")
        if rng.random() < 0.04:                 # preempted: recomputed later, other blocks
            victim = rng.choice(running)
            release(victim)
            kinds.add("preemption")
        mtp = rng.random() < 0.25
        batch: list[tuple[_Req, int]] = []
        for req in list(running):
            prefill = req.computed < req.prompt
            q = min(req.prompt - req.computed, rng.randint(4, 12)) if prefill else 1 + mtp
            need = -(-(req.computed + q) // BS)
            if need > MAX_BLOCKS or need - len(req.blocks) > len(free):
                release(req)
                running.remove(req)
                kinds.add("preemption")
                continue
            while len(req.blocks) < need:
                req.blocks.append(free.pop())
            kinds.add("prefill" if prefill else "mtp" if q == 2 else "decode")
            batch.append((req, q))
        if not batch:
            continue
        if "prefill" in kinds and kinds & {"decode", "mtp"}:
            kinds.add("mixed")
        positions = [r.computed + j for r, q in batch for j in range(q)]
        owners = [r for r, q in batch for _ in range(q)]
        table = torch.zeros(len(batch), MAX_BLOCKS + 2, dtype=torch.int32)
        for i, (r, _) in enumerate(batch):
            table[i, :len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
        topk = torch.full((len(positions), K), -1, dtype=torch.int64)
        owner_slots = torch.zeros(len(positions), K, dtype=torch.int64)
        for t, (r, p) in enumerate(zip(owners, positions, strict=True)):
            pick = rng.sample(range(p + 1), min(K, p + 1))
            topk[t, :len(pick)] = torch.tensor(pick)
            owner_slots[t, :len(pick)] = torch.tensor(
                [r.blocks[x // BS] * BS + x % BS for x in pick])
        qsl = torch.zeros(len(batch) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor([q for _, q in batch]), 0)
        steps.append(Step(
            query_start_loc=qsl, block_table=table, topk=topk, owner_slots=owner_slots,
            seq_lens=torch.tensor([r.computed + q for r, q in batch], dtype=torch.int32),
            slots=torch.tensor([r.blocks[p // BS] * BS + p % BS
                                for r, p in zip(owners, positions, strict=True)]),
            rows=torch.randn(LAYERS, len(positions), WIDTH, generator=gen),
            kinds=frozenset(kinds)))
        for req, q in batch:
            draft_rejected = q == 2 and req.computed >= req.prompt and rng.random() < 0.5
            req.computed += q - draft_rejected
            if req.computed >= req.stop:
                release(req)
                running.remove(req)
    return steps


class _Counted:
    """A chain member that counts the calls it answered and declined."""

    def __init__(self, inner: RowSource, answered: Counter[str]) -> None:
        self.inner, self.answered, self.name = inner, answered, inner.name

    def select_rows(self, call: LayerCall) -> Gathered | None:
        answer = self.inner.select_rows(call)
        self.answered[self.name if answer is not None else f"{self.name} declined"] += 1
        return answer


def _manager(backend: str) -> OffloadManager:
    layout = SparseModelLayout(num_layers=LAYERS, latent_dim=LATENT, rope_dim=ROPE,
                               index_dim=4, softmax_scale=1.0, kv_dtype=torch.float32)
    return OffloadManager(
        layout, num_blocks=NUM_BLOCKS, block_size=BS, max_rows=MAX_ROWS,
        max_blocks_per_row=MAX_BLOCKS, top_k=K, capacity=CAP, decode_query_rows=QUERY_ROWS,
        pool_name=f"t-diff-{uuid.uuid4().hex[:8]}", residency_backend=backend,
        stats=OffloadStats())


@pytest.fixture(params=["torch", "native"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[OffloadManager, OffloadManager]]:
    """(manager under test, reference-only manager) with the same settings."""
    tested, reference = _manager(request.param), _manager(request.param)
    try:
        if request.param == "native" and not tested.layers.native:
            pytest.skip("kvo-kernels' native ops do not build here")
        reference.sources = (ReferenceGather(reference.layers),)
        yield tested, reference
    finally:
        tested.close()
        reference.close()


def _state(manager: OffloadManager, layer: int) -> list[torch.Tensor]:
    """Everything a later call of the layer reads."""
    lay = manager.layers
    table = lay.residency.tables[layer]
    identity = lay.identity[layer].state
    return [lay.hot[layer], table.slot_tokens, table.lru_order, table.row_requests,
            lay.held[layer].held_serials, lay.held[layer].filled, identity.serials,
            identity.versions, identity.next_serial]


def _stats(manager: OffloadManager, layer: int) -> dict[str, float]:
    fields = attrs.asdict(manager.stats.last[layer])
    fields.pop("residency_seconds")
    return fields


IMPLEMENTATIONS = {"decode_step": DecodeStepGather, "identity_step": IdentityStepGather,
                   "native_lane": NativeLaneGather}


@pytest.mark.parametrize("under_test", [*IMPLEMENTATIONS, "chosen chain"])
def test_each_gather_equals_the_reference_on_the_same_steps(
        pair: tuple[OffloadManager, OffloadManager], under_test: str) -> None:
    tested, reference = pair
    if under_test == "native_lane" and not tested.layers.native:
        pytest.skip("the native lane needs kvo's C++ host ops (this parameter runs torch)")
    if under_test == "chosen chain":
        chain = choose_row_sources(tested.layers)
    else:
        chain = (IMPLEMENTATIONS[under_test](tested.layers), ReferenceGather(tested.layers))
    answered: Counter[str] = Counter()
    tested.sources = tuple(_Counted(source, answered) for source in chain)
    schedule = _schedule(seed=11)
    kinds = Counter(kind for step in schedule for kind in step.kinds)
    assert all(kinds[k] >= 3 for k in ("join", "prefill", "decode", "mtp", "mixed",
                                       "preemption", "prefix hit", "move")), kinds
    truth = torch.zeros(LAYERS, NUM_BLOCKS * BS, WIDTH)
    gen = torch.Generator().manual_seed(5)
    for number, step in enumerate(schedule):
        for layer in range(LAYERS):
            truth[layer, step.slots] = step.rows[layer]
            answers = []
            for manager in (tested, reference):
                manager.write(layer, step.rows[layer], step.slots)
                inputs = manager.step_inputs(step.query_start_loc, step.seq_lens,
                                             step.block_table)
                answers.append(manager.select_rows(layer, step.topk, inputs))
            where = f"step {number} ({sorted(step.kinds)}), layer {layer}"
            want = truth[layer][step.owner_slots]
            valid = step.topk >= 0
            for selected in answers:
                rows, got_valid = selected.materialized()
                assert torch.equal(got_valid, valid), where
                assert torch.equal(rows[valid], want[valid]), where
            query = torch.randn(len(step.slots), 2, LATENT, generator=gen)
            query_rope = torch.randn(len(step.slots), 2, ROPE, generator=gen)
            expected = attend_rows(query, query_rope, want, valid, LATENT, 0.5)
            for selected in answers:
                assert torch.equal(attend_selected(query, query_rope, selected, LATENT, 0.5),
                                   expected), where
            assert _stats(tested, layer) == _stats(reference, layer), where
            for mine, theirs in zip(_state(tested, layer), _state(reference, layer),
                                    strict=True):
                assert torch.equal(mine, theirs), where
    # Each implementation answered calls and declined others.
    fast = [source.name for source in chain if source.name != "reference"]
    assert all(answered[name] >= 20 for name in fast), answered
    assert all(answered[f"{name} declined"] >= 20 for name in fast), answered
    assert answered["reference"] >= 20, answered
