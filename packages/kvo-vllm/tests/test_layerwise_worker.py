"""The worker half's per-layer pipeline, driven like vLLM's CPU attention drives it.

An in-memory store stands in for Mooncake (fakes only for this unit test of kvo's own logic;
the real store runs in tests/e2e). It copies real memory ranges, so what a layer loads into
its aliased buffer, and when, is observable.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

import pytest
import torch
from vllm.v1.attention.backend import KVCacheLayout
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.worker.utils import allocate_kv_cache

from kvo_core.config import LayerwiseOffloadConfig
from kvo_vllm.layerwise.errors import PipelineError
from kvo_vllm.layerwise.keys import StoreKeys
from kvo_vllm.layerwise.layout import apply_layout, plan_layout
from kvo_vllm.layerwise.loader import LOAD_ATTEMPTS
from kvo_vllm.layerwise.metadata import BlockRef, LayerwiseMetadata, RequestTransfers
from kvo_vllm.layerwise.staging import block_runs
from kvo_vllm.layerwise.worker_side import LayerwiseWorker

NUM_BLOCKS = 4
SPEC = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=32, dtype=torch.float32)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
KEYS = StoreKeys(namespace="t")


class MemoryStore:
    """Keys to bytes; records the order of puts and gets, can be slowed or broken."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.events: list[tuple[str, str, float]] = []
        self.put_delay = 0.0
        self.fail_puts_for: set[str] = set()
        self.fail_gets: dict[str, int] = {}  # key -> how many more gets of it raise
        self.remove_delay = 0.0
        self.lock = threading.Lock()

    def register(self, ptr: int, length: int) -> None:
        self.region = (ptr, length)

    def unregister(self, ptr: int) -> None:
        pass

    def put_from(self, keys, addrs, lengths, *, settle=None) -> None:
        """Like kvo's stores: the ranges are read, then ``settle`` names keys to leave out."""
        time.sleep(self.put_delay)
        if any(k in self.fail_puts_for for k in keys):
            raise RuntimeError("put failed")
        read = [ctypes.string_at(addr, length) for addr, length in zip(addrs, lengths,
                                                                        strict=True)]
        left_out = set(settle()) if settle is not None else set()
        with self.lock:
            for key, value in zip(keys, read, strict=True):
                if key not in left_out:
                    self.values[key] = value
                    self.events.append(("put", key, time.monotonic()))

    def get_into(self, keys, addrs, lengths) -> list[bool]:
        found = []
        with self.lock:
            broken = [k for k in keys if self.fail_gets.get(k, 0) > 0]
            for key in broken:
                self.fail_gets[key] -= 1
            if broken:  # like Mooncake's LEASE_EXPIRED: the whole batched get raises
                self.events.append(("failed-get", broken[0], time.monotonic()))
                raise RuntimeError(f"get of {broken} failed: LEASE_EXPIRED")
            for key, addr, length in zip(keys, addrs, lengths, strict=True):
                self.events.append(("get", key, time.monotonic()))
                value = self.values.get(key)
                if value is not None:
                    ctypes.memmove(addr, value, length)
                found.append(value is not None)
        return found

    def exists(self, keys) -> list[bool]:
        return [k in self.values for k in keys]

    def remove(self, keys) -> None:
        time.sleep(self.remove_delay)
        with self.lock:
            for key in keys:
                self.values.pop(key, None)

    def close(self) -> None:
        pass


def make_rig(store: MemoryStore, *, staging_bytes: int = 0, flush_nice: int = 0,
             saves_blocks: bool = True, layer_deadline_s: float = 5.0,
             ) -> tuple[LayerwiseWorker, dict]:
    """A worker over six layers sharing two buffers (layer 0 owns one); its live caches."""
    page = SPEC.page_size_bytes
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=len(NAMES) * NUM_BLOCKS * page, layers=NAMES,
                                        layer_stride=NUM_BLOCKS * page, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec(NAMES, SPEC)])
    layout = plan_layout(config, LayerwiseOffloadConfig(shared_buffers=2, prefetch_depth=1))
    apply_layout(config, layout)
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, None)
    worker = LayerwiseWorker(layout=layout, keys=KEYS, store=store, prefetch_depth=1,
                             layer_deadline_s=layer_deadline_s, staging_bytes=staging_bytes,
                             flush_nice=flush_nice, saves_blocks=saves_blocks)
    worker.register_kv_caches(caches)
    return worker, caches


