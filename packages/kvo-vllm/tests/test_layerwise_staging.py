"""Staged layer saves: the slot is free after a host copy, the put follows the forward.

Same rig as test_layerwise_worker (an in-memory store stands in for Mooncake in this unit
test of kvo's own logic; the e2e layerwise tests run staging in vLLM, it is on by default).
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_layerwise_worker import (
    KEYS,
    NAMES,
    SPEC,
    MemoryStore,
    forward,
    make_rig,
    step_meta,
    step_with_a_failed_shared_load,
)

from kvo_core.errors import ConfigError
from kvo_vllm.layerwise.worker_side import LayerwiseWorker

PAGE = SPEC.page_size_bytes


class CountingStore(MemoryStore):
    """Counts put calls; ``gate`` (when set) holds every put until it is opened."""

    def __init__(self) -> None:
        super().__init__()
        self.put_calls: list[int] = []
        self.gate: threading.Event | None = None

    def put_from(self, keys, addrs, lengths, *, settle=None) -> None:
        if self.gate is not None:
            assert self.gate.wait(10)
        self.put_calls.append(len(keys))
        super().put_from(keys, addrs, lengths, settle=settle)


def make_worker(staging_bytes: int) -> tuple[LayerwiseWorker, CountingStore, dict]:
    store = CountingStore()
    worker, caches = make_rig(store, staging_bytes=staging_bytes)
    return worker, store, caches


@pytest.fixture
def staged():
    worker, store, caches = make_worker(64 * PAGE)
    yield worker, store, caches
    worker.close()


def stored_value(store: MemoryStore, key: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(store.values[key]), dtype=torch.float32)


def test_a_cold_step_releases_slots_before_any_put_and_puts_once_after(staged) -> None:
    worker, store, caches = staged
    store.gate = threading.Event()  # no put can land while the forward runs
    forward(worker, caches, step_meta(save=[(1, "b1"), (2, "b2")]), {1: 100.0, 2: 50.0})
    # The forward ended (layers 2.. reused shared slots) although nothing is stored yet.
    # Layers 1-3 were copied; 0, 4 and 5 (the last of their buffers) wait in place.
    assert store.values == {} and worker.stats.staged_bytes == 3 * 2 * PAGE
    assert worker.stats.held_bytes == 3 * 2 * PAGE
    store.gate.set()
    worker.wait_staged_puts()
    assert store.put_calls == [12]  # one batched put for the whole step
    for layer in range(6):  # every layer's own bytes, not a later occupant's
        assert torch.all(stored_value(store, KEYS.key("b1", layer)) == 100.0 + layer)
        assert torch.all(stored_value(store, KEYS.key("b2", layer)) == 50.0 + layer)
    assert worker.stats.saved_blocks == 12 and worker.stats.staging_fallbacks == 0


def test_the_next_step_loads_only_after_the_staged_put(staged) -> None:
    worker, store, caches = staged
    store.put_delay = 0.05
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 100.0})
    seen: dict[str, torch.Tensor] = {}
    forward(worker, caches, step_meta(shared=[(1, "b1")], save=[(2, "b2")]), {2: 200.0},
            seen)
    assert worker.take_load_errors() == set()
    for i, name in enumerate(NAMES):
        assert torch.all(seen[name][1] == 100.0 + i), name


def test_a_layer_that_does_not_fit_is_saved_from_its_buffer() -> None:
    worker, store, caches = make_worker(2 * PAGE)  # room for 2 of the 3 copied layers
    try:
        forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 7.0})
        worker.wait_staged_puts()
        assert worker.stats.staging_fallbacks == 1  # layer 3
        assert worker.stats.staged_bytes == 2 * PAGE
        for layer in range(6):
            assert torch.all(stored_value(store, KEYS.key("b1", layer)) == 7.0 + layer)
        # The area is free again for the next step.
        forward(worker, caches, step_meta(save=[(2, "b2")]), {2: 8.0})
        worker.wait_staged_puts()
        assert worker.stats.staging_fallbacks == 2
        assert all(KEYS.key("b2", layer) in store.values for layer in range(6))
    finally:
        worker.close()


def test_the_last_layer_of_each_buffer_is_put_in_place_and_its_slot_held_until_then(
        staged) -> None:
    worker, store, caches = staged
    store.gate = threading.Event()
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 100.0})
    slot = {name: worker.slot_key(name) for name in NAMES}
    # Three buffers, each held by its last layer (0, then 4 after 2, then 5 after 1 and 3).
    assert len(set(slot.values())) == 3
    assert not any(worker.gates.is_open(key) for key in slot.values())
    waiter = threading.Thread(target=worker.wait_staged_puts)  # what handle_preemptions does
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # the next step may not write a buffer yet
    store.gate.set()
    waiter.join(5)
    assert not waiter.is_alive()
    assert all(worker.gates.is_open(key) for key in slot.values())
    for layer in range(6):
        assert torch.all(stored_value(store, KEYS.key("b1", layer)) == 100.0 + layer)


def test_the_next_step_writes_a_held_buffer_only_after_its_put(staged) -> None:
    worker, store, caches = staged
    store.put_delay = 0.1
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 100.0})
    # The next step rewrites block 1 in every layer (a recompute of the same block).
    forward(worker, caches, step_meta(save=[(2, "b2")]), {1: 900.0, 2: 5.0})
    worker.wait_staged_puts()
    for layer in range(6):
        assert torch.all(stored_value(store, KEYS.key("b1", layer)) == 100.0 + layer)
        assert torch.all(stored_value(store, KEYS.key("b2", layer)) == 5.0 + layer)


def test_a_held_buffer_given_up_on_during_the_put_has_its_keys_removed(staged) -> None:
    from kvo_core.errors import SlotTimeoutError

    worker, store, caches = staged
    store.gate = threading.Event()
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 100.0})
    layer0 = worker.slot_key(NAMES[0])
    for part in worker.gates.pending(layer0):  # a waiter's deadline passed: it overwrites
        worker.gates.mark_failed(layer0, part, SlotTimeoutError("test deadline"))
    store.gate.set()
    worker.wait_staged_puts()
    worker.poisoned.settle()
    assert KEYS.key("b1", 0) not in store.values  # maybe torn: never served
    assert all(KEYS.key("b1", layer) in store.values for layer in range(1, 6))


def test_a_staging_area_below_one_block_is_refused_with_the_minimum() -> None:
    with pytest.raises(ConfigError, match=rf"save_staging_bytes=100 .*>= {PAGE}"):
        make_worker(100)


def test_a_failed_staged_put_poisons_its_keys(staged) -> None:
    worker, store, caches = staged
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 1.0})
    worker.wait_staged_puts()
    store.fail_puts_for = {KEYS.key("b1", 3)}
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 9.0})
    worker.wait_staged_puts()
    assert worker.stats.failed_saves == 6  # the batch failed whole
    assert not any(KEYS.key("b1", layer) in store.values for layer in range(6))
    store.fail_puts_for = set()
    store.values[KEYS.key("b1", 3)] = bytes(PAGE)  # a stale value survives the removal
    forward(worker, caches, step_meta(shared=[(1, "b1")], save=[(2, "b2")]), {2: 2.0})
    assert worker.take_load_errors() == {1}


def test_a_finished_requests_blocks_are_removed_after_their_staged_put(staged) -> None:
    worker, store, caches = staged
    store.put_delay = 0.1
    forward(worker, caches, step_meta(save=[(1, "q/E/r/0"), (2, "h/ab")]), {1: 1.0, 2: 2.0})
    worker.forget_requests({"r"})  # while the put is still running
    worker.wait_staged_puts()
    worker.registered.saver._flusher.submit(lambda: None).result()
    worker.poisoned.settle()
    assert set(store.values) == {KEYS.key("h/ab", i) for i in range(6)}


def test_a_lookup_in_the_same_process_sees_the_staged_blocks(staged) -> None:
    worker, store, caches = staged
    store.put_delay = 0.1
    forward(worker, caches, step_meta(save=[(1, "h/x")]), {1: 1.0})
    worker.parts.pending_puts.wait(5.0)  # what the scheduler half's prefix lookup does first
    assert store.exists([KEYS.key("h/x", i) for i in range(6)]) == [True] * 6


def test_a_running_put_is_pending_until_it_is_counted(staged) -> None:
    worker, store, caches = staged
    store.gate = threading.Event()
    assert not worker.staged_put_pending()  # no put yet
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 3.0})
    assert worker.staged_put_pending() and worker.stats.saved_bytes == 0
    store.gate.set()
    worker.parts.pending_puts.wait(5.0)
    # Once not pending, the counters already hold the put's bytes (the order the connector
    # relies on: ask first, then read the counters).
    assert not worker.staged_put_pending()
    assert worker.stats.saved_bytes == 6 * PAGE


def test_a_hung_put_stops_counting_as_pending_after_twice_the_deadline(caplog) -> None:
    store = CountingStore()
    worker, caches = make_rig(store, staging_bytes=64 * PAGE, layer_deadline_s=0.05)
    try:
        store.gate = threading.Event()
        forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 3.0})
        worker.registered.saver._flush.started -= 1.0  # the put ran for more than 2 x 0.05 s
        assert not worker.staged_put_pending()
        assert "staged put has run for more than 0.1 s" in caplog.text
        store.gate.set()
        worker.parts.pending_puts.wait(5.0)
    finally:
        worker.close()


def test_a_staged_layer_nothing_else_reads_opens_no_slot_round(staged) -> None:
    """The copy ends before the save hook returns, so a staged layer with no announced
    reader closes no round: only the held layers (the last of each buffer) do."""
    worker, store, caches = staged
    closed: list[tuple[int, ...]] = []
    close_each = worker.gates.close_each  # every close goes through it

    def recording_close_each(rounds, **kw):
        rounds = list(rounds)
        closed.extend(key for key, _ in rounds)
        return close_each(rounds, **kw)

    worker.gates.close_each = recording_close_each  # type: ignore[method-assign]
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 100.0})
    worker.wait_staged_puts()
    assert sorted(closed) == sorted(worker.slot_key(NAMES[i]) for i in (0, 4, 5))
    for layer in range(6):
        assert torch.all(stored_value(store, KEYS.key("b1", layer)) == 100.0 + layer)


def test_a_staged_layer_with_an_announced_reader_holds_its_slot_until_the_read(staged) -> None:
    """A composing connector's read of a staged layer (announced before the save) keeps
    the buffer from its next layer until the read reports."""
    worker, store, caches = staged
    slot = worker.slot_key(NAMES[1])  # layer 3 reuses it
    part = "remote:1"

    def announce_read(layer_name: str) -> None:
        if layer_name == NAMES[1]:
            worker.gates.announce(slot, part)

    seen: dict[str, torch.Tensor] = {}
    step = threading.Thread(target=forward, args=(
        worker, caches, step_meta(save=[(1, "b1")]), {1: 100.0}, seen, announce_read))
    step.start()
    step.join(0.3)
    assert step.is_alive() and NAMES[3] not in seen  # waiting for the read of layer 1
    assert worker.gates.pending(slot) == {part}
    worker.gates.mark_done(slot, part)
    step.join(5)
    assert not step.is_alive()
    worker.wait_staged_puts()
    for layer in range(6):
        assert torch.all(stored_value(store, KEYS.key("b1", layer)) == 100.0 + layer)


def test_the_gather_copies_blocks_in_the_order_asked_and_refuses_what_does_not_fit() -> None:
    from kvo_vllm.layerwise.staging import SaveStaging, block_rows, block_runs

    cache = torch.arange(10 * 4 * 8, dtype=torch.float32).view(10, 4, 8)  # 10 blocks
    rows = block_rows(cache, 4 * 8 * 4)
    staging = SaveStaging(8 * 128, min_bytes=128)
    ids = [3, 4, 5, 9, 0, 1, 7]  # runs, a step back, a lone block
    assert block_runs(ids) == [(3, 3), (9, 1), (0, 2), (7, 1)]
    address = staging.gather(rows, block_runs(ids), 128)
    assert address == staging.pointer + 128
    copied = staging.area[128:128 + 7 * 128].view(torch.float32).view(7, 4, 8)
    assert torch.equal(copied, cache[ids])
    with pytest.raises(IndexError, match="outside the cache's 10 blocks"):
        staging.gather(rows, block_runs([9, 10]), 0)
    with pytest.raises(ValueError, match="does not fit"):
        staging.gather(rows, block_runs([0, 1]), 7 * 128)


@pytest.mark.parametrize("threads", [1, 2])
def test_long_runs_are_copied_whole_by_either_copy(threads: int) -> None:
    """Runs of at least ``PARALLEL_COPY_BYTES`` go through torch when the forward has several
    threads, through memmove otherwise: the same bytes either way, next to short runs."""
    from kvo_vllm.layerwise.staging import (
        PARALLEL_COPY_BYTES,
        SaveStaging,
        block_rows,
        block_runs,
    )

    width = 64 << 10
    blocks = 2 * PARALLEL_COPY_BYTES // width + 3
    cache = torch.randn(blocks * width // 4)
    rows = block_rows(cache, width)
    staging = SaveStaging((blocks + 2) * width, min_bytes=width)
    ids = [*range(1, blocks - 1), 0]  # one long run, then a lone block
    staging.area.fill_(0xAB)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        address = staging.gather(rows, block_runs(ids), width)
    finally:
        torch.set_num_threads(before)
    assert address == staging.pointer + width
    assert torch.equal(staging.area[width:width * (len(ids) + 1)].view(len(ids), width),
                       rows[ids])
    assert torch.all(staging.area[:width] == 0xAB)  # around the copy: untouched
    assert torch.all(staging.area[width * (len(ids) + 1):] == 0xAB)
    with pytest.raises(ValueError, match="does not fit"):
        staging.gather(rows, block_runs(ids), 4 * width)


def test_vllms_pre_forward_hook_waits_for_the_put_that_reads_buffers_in_place(staged) -> None:
    """vLLM calls ``handle_preemptions`` before its copy-on-write block copies and zeroing,
    which write blocks before ``start_load_kv``: it must not return while a buffer is read."""
    from types import SimpleNamespace

    from kvo_vllm.layerwise.connector import LayerwiseStoreConnector

    worker, store, caches = staged
    store.gate = threading.Event()
    forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 1.0})
    connector = SimpleNamespace(_worker=worker)
    hook = threading.Thread(target=LayerwiseStoreConnector.handle_preemptions,
                            args=(connector, None))
    hook.start()
    hook.join(0.2)
    assert hook.is_alive() and not worker.gates.is_open(worker.slot_key(NAMES[0]))
    store.gate.set()
    hook.join(5)
    assert not hook.is_alive() and worker.gates.is_open(worker.slot_key(NAMES[0]))


@pytest.mark.parametrize("nice", [0, 7])
def test_the_batched_put_runs_in_a_thread_of_the_configured_niceness(nice: int) -> None:
    import os

    store = CountingStore()
    worker, caches = make_rig(store, staging_bytes=64 * PAGE, flush_nice=nice)
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        seen: list[int] = []

        def put_from(keys, addrs, lengths, *, settle) -> None:
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            settle()

        store.put_from = put_from  # type: ignore[method-assign]
        forward(worker, caches, step_meta(save=[(1, "b1")]), {1: 1.0})
        worker.wait_staged_puts()
        assert seen == [min(base + nice, 19)]
        assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the engine's own thread keeps it
    finally:
        worker.close()


def test_a_staged_step_with_a_failed_load_saves_only_what_its_requests_can_trust(staged) -> None:
    """The staged twin of test_layerwise_worker's taint test: the saves of the request that
    lost a load are dropped from that layer on (its keys poisoned), the other request's are
    all put by the step's batched put, and the next clean step saves every layer again."""
    worker, store, caches = staged
    step_with_a_failed_shared_load(worker, store, caches)
    assert worker.take_load_errors() == {1}
    worker.wait_staged_puts()
    worker.poisoned.settle()
    for name in ("h/late", "b2"):
        assert {i for i in range(6) if KEYS.key(name, i) in store.values} == {0, 1, 2}, name
    for layer in range(6):
        assert torch.all(stored_value(store, KEYS.key("c3", layer)) == 300.0 + layer)
    forward(worker, caches, step_meta(save=[(1, "h/late"), (2, "b2")]), {1: 1.0, 2: 2.0})
    worker.wait_staged_puts()
    assert worker.take_load_errors() == set()
    for layer in range(6):
        assert torch.all(stored_value(store, KEYS.key("b2", layer)) == 2.0 + layer)


