"""The scheduler half's per-step transfer plan and store prefix lookups (fake requests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvo_vllm.layerwise.keys import StoreKeys, hashed_block_name, request_block_name
from kvo_vllm.layerwise.metadata import LayerwiseMetadata, RequestTransfers
from kvo_vllm.layerwise.scheduler_side import LayerwiseScheduler

BS = 4
LAYERS = (0, 1, 2)
PARTS = [(layer, "kv") for layer in LAYERS]
KEYS = StoreKeys(namespace="ns")


class FakeRequest:
    """Only what the scheduler half reads: id, token count, computed count, block hashes."""

    def __init__(self, request_id: str, num_tokens: int, hashed_blocks: int | None = None) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.num_computed_tokens = 0
        full = num_tokens // BS if hashed_blocks is None else hashed_blocks
        self.block_hashes = [f"{request_id}-{i}".encode() for i in range(full)]


class Harness:
    def __init__(self, stored: set[str] | None = None,
                 parts: list[tuple[int, str]] = PARTS) -> None:
        self.stored = stored if stored is not None else set()
        self.blocks: dict[str, list[int]] = {}
        self.evicted: list[list[bytes]] = []
        self.scheduler = LayerwiseScheduler(
            block_size=BS, stored_parts=parts, keys=KEYS, tp_size=1, engine_id="E",
            store_exists=lambda keys: [k in self.stored for k in keys],
            block_ids_of=lambda rid: self.blocks[rid], evict_local=self.evict)

    def evict(self, block_hashes: list[bytes]) -> int:
        self.evicted.append(list(block_hashes))
        return len(block_hashes)

    def admit(self, request: FakeRequest, first_block_id: int, num_blocks: int,
              external: int = 0) -> None:
        self.blocks[request.request_id] = list(range(first_block_id,
                                                     first_block_id + num_blocks))
        self.scheduler.on_new_request(request)
        self.scheduler.update_state_after_alloc(request, external)

    def step(self, scheduled: dict[FakeRequest, int]) -> LayerwiseMetadata:
        output = SimpleNamespace(num_scheduled_tokens={r.request_id: n
                                                       for r, n in scheduled.items()},
                                 has_sync_kv_loads=False)
        meta = self.scheduler.build_metadata(output)
        assert output.has_sync_kv_loads is True
        for request, n in scheduled.items():
            request.num_computed_tokens += n
        return meta


def named(transfers: tuple) -> list[tuple[int, str]]:
    return [(ref.block_id, ref.name) for ref in transfers]


def h(request: FakeRequest, position: int) -> str:
    return hashed_block_name(request.block_hashes[position])


def q(request: FakeRequest, position: int) -> str:
    return request_block_name("E", request.request_id, position)


def only(meta: LayerwiseMetadata) -> RequestTransfers:
    (transfers,) = meta.requests
    return transfers


def test_prefill_saves_full_blocks_by_hash_and_the_tail_by_request() -> None:
    harness, r = Harness(), FakeRequest("a", 10)
    harness.admit(r, 100, 3)
    t = only(harness.step({r: 10}))
    assert t.load_shared_layers == () and t.load_every_layer == ()
    assert named(t.save) == [(100, h(r, 0)), (101, h(r, 1)), (102, q(r, 2))]


def test_decode_reloads_the_context_and_resaves_the_growing_tail() -> None:
    harness, r = Harness(), FakeRequest("a", 10)
    harness.admit(r, 100, 3)
    harness.step({r: 10})
    t = only(harness.step({r: 1}))
    assert named(t.load_shared_layers) == [(100, h(r, 0)), (101, h(r, 1)), (102, q(r, 2))]
    assert named(t.save) == [(102, q(r, 2))]
    assert LayerwiseMetadata((t,)).loads(shared_layer=False) == []


def test_a_block_hashed_late_is_promoted_after_it_was_reloaded() -> None:
    """Async scheduling: the block filled by a step gets its hash only after the step."""
    harness, r = Harness(), FakeRequest("a", 8, hashed_blocks=1)
    harness.admit(r, 100, 3)
    t = only(harness.step({r: 8}))
    assert named(t.save) == [(100, h(r, 0)), (101, q(r, 1))]
    r.block_hashes.append(b"a-1")
    t = only(harness.step({r: 1}))
    assert named(t.load_shared_layers) == [(100, h(r, 0)), (101, q(r, 1))]
    assert (101, h(r, 1)) in named(t.save)
    t = only(harness.step({r: 1}))
    assert named(t.load_shared_layers)[:2] == [(100, h(r, 0)), (101, h(r, 1))]


def test_store_hit_counts_whole_blocks_present_for_every_layer_and_never_the_last_token(
) -> None:
    r = FakeRequest("a", 13)
    stored = {KEYS.key(hashed_block_name(r.block_hashes[i]), layer)
              for i in range(3) for layer in LAYERS}
    harness = Harness(stored)
    assert harness.scheduler.num_new_matched_tokens(r, 0) == 12
    assert harness.scheduler.num_new_matched_tokens(r, 4) == 8
    short = FakeRequest("a", 12)  # 3 full blocks, but the last token must be computed
    assert harness.scheduler.num_new_matched_tokens(short, 0) == 8
    harness.stored.discard(KEYS.key(hashed_block_name(r.block_hashes[1]), 2))
    assert harness.scheduler.num_new_matched_tokens(r, 0) == 4


def test_a_dsa_hit_needs_the_indexer_part_of_every_layer_too() -> None:
    r = FakeRequest("a", 13)
    parts = [(layer, part) for layer in LAYERS for part in ("kv", "idx")]
    stored = {KEYS.key(hashed_block_name(r.block_hashes[i]), layer, part)
              for i in range(3) for layer, part in parts}
    harness = Harness(stored, parts)
    assert harness.scheduler.num_new_matched_tokens(r, 0) == 12
    # The main KV of block 1 is all there; its indexer keys for layer 2 are not.
    harness.stored.discard(KEYS.key(hashed_block_name(r.block_hashes[1]), 2, "idx"))
    assert harness.scheduler.num_new_matched_tokens(r, 0) == 4
    assert KEYS.key("h/ab", 2, "idx") != KEYS.key("h/ab", 2) == KEYS.key("h/ab", 2, "kv")


def test_a_failing_store_lookup_is_a_miss() -> None:
    def broken(keys: list[str]) -> list[bool]:
        raise RuntimeError("store down")

    scheduler = LayerwiseScheduler(block_size=BS, stored_parts=PARTS, keys=KEYS, tp_size=1,
                                   engine_id="E", store_exists=broken,
                                   block_ids_of=lambda rid: [])
    assert scheduler.num_new_matched_tokens(FakeRequest("a", 13), 0) == 0


def stored_blocks(request: FakeRequest, positions: range) -> set[str]:
    return {KEYS.key(hashed_block_name(request.block_hashes[i]), layer)
            for i in positions for layer in LAYERS}


def test_a_local_hit_the_store_lost_is_cut_from_its_first_missing_block() -> None:
    r = FakeRequest("a", 13)
    harness = Harness(stored_blocks(r, range(3)))
    harness.stored.discard(KEYS.key(hashed_block_name(r.block_hashes[1]), 2))
    harness.scheduler.on_new_request(r)
    assert harness.scheduler.num_new_matched_tokens(r, 12) is None
    assert harness.evicted == [r.block_hashes[1:3]]
    assert harness.scheduler.stats.local_hits_dropped == 1
    assert harness.scheduler.num_new_matched_tokens(r, 4) == 0  # block 1 is a miss
    whole = FakeRequest("a", 13)
    assert harness.scheduler.num_new_matched_tokens(whole, 4) == 0  # deferred once per request
    assert len(harness.evicted) == 1
    kept = FakeRequest("b", 13)
    harness.stored |= stored_blocks(kept, range(3))
    assert harness.scheduler.num_new_matched_tokens(kept, 8) == 4
    assert len(harness.evicted) == 1


def test_blocks_a_recent_step_saves_count_as_stored() -> None:
    """Async scheduling plans the next step while this one's saves run: a local hit on blocks
    whose save was just planned is kept; one the store lost after its save is not."""
    harness = Harness()
    writer = FakeRequest("w", 13)
    harness.admit(writer, 100, 4)
    harness.step({writer: 8})  # saves blocks 0, 1 by hash; not in the store yet
    reader = FakeRequest("r", 13)
    reader.block_hashes = list(writer.block_hashes)
    assert harness.scheduler.num_new_matched_tokens(reader, 8) == 0
    assert harness.evicted == []
    harness.step({writer: 4})
    harness.step({writer: 1})  # two later steps: blocks 0, 1 are long saved, or lost
    late = FakeRequest("l", 13)
    late.block_hashes = list(writer.block_hashes)
    assert harness.scheduler.num_new_matched_tokens(late, 8) is None
    assert harness.evicted == [writer.block_hashes[:2]]


def test_an_external_hit_loads_in_every_layer() -> None:
    harness, r = Harness(), FakeRequest("a", 13)
    harness.admit(r, 100, 4, external=8)
    r.num_computed_tokens = 8 + 4  # 4 local + 8 external tokens
    t = only(harness.step({r: 1}))
    assert named(t.load_every_layer) == [(101, h(r, 1)), (102, h(r, 2))]
    assert named(t.load_shared_layers) == [(100, h(r, 0)), (101, h(r, 1)), (102, h(r, 2))]
    assert named(t.save) == [(103, q(r, 3))]
    assert harness.scheduler.stats.hit_tokens == 8
    t = only(harness.step({r: 1}))
    assert t.load_every_layer == ()


def test_blocks_written_whole_in_this_step_are_not_loaded_by_another_request() -> None:
    """vLLM lets a request hit blocks that another request of the same step is computing."""
    harness = Harness()
    writer, reader = FakeRequest("w", 10), FakeRequest("r", 10)
    harness.admit(writer, 100, 3)
    harness.admit(reader, 100, 3)
    harness.blocks["r"] = [100, 101, 202]
    reader.num_computed_tokens = 8  # local hit on the writer's two full blocks
    meta = harness.step({writer: 10, reader: 2})
    reader_plan = meta.requests[1]
    assert reader_plan.load_shared_layers == ()
    assert meta.loads(shared_layer=True) == []


def test_a_rollback_reloads_only_what_is_left_and_resaves_the_rest() -> None:
    harness, r = Harness(), FakeRequest("a", 12)
    harness.admit(r, 100, 3)
    harness.step({r: 12})
    r.num_computed_tokens = 4  # vLLM truncated after a failed load of block 1
    t = only(harness.step({r: 8}))
    assert named(t.load_shared_layers) == [(100, h(r, 0))]
    assert named(t.save) == [(101, h(r, 1)), (102, h(r, 2))]


def test_an_unannounced_request_is_a_bug_with_a_clear_message() -> None:
    harness = Harness()
    harness.blocks["x"] = [1]
    with pytest.raises(RuntimeError, match="never announced"):
        harness.step({FakeRequest("x", 4): 4})


def test_a_fresh_prompt_is_looked_up_by_its_first_block_alone() -> None:
    asked: list[list[str]] = []
    harness = Harness()
    answer = harness.scheduler._exists

    def exists(keys: list[str]) -> list[bool]:
        asked.append(list(keys))
        return answer(keys)

    harness.scheduler._exists = exists
    fresh = FakeRequest("fresh", 4 * BS + 1)  # 4 full blocks
    assert harness.scheduler.num_new_matched_tokens(fresh, 0) == 0
    assert asked == [[KEYS.key(h(fresh, 0), layer) for layer in LAYERS]]
    # A hit on the first block asks for the rest and counts the leading stored blocks.
    stored = FakeRequest("stored", 4 * BS + 1)
    harness.stored |= {KEYS.key(h(stored, i), layer) for i in (0, 1, 3) for layer in LAYERS}
    asked.clear()
    assert harness.scheduler.num_new_matched_tokens(stored, 0) == 2 * BS
    assert [len(keys) for keys in asked] == [3, 9]