@pytest.fixture
def rig():
    store = MemoryStore()
    worker, caches = make_rig(store)
    yield worker, store, caches
    worker.close()


def forward(worker: LayerwiseWorker, caches: dict, meta: LayerwiseMetadata,
            write: dict[int, float], seen: dict[str, torch.Tensor] | None = None,
            before_save: Callable[[str], None] | None = None) -> None:
    """One step as vLLM runs it: per layer cache write, wait hook, attention, save hook
    (``before_save``: what a composing connector does first, e.g. publish the layer)."""
    worker.start_step(meta)
    for name in NAMES:
        layer = int(name.split(".")[2])
        for block, base in write.items():
            caches[name][block].fill_(base + layer)  # unified_kv_cache_update
        worker.before_attention(name)  # wait_for_layer_load
        if seen is not None:
            seen[name] = caches[name].clone()  # what attention reads
        if before_save is not None:
            before_save(name)
        worker.after_attention(name)  # save_kv_layer
    worker.finish_step()


def two_request_meta(first: RequestTransfers, second: RequestTransfers) -> LayerwiseMetadata:
    return LayerwiseMetadata(requests=(first, second))


def step_meta(*, save: list[tuple[int, str]] = (), shared: list[tuple[int, str]] = (),
              every: list[tuple[int, str]] = ()) -> LayerwiseMetadata:
    refs = lambda pairs: tuple(BlockRef(b, n) for b, n in pairs)  # noqa: E731
    return LayerwiseMetadata(requests=(RequestTransfers(
        request_id="r", load_every_layer=refs(every), load_shared_layers=refs(shared),
        save=refs(save)),))


def test_every_layer_sees_its_own_context_although_buffers_are_shared(rig) -> None:
    worker, store, caches = rig
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 100.0})
    assert {k for k in store.values} == {KEYS.key("b1", i) for i in range(6)}
    seen: dict[str, torch.Tensor] = {}
    forward(worker, caches, step_meta(shared=[(1, "b1")], save=[(2, "b2")]), {2: 200.0},
            seen)
    for i, name in enumerate(NAMES):
        assert torch.all(seen[name][1] == 100.0 + i), name  # reloaded, not a neighbour's
        assert torch.all(seen[name][2] == 200.0 + i), name
    assert worker.stats.loaded_blocks == 5  # layer 0 has its own buffer
    assert worker.stats.loaded_blocks_by_layer == {i: 1 for i in range(1, 6)}


def test_a_shared_buffer_is_refilled_only_after_the_previous_save_finished(rig) -> None:
    worker, store, caches = rig
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 1.0})
    store.events.clear()
    store.put_delay = 0.05
    forward(worker, caches, step_meta(shared=[(1, "b1")], save=[(2, "b2")]), {2: 2.0})
    time_of = {(kind, key): t for kind, key, t in store.events}
    for layer in range(3, 6):  # layer L reuses layer L-2's buffer
        saved = time_of[("put", KEYS.key("b2", layer - 2))]
        loaded = time_of[("get", KEYS.key("b1", layer))]
        assert saved < loaded, f"layer {layer} overwrote layer {layer - 2} before its save"