def test_a_failed_remote_read_of_staged_layers_poisons_no_save(staged) -> None:
    """Announced reads of every layer (as KvoMultiConnector's) that fail before their rounds
    close: staged and held layers alike keep their saves, and the rounds show the failure."""
    worker, store, caches = staged

    def failing_remote_read(layer_name: str) -> None:
        part = f"remote:{layer_name}"
        slot = worker.slot_key(layer_name)
        worker.gates.announce(slot, part)
        worker.gates.mark_failed(slot, part, "decode failed to read")

    forward(worker, caches, step_meta(save=[(2, "b2")]), {2: 2.0},
            before_save=failing_remote_read)
    held_round = worker.gates.error(worker.slot_key(NAMES[-1]))  # closed at the step's end
    assert held_round is not None and "decode failed to read" in held_round
    worker.wait_staged_puts()
    worker.poisoned.settle()
    for layer in range(6):
        assert torch.all(stored_value(store, KEYS.key("b2", layer)) == 2.0 + layer)
    assert worker.stats.poisoned_keys == 0


def test_a_step_whose_blocks_come_last_first_is_copied_as_one_run(staged, monkeypatch) -> None:
    """vLLM often hands a prompt blocks in descending order (it frees a request's blocks
    last first): the step's saves are taken in block order, one copy per staged layer, and
    every key still gets its own block's bytes."""
    from kvo_vllm.layerwise.staging import SaveStaging

    worker, store, caches = staged
    runs_seen: list[list[tuple[int, int]]] = []
    gather = SaveStaging.gather

    def spy(self, rows, runs, offset):
        runs_seen.append(list(runs))
        return gather(self, rows, runs, offset)

    monkeypatch.setattr(SaveStaging, "gather", spy)
    forward(worker, caches, step_meta(save=[(3, "c3"), (2, "c2"), (1, "c1")]),
            {3: 300.0, 2: 200.0, 1: 100.0})
    worker.wait_staged_puts()
    assert runs_seen == [[(1, 3)]] * 3  # layers 1-3 copied (0, 4, 5 put in place)
    for layer in range(6):
        for block in (1, 2, 3):
            assert torch.all(stored_value(store, KEYS.key(f"c{block}", layer))
                             == 100.0 * block + layer), (layer, block)


def test_block_runs_are_runs_of_consecutive_ids_in_order() -> None:
    from kvo_vllm.layerwise.staging import block_runs

    assert block_runs([]) == []
    assert block_runs([5, 6, 7, 8]) == [(5, 4)]
    assert block_runs([1, 3, 2, 4]) == [(1, 1), (3, 1), (2, 1), (4, 1)]  # span fits, order not
    assert block_runs([4, 3, 2]) == [(4, 1), (3, 1), (2, 1)]
    assert block_runs([2, 2, 3]) == [(2, 1), (2, 2)]


def test_block_prefixes_are_each_names_block_prefix() -> None:
    names = ["h/ab", "q/e/r/0", ""]
    assert KEYS.block_prefixes(names) == [KEYS.block_prefix(name) for name in names]
    assert KEYS.for_rank(3).block_prefixes(["h/ab"]) == [KEYS.for_rank(3).block_prefix("h/ab")]