def test_a_cold_step_overwrites_a_shared_buffer_only_after_its_save(rig) -> None:
    """Nothing to load (a cold prefill): the slot wait runs on the forward's own thread, and
    still no layer writes a shared buffer before the previous occupant's save took it whole."""
    worker, store, caches = rig
    store.put_delay = 0.05
    stored_before_write: dict[int, set[str]] = {}
    worker.start_step(step_meta(save=[(1, "b1")]))
    for name in NAMES:
        layer = int(name.split(".")[2])
        with store.lock:
            stored_before_write[layer] = set(store.values)
        caches[name][1].fill_(100.0 + layer)  # unified_kv_cache_update
        worker.before_attention(name)
        worker.after_attention(name)
    worker.finish_step()
    assert not worker.registered.loader.loads_pending and worker.stats.loaded_blocks == 0
    for layer in range(3, 6):  # layer L reuses layer L-2's buffer
        assert KEYS.key("b1", layer - 2) in stored_before_write[layer], layer
    page = caches[NAMES[0]][1].numel()
    for layer in range(6):
        value = torch.frombuffer(bytearray(store.values[KEYS.key("b1", layer)]),
                                 dtype=torch.float32)[:page]
        assert torch.all(value == 100.0 + layer), f"layer {layer}'s save was torn"


def test_a_missing_block_is_reported_as_a_load_error(rig) -> None:
    worker, _, caches = rig
    forward(worker, caches, step_meta(every=[(3, "never-saved")]), {})
    assert worker.take_load_errors() == {3}
    assert worker.take_load_errors() == set()
    assert worker.stats.failed_loads == 6


def test_a_failed_save_is_never_loaded_later(rig) -> None:
    worker, store, caches = rig
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 1.0})
    store.fail_puts_for = {KEYS.key("b1", 3)}
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 9.0})
    assert worker.stats.failed_saves == 1
    store.fail_puts_for = set()
    store.values[KEYS.key("b1", 3)] = bytes(SPEC.page_size_bytes)  # a stale value survives
    forward(worker, caches, step_meta(shared=[(1, "b1")], save=[(2, "b2")]), {2: 2.0})
    assert worker.take_load_errors() == {1}


def test_the_first_layer_must_be_made_ready_before_attention(rig) -> None:
    worker = rig[0]
    # A step with work under way, but its first layer was never made ready.
    worker._step_active = True
    with pytest.raises(PipelineError, match="before its buffer was made ready"):
        worker.before_attention(NAMES[0])


def test_request_blocks_are_removed_when_the_request_finishes(rig) -> None:
    worker, store, caches = rig
    forward(worker, caches, step_meta(save=[(1, "q/E/r/0"), (2, "h/ab")]), {1: 1.0, 2: 2.0})
    worker.forget_requests({"r"})
    worker.poisoned.settle()
    assert {k for k in store.values} == {KEYS.key("h/ab", i) for i in range(6)}


def test_a_get_that_raises_is_retried_with_a_fresh_call(rig) -> None:
    worker, store, caches = rig
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 100.0})
    store.fail_gets = {KEYS.key("b1", 3): LOAD_ATTEMPTS - 1}
    seen: dict[str, torch.Tensor] = {}
    forward(worker, caches, step_meta(shared=[(1, "b1")], save=[(2, "b2")]), {2: 200.0},
            seen)
    assert worker.take_load_errors() == set()
    assert torch.all(seen[NAMES[3]][1] == 103.0)  # layer 3's own context, loaded on a retry
    assert worker.stats.failed_loads == 0


def step_with_a_failed_shared_load(worker: LayerwiseWorker, store: MemoryStore, caches: dict,
                                   seen: dict[str, torch.Tensor] | None = None) -> None:
    """Two steps: b1 and b2 saved; then request r loads b1, whose layer 3 cannot be read
    (every try raises), and saves h/late and b2 again, beside request s saving c3."""
    forward(worker, caches, step_meta(save=[(1, "b1"), (2, "b2")]), {1: 100.0, 2: 50.0})
    store.fail_gets = {KEYS.key("b1", 3): LOAD_ATTEMPTS}
    tainted = RequestTransfers(request_id="r", load_shared_layers=(BlockRef(1, "b1"),),
                               save=(BlockRef(1, "h/late"), BlockRef(2, "b2")))
    healthy = RequestTransfers(request_id="s", save=(BlockRef(3, "c3"),))
    forward(worker, caches, two_request_meta(tainted, healthy), {2: 200.0, 3: 300.0}, seen)


def test_a_shared_layer_that_cannot_load_taints_only_its_requests_saves(rig) -> None:
    worker, store, caches = rig
    seen: dict[str, torch.Tensor] = {}
    step_with_a_failed_shared_load(worker, store, caches, seen)
    # Layer 3 attended over layer 1's KV (its buffer's previous occupant), not its own ...
    assert torch.all(seen[NAMES[3]][1] == 101.0)
    # ... so vLLM is told, and drops and recomputes (or fails) request r ...
    assert worker.take_load_errors() == {1}
    # ... and nothing r computed from layer 3 on (nor the stale block) reaches the store;
    # b2's older value from the previous step is removed too, never loaded as current.
    worker.poisoned.settle()
    for name in ("h/late", "b2"):
        assert {i for i in range(6) if KEYS.key(name, i) in store.values} == {0, 1, 2}, name
    assert {i for i in range(6) if KEYS.key("c3", i) in store.values} == set(range(6))
    store.values[KEYS.key("b2", 4)] = bytes(SPEC.page_size_bytes)  # even if a copy survives
    forward(worker, caches, step_meta(shared=[(2, "b2")]), {})
    assert worker.take_load_errors() == {2}
    # The next step is clean again: r, recomputed, saves every layer.
    forward(worker, caches, step_meta(save=[(1, "h/late"), (2, "b2")]), {1: 1.0, 2: 2.0})
    assert worker.take_load_errors() == set()
    assert all(KEYS.key("b2", i) in store.values for i in range(6))


def test_a_step_that_poisons_keys_ends_only_once_they_are_removed(rig) -> None:
    """Else the scheduler's next prefix lookup could still find them and promise them to
    another request, whose load of them would then fail."""
    worker, store, caches = rig
    forward(worker, caches, step_meta(save=[(1, "b1"), (2, "b2")]), {1: 100.0, 2: 50.0})
    store.fail_gets = {KEYS.key("b1", 3): LOAD_ATTEMPTS}
    store.remove_delay = 0.5  # e.g. waiting out a read lease
    forward(worker, caches, step_meta(shared=[(1, "b1")], save=[(2, "b2")]), {2: 200.0})
    assert worker.take_load_errors() == {1}
    # No settle() here: the step's end waited for the removal.
    assert {i for i in range(6) if KEYS.key("b2", i) in store.values} == {0, 1, 2}


def test_requests_that_lost_a_load_are_named_from_that_layer_on(rig) -> None:
    """What KvoMultiConnector asks before publishing a layer to decode: a request whose load
    failed at layer 3 attended over another layer's KV from there on, so layers 3.. of it must
    not be handed on; the healthy request is never named."""
    worker, store, caches = rig
    forward(worker, caches, step_meta(save=[(1, "b1"), (2, "b2")]), {1: 100.0, 2: 50.0})
    store.fail_gets = {KEYS.key("b1", 3): LOAD_ATTEMPTS}
    tainted = RequestTransfers(request_id="r", load_shared_layers=(BlockRef(1, "b1"),),
                               save=(BlockRef(2, "b2"),))
    healthy = RequestTransfers(request_id="s", save=(BlockRef(3, "c3"),))
    named: dict[str, set[str]] = {}
    worker.start_step(two_request_meta(tainted, healthy))
    for name in NAMES:
        worker.before_attention(name)
        named[name] = worker.requests_with_failed_loads()  # before save_kv_layer publishes
        worker.after_attention(name)
    worker.finish_step()
    assert [named[n] for n in NAMES] == [set()] * 3 + [{"r"}] * (len(NAMES) - 3)
    assert worker.take_load_errors() == {1}
    forward(worker, caches, step_meta(save=[(2, "b2")]), {2: 2.0})
    assert worker.requests_with_failed_loads() == set()  # a new step starts clean


# -- DSA layers: the main KV and the indexer key cache move together -------------------------

DSA_MAIN = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=16, dtype=torch.float32,
                            cache_role=SparseCacheRole.SPARSE)
DSA_INDEXER = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=8, dtype=torch.uint8,
                               cache_role=SparseCacheRole.INDEXER)
DSA_ATTN = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
DSA_KEYS = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(3)]


@pytest.fixture
def dsa_rig():
    index_bytes = 3 * NUM_BLOCKS * DSA_INDEXER.page_size_bytes
    size = index_bytes + 3 * NUM_BLOCKS * DSA_MAIN.page_size_bytes
    specs = {**{n: DSA_MAIN for n in DSA_ATTN}, **{n: DSA_INDEXER for n in DSA_KEYS}}
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size=size, layers=list(DSA_KEYS),
                          layer_stride=NUM_BLOCKS * DSA_INDEXER.page_size_bytes,
                          block_stride=DSA_INDEXER.page_size_bytes),
            KVCacheTensor(size=size, layers=list(DSA_ATTN),
                          layer_stride=NUM_BLOCKS * DSA_MAIN.page_size_bytes,
                          block_stride=DSA_MAIN.page_size_bytes, offset=index_bytes)],
        kv_cache_groups=[KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs(
            block_size=32, kv_cache_specs=specs))])
    layout = plan_layout(config, LayerwiseOffloadConfig(shared_buffers=1, prefetch_depth=0))
    assert [list(s.layers) for s in layout.plan.slots] == [[0], [1, 2]]
    apply_layout(config, layout)
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC, None)
    store = MemoryStore()
    worker = LayerwiseWorker(layout=layout, keys=KEYS, store=store, prefetch_depth=0,
                             layer_deadline_s=5.0)
    worker.register_kv_caches(caches)
    yield worker, store, caches
    worker.close()


def dsa_forward(worker: LayerwiseWorker, caches: dict, meta: LayerwiseMetadata,
                write: dict[int, int], seen: dict[str, torch.Tensor] | None = None) -> None:
    """One step: per layer the indexer writes its keys, MLA its KV, then the hooks."""
    worker.start_step(meta)
    for layer, (attn, keys) in enumerate(zip(DSA_ATTN, DSA_KEYS, strict=True)):
        for block, base in write.items():
            caches[keys][block].fill_(base + layer)
            caches[attn][block].fill_(float(base + layer))
        worker.before_attention(attn)
        if seen is not None:
            seen[attn], seen[keys] = caches[attn].clone(), caches[keys].clone()
        worker.after_attention(attn)
    worker.finish_step()


def test_dsa_layers_save_and_reload_main_kv_and_indexer_under_part_keys(dsa_rig) -> None:
    worker, store, caches = dsa_rig
    dsa_forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 10})
    assert set(store.values) == {KEYS.key("b1", i, part) for i in range(3)
                                 for part in ("kv", "idx")}
    seen: dict[str, torch.Tensor] = {}
    dsa_forward(worker, caches, step_meta(shared=[(1, "b1")], save=[(2, "b2")]), {2: 20}, seen)
    for i, (attn, keys) in enumerate(zip(DSA_ATTN, DSA_KEYS, strict=True)):
        # Layer 2 took layer 1's slot; both its caches were reloaded from the store.
        assert torch.all(seen[attn][1] == 10.0 + i) and torch.all(seen[keys][1] == 10 + i)
        assert torch.all(seen[attn][2] == 20.0 + i) and torch.all(seen[keys][2] == 20 + i)
    assert worker.stats.loaded_blocks_by_layer == {1: 1, 2: 1}  # layer 0 owns its buffer
    main_page, index_page = DSA_MAIN.page_size_bytes, DSA_INDEXER.page_size_bytes
    assert worker.stats.loaded_bytes_by_part == {"kv": 2 * main_page, "idx": 2 * index_page}
    assert worker.stats.saved_bytes_by_part == {"kv": 6 * main_page, "idx": 6 * index_page}
    assert worker.slot_key(DSA_KEYS[2]) == worker.slot_key(DSA_ATTN[1]) != worker.slot_key(
        DSA_ATTN[0])


def test_a_missing_indexer_part_fails_the_block(dsa_rig) -> None:
    worker, store, caches = dsa_rig
    dsa_forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 10})
    del store.values[KEYS.key("b1", 2, "idx")]  # the main KV of layer 2 is still there
    dsa_forward(worker, caches, step_meta(shared=[(1, "b1")]), {})
    assert worker.take_load_errors() == {1}
    assert worker.stats.failed_loads == 1 and worker.stats.missing_blocks == 1
    assert worker.stats.loaded_blocks_by_layer[1] == 1  # layer 1 loaded both parts
    assert worker.stats.loaded_blocks_by_layer.get(2, 0) == 0


def test_one_key_for_two_blocks_is_read_once_and_copied(rig) -> None:
    """Two requests with one prefix: the same stored block goes to two device blocks."""
    worker, store, caches = rig
    forward(worker, caches, step_meta(save=[(1, "h/p")]), {1: 50.0})
    store.events.clear()
    both = LayerwiseMetadata(requests=(
        RequestTransfers(request_id="a", load_shared_layers=(BlockRef(1, "h/p"),)),
        RequestTransfers(request_id="b", load_every_layer=(BlockRef(3, "h/p"),))))
    seen: dict[str, torch.Tensor] = {}
    forward(worker, caches, both, {}, seen)
    for i, name in enumerate(NAMES):
        assert torch.all(seen[name][3] == 50.0 + i), name  # the copy, in every layer
        if i:
            assert torch.all(seen[name][1] == 50.0 + i), name  # shared layers reloaded it
    gets = [key for kind, key, _ in store.events if kind == "get"]
    assert len(gets) == len(set(gets)) == 6  # one get of the key per layer, never two
    assert worker.take_load_errors() == set()


def test_a_failed_remote_read_lets_the_slots_own_save_finish_first(rig) -> None:
    """A decode's read of a slot fails (another part of the slot's round) while the store
    save of the same slot is still running: the slot is refilled only after the save, and
    the save is kept (not poisoned), so the next step finds every layer in the store."""
    worker, store, caches = rig

    def failing_remote_read(layer_name: str) -> None:
        part = f"remote:{layer_name}"
        slot = worker.slot_key(layer_name)
        worker.gates.announce(slot, part)  # the round takes it when the layer closes
        worker.gates.mark_failed(slot, part, "decode failed to read")  # before it does

    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 1.0})
    store.events.clear()
    store.put_delay = 0.05
    forward(worker, caches, step_meta(shared=[(1, "b1")], save=[(2, "b2")]), {2: 2.0},
            before_save=failing_remote_read)
    # The last layer's round took the announced read, and it failed.
    last_round = worker.gates.error(worker.slot_key(NAMES[-1]))
    assert last_round is not None and "decode failed to read" in last_round
    assert {KEYS.key("b2", i) for i in range(6)} <= set(store.values)  # no save poisoned
    time_of = {(kind, key): t for kind, key, t in store.events}
    for layer in range(3, 6):  # layer L reuses layer L-2's buffer
        saved = time_of[("put", KEYS.key("b2", layer - 2))]
        loaded = time_of[("get", KEYS.key("b1", layer))]
        assert saved < loaded, f"layer {layer} overwrote layer {layer - 2} before its save"


def test_a_block_outside_the_cache_has_no_address(rig) -> None:
    """The loader's memmove of a key read once for two blocks writes at these addresses: a
    block id past the cache is refused, not written into another layer's blocks."""
    worker, _, _ = rig
    part = worker.registered.buffers.by_name[NAMES[0]].parts[0]
    last = NUM_BLOCKS - 1
    assert part.address(last) == part.pointer + last * part.planned.block_bytes
    with pytest.raises(IndexError, match=f"outside the {NUM_BLOCKS} blocks"):
        part.address(NUM_BLOCKS)
    with pytest.raises(IndexError):
        part.address(-1)


def test_block_runs_address_the_same_bytes_as_their_blocks(dsa_rig) -> None:
    """The step-end batch addresses held layers by block runs: the same addresses and sizes,
    in the same order (part by part, blocks in the order given), as block by block; a run
    reaching past the cache is refused."""
    worker = dsa_rig[0]
    buffer = worker.registered.buffers.in_order[0]
    assert len(buffer.parts) == 2
    ids = [1, 2, 0, 3]
    refs = [BlockRef(block, f"h/{block}") for block in ids]
    assert buffer.run_locations(block_runs(ids)) == buffer.locations(refs)
    assert buffer.run_locations([]) == ([], [])
    with pytest.raises(IndexError, match="outside"):
        buffer.run_locations([(NUM_BLOCKS - 2, 3)])


@pytest.mark.parametrize("staging_bytes", [0, 1 << 20])
def test_replicated_kv_is_saved_by_rank_0_only_and_loaded_by_every_rank(
        staging_bytes: int) -> None:
    """MLA KV is the same on every TP rank: rank 0 saves each block once under keys every rank
    shares; another rank (``saves_blocks=False``) puts and removes nothing, and loads those
    keys into its own buffers."""
    store = MemoryStore()
    rank0, caches0 = make_rig(store, staging_bytes=staging_bytes)
    rank1, caches1 = make_rig(store, staging_bytes=staging_bytes, saves_blocks=False)
    try:
        private = "q/e/r/0"
        for worker, caches in ((rank0, caches0), (rank1, caches1)):
            forward(worker, caches, step_meta(save=[(1, "b1"), (2, private)]),
                    {1: 100.0, 2: 50.0})
            worker.wait_staged_puts()
        assert set(store.values) == {KEYS.key(name, i) for name in ("b1", private)
                                     for i in range(6)}
        assert rank1.stats.saved_blocks == 0
        puts = [key for kind, key, _ in store.events if kind == "put"]
        assert len(puts) == len(set(puts)) == 12            # each key put once, by rank 0
        seen: dict[str, torch.Tensor] = {}
        forward(rank1, caches1, step_meta(shared=[(1, "b1")], save=[(3, "b3")]), {3: 3.0},
                seen)
        for i, name in enumerate(NAMES):
            assert torch.all(seen[name][1] == 100.0 + i), name   # rank 0's bytes
        assert rank1.stats.loaded_blocks == 5
        rank1.forget_requests({"r"})                         # removes nothing of rank 0's
        assert KEYS.key(private, 0) in store.values
        rank0.forget_requests({"r"})
        rank0.wait_staged_puts()
        deadline = time.monotonic() + 5
        while KEYS.key(private, 0) in store.values and time.monotonic() < deadline:
            time.sleep(0.01)
        assert KEYS.key(private, 0) not in store.values
    finally:
        rank0.close()
        rank1.close()


def test_a_drafters_later_passes_over_the_last_layer_save_nothing(rig) -> None:
    """MTP with 2 draft tokens: the drafter runs the last (draft) layer twice per step, the
    second pass writing a row past the step's tokens (block 2 here). The layer is saved once,
    with the first pass's rows; the later pass neither saves again nor readies anything."""
    worker, store, caches = rig
    draft = NAMES[-1]
    worker.start_step(step_meta(save=[(1, "b1")]))
    for i, name in enumerate(NAMES):
        caches[name][1].fill_(100.0 + i)
        worker.before_attention(name)
        worker.after_attention(name)
    caches[draft][2].fill_(-1.0)          # the drafter's second pass: a later row
    worker.before_attention(draft)
    worker.after_attention(draft)
    worker.finish_step()
    puts = [key for kind, key, _ in store.events if kind == "put"]
    assert sorted(puts) == sorted(KEYS.key("b1", i) for i in range(len(NAMES)))
    assert worker.stats.saved_blocks == len(NAMES)
    stored = torch.frombuffer(bytearray(store.values[KEYS.key("b1", len(NAMES) - 1)]),
                              dtype=caches[draft].dtype)
    assert bool((stored == 100.0 + len(NAMES) - 1).all())
