"""Worker half of the layerwise connector: the per-layer load / save pipeline.

Order of one layer's work in vLLM 0.32 on CPU (``Attention.forward``):
``unified_kv_cache_update`` writes the step's new K/V into the layer's cache, then
``unified_attention_with_output`` runs, wrapped by ``wait_for_layer_load`` (entry) and
``save_kv_layer`` (exit). The cache is written *before* ``wait_for_layer_load``, so a layer's
buffer must be ready (its slot released by the previous occupant's save, its context loaded)
before its predecessor in the forward returns. Hence:

- ``start_step`` (from ``start_load_kv``, run before the forward) readies the first layer;
- ``after_attention(L)`` (from ``save_kv_layer``) closes L's slot gate until L's save is done
  (not for a copy to the staging area that nothing else waits for: it ends before the
  method returns), saves L (that copy, or a put submitted to the saver), then readies layer
  L+1 (already prefetched in the background when ``prefetch_depth`` > 0) and starts
  prefetching the next ones;
- readying a layer = wait on its slot gate (the previous occupant's save), then load the
  blocks the scheduler listed into the slot;
- ``finish_step`` (``wait_for_save``) waits for every save: the next step reloads from them.
  With a staging area (``staging``) a save is a copy into registered host memory, on the
  forward's thread, that releases the slot at once; ``finish_step`` hands the step's staged
  blocks to the saver as one batched put and returns, and the next step waits for that put
  before anything writes a buffer (``handle_preemptions``, then ``start_step``). The last
  layer of each buffer is not copied: the batched put reads it from the buffer, whose slot
  is closed at the step's end until the put ends (nothing in the step overwrites it). The
  keys and addresses of staged and held layers are built at the step's end too, in one
  loop, not in each layer's hook.

A get that raises (e.g. Mooncake's LEASE_EXPIRED under load) is retried ``LOAD_ATTEMPTS``
times. A load that still fails is reported as invalid blocks: vLLM then drops the affected
requests' output of this step and recomputes them from their first failed block, or fails them,
as ``kv_load_failure_policy`` says. The step's forward still runs over the failed layer's buffer
(for a shared layer it holds another layer's KV), so from that layer on the affected requests'
KV is wrong: their saves for those layers are dropped and the keys poisoned (removed, never
loaded), so neither another request nor a later step loads wrong or outdated KV from the store.
A failed save poisons its keys the same way. A step that poisoned keys ends (``finish_step``)
only once they are gone from the store (at most ``layer_deadline_s``): the scheduler's next
prefix lookup must not promise them to another request, whose load would fail. A removal that
takes longer still never lands after a later save of the same key (``poisoned_keys``): it
would delete the fresh value and fail the next request that loads it.
"""

from __future__ import annotations

import ctypes
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch

from kvo_core.errors import KvoError, SlotFailedError, SlotTimeoutError
from kvo_core.gates import SlotGates, SlotKey
from kvo_vllm.layerwise.keys import REQUEST_BLOCK_MARK, StoreKeys, layer_suffix
from kvo_vllm.layerwise.layout import LayerLayout, PlannedLayer, PlannedPart, check_aliasing
from kvo_vllm.layerwise.metadata import BlockRef, LayerwiseMetadata
from kvo_vllm.layerwise.poisoned_keys import PoisonedKeys, RemovalStillRunningError
from kvo_vllm.layerwise.staging import (
    PENDING_PUTS,
    HeldSlot,
    SaveStaging,
    StagedBatch,
    block_rows,
    block_runs,
)

logger = logging.getLogger(__name__)

LoadHook = Callable[[str, torch.Tensor, list[int]], None]
"""Called after a layer's blocks were loaded, once per cache part: (cache name, cache, loaded
block ids). A dense layer has one cache (named like the layer); a DSA layer two (its MLA cache
and its indexer's key cache)."""

STORE_PART = "store"
LOAD_ATTEMPTS = 3
"""Tries of one layer's batched get before its blocks are reported as load errors."""

_block_id = operator.attrgetter("block_id")


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's niceness by ``nice`` (Linux threads have their own); where
    that is not possible the thread keeps the engine's priority (logged once per thread)."""
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice)
    except (AttributeError, OSError) as error:  # not Linux, or refused
        logger.warning("kvo layerwise: could not lower the flush thread's priority by %d: %s",
                       nice, error)


class PipelineError(KvoError, RuntimeError):
    """The per-layer pipeline was driven out of order or could not finish a layer in time."""


@attrs.define
class LayerwiseStats:
    """Counters since start-up (read by tests and the benchmark)."""

    steps: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    missing_blocks: int = 0
    """Blocks the store answered as absent (a subset of ``failed_loads``)."""
    failed_loads: int = 0
    failed_saves: int = 0
    poisoned_keys: int = 0
    save_seconds: float = 0.0
    staged_bytes: int = 0
    """Bytes copied to the staging area (then put after the forward)."""
    staging_fallbacks: int = 0
    """Layer saves that did not fit the staging area and were put from the device buffer."""
    held_bytes: int = 0
    """Bytes the batched put read straight from a buffer (each buffer's last layer of the
    step: no copy, the slot held until the put ends)."""
    stage_seconds: float = 0.0
    """Time spent copying layers into the staging area (on the forward's thread)."""
    flush_seconds: float = 0.0
    """Time of the batched puts of staged blocks (after the forward)."""
    staged_puts: int = 0
    """Batched puts of staged blocks that ended (stored or failed)."""
    flush_wait_seconds: float = 0.0
    """Time ``start_step`` waited for the previous step's staged puts."""
    load_seconds: float = 0.0
    ready_wait_seconds: float = 0.0
    """Time the forward waited for a layer to be ready (slot release + load not yet done)."""
    step_end_wait_seconds: float = 0.0
    """Time ``wait_for_save`` waited for the step's last saves (not overlapped with compute)."""
    loaded_blocks_by_layer: dict[int, int] = attrs.field(factory=dict)
    saved_bytes_by_part: dict[str, int] = attrs.field(factory=dict)
    """Bytes saved per cache part (``kv``, ``idx``)."""
    loaded_bytes_by_part: dict[str, int] = attrs.field(factory=dict)

    def metric_counters(self) -> dict[str, float]:
        """The cumulative counters kvo exports to vLLM's metrics (``kvo_vllm.metrics``)."""
        return {
            "layerwise_saved_bytes": self.saved_bytes,
            "layerwise_saved_blocks": self.saved_blocks,
            "layerwise_loaded_bytes": self.loaded_bytes,
            "layerwise_loaded_blocks": self.loaded_blocks,
            "layerwise_missing_blocks": self.missing_blocks,
            "layerwise_failed_loads": self.failed_loads,
            "layerwise_failed_saves": self.failed_saves,
            "layerwise_poisoned_keys": self.poisoned_keys,
            "layerwise_ready_wait_seconds": self.ready_wait_seconds,
            "layerwise_step_end_wait_seconds": self.step_end_wait_seconds,
        }


@attrs.frozen
class _Part:
    planned: PlannedPart
    tensor: torch.Tensor
    pointer: int
    rows: torch.Tensor
    """The cache as uint8 [blocks, block_bytes] (what the staging gather reads)."""
    num_blocks: int

    def address(self, block_id: int) -> int:
        """Where block ``block_id`` starts; refused outside the cache (a raw memmove to it
        would write into another layer's blocks unnoticed)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} is outside the {self.num_blocks} blocks of "
                             f"cache {self.planned.cache_name!r}")
        return self.pointer + block_id * self.planned.block_bytes


@attrs.frozen
class _Buffer:
    layer: PlannedLayer
    parts: tuple[_Part, ...]
    """Main KV first, then the indexer: every cache a block of this layer is stored as."""
    slot: SlotKey
    suffixes: tuple[str, ...]
    """Key endings of this layer's parts, in part order (``keys.layer_suffix``)."""

    block_bytes: int
    """One block's bytes in all parts together."""

    @property
    def tensor(self) -> torch.Tensor:
        """The main KV cache."""
        return self.parts[0].tensor

    def keys(self, keys: StoreKeys, refs: Iterable[BlockRef]) -> list[str]:
        """Store keys of ``refs`` in every part, part by part."""
        refs = list(refs)
        return [keys.key(ref.name, self.layer.index, part.planned.part)
                for part in self.parts for ref in refs]

    def keys_with(self, prefixes: list[str]) -> list[str]:
        """``keys`` from the blocks' ``StoreKeys.block_prefix``es (the per-layer save path)."""
        return [prefix + suffix for suffix in self.suffixes for prefix in prefixes]

    def locations(self, refs: list[BlockRef]) -> tuple[list[int], list[int]]:
        """(addresses, sizes) of ``refs`` in every part, part by part (the order of ``keys``)."""
        ids = [ref.block_id for ref in refs]
        addresses: list[int] = []
        sizes: list[int] = []
        if not ids:
            return addresses, sizes
        for part in self.parts:
            part.address(min(ids))  # every id is inside the cache if both ends are
            part.address(max(ids))
            width = part.planned.block_bytes
            addresses += [part.pointer + block * width for block in ids]
            sizes += [width] * len(ids)
        return addresses, sizes

    def run_locations(self, runs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """``locations`` of the blocks of ``runs`` (``block_runs``), in order: a range per run
        and part, extended in C (the step-end batch of a long prompt: one run, not a Python
        operation per block and layer)."""
        addresses: list[int] = []
        sizes: list[int] = []
        for part in self.parts:
            width = part.planned.block_bytes
            for first, length in runs:
                start = part.address(first)
                part.address(first + length - 1)
                addresses += range(start, start + length * width, width)
            sizes += [width] * (len(addresses) - len(sizes))
        return addresses, sizes


@attrs.frozen
class _DeferredSave:
    """A layer's save whose keys and batch entries are built at the step's end
    (``finish_step``), off the per-layer path."""

    buffer: _Buffer
    refs: list[BlockRef]
    staged_at: int | None
    """Offset of the layer's copy in the staging area; None: put in place from the buffer."""


@attrs.define
class _StepCounts:
    """Counters the forward's thread adds to during a step, folded into ``LayerwiseStats``
    at its end (``finish_step``)."""

    ready_wait_seconds: float = 0.0
    staged_bytes: int = 0
    stage_seconds: float = 0.0
    held_bytes: int = 0


class LayerwiseWorker:
    """Drives loads and saves around each attention layer of one worker."""

    def __init__(self, *, layout: LayerLayout, keys: StoreKeys, store: Any,
                 prefetch_depth: int, layer_deadline_s: float, staging_bytes: int = 0,
                 flush_nice: int = 0, saves_blocks: bool = True) -> None:
        self.layout = layout
        self.keys = keys
        self.saves_blocks = saves_blocks
        """False on a TP rank other than 0 when the KV is replicated across TP ranks (MLA):
        rank 0 saves every block once under keys all ranks share; this rank only loads them
        (and removes nothing: the request-private keys are rank 0's too)."""
        self.store = store
        self.prefetch_depth = prefetch_depth
        self.layer_deadline_s = layer_deadline_s
        self.staging_bytes = staging_bytes
        self.staging: SaveStaging | None = None
        self.gates = SlotGates()
        self.load_hook: LoadHook | None = None
        self.stats = LayerwiseStats()
        self._stats_lock = threading.Lock()
        self._buffers: dict[str, _Buffer] = {}
        self._layer_of_cache = {name: layer.name
                                for name, layer in layout.by_cache_name().items()}
        self._order: list[str] = [layer.name for layer in layout.layers]
        self._position = {name: i for i, name in enumerate(self._order)}
        self._held_layers: frozenset[str] = frozenset()
        """With staging: the last layer of each buffer, which a step's batched put reads in
        place."""
        self._registered: list[int] = []
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvo-lw-load")
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvo-lw-save")
        # The batched put of staged blocks, and what must follow it, in a thread of its own
        # at a lower priority (``LayerwiseOffloadConfig.flush_nice``).
        self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvo-lw-flush",
                                           initializer=lower_thread_priority,
                                           initargs=(flush_nice,))
        # Removals run in the background (they may wait out a store read lease) but never
        # land after a later save of the same key (poisoned_keys.py).
        self.poisoned = PoisonedKeys(lambda keys: self.store.remove(keys))
        self._request_blocks: dict[str, set[str]] = {}
        self._load_errors: set[int] = set()
        self._step_failed: set[int] = set()
        self._step_poisoned = False
        self._step = 0
        self._meta: LayerwiseMetadata | None = None
        self._step_active = False
        """A step with work is between ``start_step`` and ``finish_step``."""
        self._loads: dict[bool, list[BlockRef]] = {}
        self._any_loads = False
        self._saves: list[BlockRef] = []
        self._save_prefixes: list[str] = []
        self._save_runs: list[tuple[int, int]] = []
        self._step_counts = _StepCounts()
        self._pending_loads: dict[str, Future[list[int]]] = {}
        self._ready: set[str] = set()
        self._save_futures: list[Future[None]] = []
        self._staged = StagedBatch()
        self._deferred: list[_DeferredSave] = []
        self._flush: Future[bool] | None = None
        self._flush_started = 0.0
        self._flush_overdue_logged = False

    # -- set-up -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        check_aliasing(self.layout, kv_caches)
        for layer in self.layout.layers:
            parts = tuple(_Part(planned=part, tensor=kv_caches[part.cache_name],
                                pointer=kv_caches[part.cache_name].data_ptr(),
                                rows=block_rows(kv_caches[part.cache_name], part.block_bytes),
                                num_blocks=self.layout.num_blocks)
                          for part in layer.parts)
            self._buffers[layer.name] = _Buffer(
                layer=layer, parts=parts, slot=(parts[0].pointer,),
                block_bytes=sum(part.block_bytes for part in layer.parts),
                suffixes=tuple(layer_suffix(layer.index, part.planned.part) for part in parts))
        last: dict[SlotKey, str] = {}
        for name in self._order:
            last[self._buffers[name].slot] = name
        start = min(part.pointer for b in self._buffers.values() for part in b.parts)
        self.store.register(start, self.layout.physical_bytes)
        self._registered.append(start)
        if self.staging_bytes:
            widest = max(buffer.block_bytes for buffer in self._buffers.values())
            self.staging = SaveStaging(self.staging_bytes, min_bytes=widest)
            self._held_layers = frozenset(last.values())
            self.store.register(self.staging.pointer, self.staging.capacity)
            self._registered.append(self.staging.pointer)
        logger.info("kvo layerwise: %s; device KV %d of %d bytes (ratio %.3f)",
                    self.layout.describe(), self.layout.physical_bytes,
                    self.layout.logical_bytes,
                    self.layout.physical_bytes / self.layout.logical_bytes)

    def slot_key(self, cache_name: str) -> SlotKey:
        """The slot of the layer owning ``cache_name`` (a layer's main KV or indexer cache)."""
        return self._buffers[self._layer_of_cache.get(cache_name, cache_name)].slot

    # -- one step -----------------------------------------------------------------------

    def start_step(self, meta: LayerwiseMetadata) -> None:
        """Begin a step: ready the first layer and prefetch the following ones."""
        if not self._buffers:
            raise PipelineError("register_kv_caches must run before the first step")
        self._step += 1
        self.gates.new_epoch()  # parts announced for an earlier step never join this one's
        self._meta = meta
        self._step_active = meta.has_work
        self._ready = set()
        self._pending_loads = {}
        self._save_futures = []
        self._step_failed = set()
        self._step_poisoned = False
        if not meta.has_work:
            return
        self.wait_staged_puts()
        with self._stats_lock:
            self.stats.steps += 1
        self._loads = {True: meta.loads(shared_layer=True), False: meta.loads(shared_layer=False)}
        self._any_loads = bool(self._loads[True] or self._loads[False])
        # In block order: vLLM frees a request's blocks last first, so a later prompt often
        # gets them in descending order; sorted, they are a few runs to copy and address
        # (a copy and a range per run) instead of one per block (the order of a batched put
        # does not matter to the store).
        self._saves = sorted(meta.saves(), key=_block_id) if self.saves_blocks else []
        self._save_prefixes = self.keys.block_prefixes([ref.name for ref in self._saves])
        self._save_runs = block_runs([ref.block_id for ref in self._saves])
        for request in meta.requests if self.saves_blocks else ():
            names = {name for ref in request.save
                     if (name := ref.name).startswith(REQUEST_BLOCK_MARK)}
            if names:
                self._request_blocks.setdefault(request.request_id, set()).update(names)
        if self._any_loads:
            self._prefetch_from(0)
        self._make_ready(0)

    def before_attention(self, layer_name: str) -> None:
        """``wait_for_layer_load``: the layer must already be ready (see module docstring)."""
        if layer_name in self._ready or not self._step_active or layer_name not in self._position:
            return
        raise PipelineError(
            f"layer {layer_name!r} reached attention before its buffer was made ready; "
            f"start_load_kv must run before the forward (vLLM hook order changed?)")

    def after_attention(self, layer_name: str) -> None:
        """``save_kv_layer``: save this layer, then ready the next one."""
        if not self._step_active or layer_name not in self._position:
            return
        buffer = self._buffers[layer_name]
        saves = self._trusted_saves(buffer) if self._step_failed else self._saves
        if layer_name in self._held_layers:
            self._hold_layer(buffer, saves)
        elif (offset := self._staging_offset(buffer, saves)) is not None:
            self._stage_layer(buffer, saves, offset)
        else:
            part = self._close_round(buffer)
            self._save_futures.append(self._saver.submit(self._put_layer, buffer, part, saves))
        position = self._position[layer_name] + 1
        if position < len(self._order):
            if self._any_loads:
                self._prefetch_from(position)
            self._make_ready(position)

    def finish_step(self) -> None:
        """``wait_for_save``: every save of the step is done (the next step loads them)."""
        started = time.perf_counter()
        for future in self._save_futures:
            future.result()
        if self._save_futures:
            with self._stats_lock:
                self.stats.step_end_wait_seconds += time.perf_counter() - started
        self._save_futures = []
        if self._deferred:
            self._batch_deferred()
        self._meta = None
        self._step_active = False
        self._fold_step_counts()
        if self._staged.keys:
            batch, self._staged = self._staged, StagedBatch()
            self._flush = self._flusher.submit(self._put_staged, batch)
            self._flush_started = time.monotonic()
            self._flush_overdue_logged = False
            PENDING_PUTS.add(self.store, self._flush)
        if self._step_poisoned:
            self._step_poisoned = False
            self._remove_poisoned_now()

    def staged_put_pending(self) -> bool:
        """Whether the last step's batched put is still running (``put_progress``). A put
        running past ``2 x layer_deadline_s`` counts as not pending (logged once): an idle
        engine must not spin on a hung store; the next step with work raises on it."""
        flush = self._flush
        if flush is None or flush.done():
            return False
        if time.monotonic() - self._flush_started <= 2 * self.layer_deadline_s:
            return True
        if not self._flush_overdue_logged:
            self._flush_overdue_logged = True
            logger.warning("kvo layerwise: a staged put has run for more than %g s (store "
                           "hung?); /metrics will count its bytes late",
                           2 * self.layer_deadline_s)
        return False

    def wait_staged_puts(self) -> None:
        """Wait until the last step's staged blocks are in the store (or their keys are
        poisoned and removed); then the staging area is free again."""
        flush, self._flush = self._flush, None
        if flush is None:
            return
        started = time.perf_counter()
        try:
            poisoned = flush.result(timeout=2 * self.layer_deadline_s)
        except TimeoutError as error:
            raise PipelineError(f"the staged saves of the last step did not end within "
                                f"{2 * self.layer_deadline_s:g} s (store put hung)") from error
        if poisoned:
            self._remove_poisoned_now()
        if self.staging is not None:
            self.staging.reset()
        with self._stats_lock:
            self.stats.flush_wait_seconds += time.perf_counter() - started

    def _remove_poisoned_now(self) -> None:
        """Wait for the removal of the keys this step poisoned (module docstring)."""
        started = time.perf_counter()
        if not self.poisoned.settle(self.layer_deadline_s):
            logger.warning("kvo layerwise: removing poisoned keys from the store takes longer "
                           "than %g s; until it ends a prefix lookup may still find them",
                           self.layer_deadline_s)
        with self._stats_lock:
            self.stats.step_end_wait_seconds += time.perf_counter() - started

    def requests_with_failed_loads(self) -> set[str]:
        """Requests of this step that lost a load so far: from that layer on their KV is wrong
        (see ``_trusted_saves``), so nothing may hand it on (e.g. to a remote decode)."""
        if not self._step_failed or self._meta is None:
            return set()
        failed = self._step_failed
        return {request.request_id for request in self._meta.requests
                if any(ref.block_id in failed
                       for ref in (*request.load_every_layer, *request.load_shared_layers))}

    def take_load_errors(self) -> set[int]:
        """The step's failed block ids, reported at its end (sync loads: never a step late).

        vLLM 0.32 applies them to every running request whose computed blocks include one
        (``Scheduler._update_requests_with_invalid_blocks`` over ``self.running``), scheduled
        this step or not: a running request that was not scheduled but shares such a block
        through prefix caching is failed (or recomputed) too, though its KV is intact. vLLM
        offers no finer channel (``failed_recving`` is for requests waiting on remote KV).
        """
        errors, self._load_errors = self._load_errors, set()
        return errors

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        """Remove finished requests' private blocks from the store (in the background)."""
        names: set[str] = set()
        for request_id in request_ids:
            names |= self._request_blocks.pop(request_id, set())
        if names:
            refs = [BlockRef(block_id=0, name=name) for name in sorted(names)]
            keys = [key for buffer in self._buffers.values()
                    for key in buffer.keys(self.keys, refs)]
            if self._flush is not None and not self._flush.done():
                # After the staged put of these keys: removing first would leave them stored
                # (and the put's begin_save would cancel a removal not yet started).
                self._flusher.submit(self.poisoned.remove_later, keys)
            else:
                self.poisoned.remove_later(keys)

    def close(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._saver.shutdown(wait=True, cancel_futures=True)
        self._flusher.shutdown(wait=True, cancel_futures=True)
        self.poisoned.close()
        for pointer in self._registered:
            try:
                self.store.unregister(pointer)
            except Exception as error:  # shutting down: report, do not mask the real exit
                logger.warning("kvo layerwise: unregistering KV memory failed: %s", error)
        self._registered = []

    # -- internals ----------------------------------------------------------------------

    def _prefetch_from(self, position: int) -> None:
        last = min(position + self.prefetch_depth, len(self._order) - 1)
        for i in range(position, last + 1):
            name = self._order[i]
            buffer = self._buffers[name]
            # A layer with nothing to load only waits for its slot; _make_ready does that on
            # the forward's thread (a cold prefill: no hand-off to the loader per layer).
            if (self._loads[buffer.layer.shared] and name not in self._pending_loads
                    and name not in self._ready):
                self._pending_loads[name] = self._loader.submit(self._load_layer, buffer)

    def _make_ready(self, position: int) -> None:
        name = self._order[position]
        future = self._pending_loads.pop(name, None) if self._pending_loads else None
        if future is None and self.gates.is_quiet(self._buffers[name].slot):
            # Nothing to load (see _prefetch_from) and the slot is free: the common cold
            # layer, made ready with no wait and no clock read.
            self._ready.add(name)
            return
        started = time.perf_counter()
        if future is None:  # nothing to load: wait for the slot
            self._wait_slot(self._buffers[name])
            failed: list[int] = []
        else:
            try:
                failed = future.result(timeout=2 * self.layer_deadline_s)
            except TimeoutError as error:
                raise PipelineError(
                    f"layer {name!r} was not ready within {2 * self.layer_deadline_s:g} s "
                    f"(slot release or store load hung)") from error
        self._step_counts.ready_wait_seconds += time.perf_counter() - started
        if failed:
            self._load_errors.update(failed)
            self._step_failed.update(failed)
        self._ready.add(name)

    def _trusted_saves(self, buffer: _Buffer) -> list[BlockRef]:
        """The step's saves for a layer, less those of requests a failed load made wrong.

        A request that lost a load in this layer or an earlier one attended over KV that is
        not its own; everything it computed from that layer on is wrong. It is not saved, and
        its keys for this layer are poisoned: an older value under the same name (a partial
        block saved last step) must not be loaded as if it were current. vLLM recomputes or
        fails the request once ``take_load_errors`` reports the blocks; its re-save un-poisons.
        """
        if not self._step_failed or self._meta is None or not self.saves_blocks:
            return self._saves  # read only (``_save_keys`` knows its prefixes)
        failed = self._step_failed
        trusted = LayerwiseMetadata(requests=tuple(
            request for request in self._meta.requests
            if not any(ref.block_id in failed
                       for ref in (*request.load_every_layer, *request.load_shared_layers)))
        ).saves()
        kept = {ref.name for ref in trusted}
        dropped = sorted({ref.name for ref in self._saves} - kept)
        if dropped:
            self._poison(buffer.keys(self.keys, [BlockRef(0, name) for name in dropped]))
        return trusted

    def _runs(self, refs: list[BlockRef]) -> list[tuple[int, int]]:
        """``refs``' block runs: the step's, found once per step, when they are its saves."""
        if refs is self._saves:
            return self._save_runs
        return block_runs([ref.block_id for ref in refs])

    def _save_keys(self, buffer: _Buffer, refs: list[BlockRef]) -> list[str]:
        """The layer's keys of ``refs``: from the step's prefixes when they are its saves."""
        if refs is self._saves:
            return buffer.keys_with(self._save_prefixes)
        return buffer.keys_with(self.keys.block_prefixes([ref.name for ref in refs]))

    def _wait_slot(self, buffer: _Buffer) -> None:
        """Wait until the previous occupant's consumers are done with the slot."""
        try:
            self.gates.wait(buffer.slot, self.layer_deadline_s)
        except SlotFailedError as error:
            # The round is over; the failed consumer's data is poisoned by its own handler.
            logger.warning("kvo layerwise: %s", error)
            self._wait_own_saves(buffer)
        except SlotTimeoutError as error:
            logger.error("kvo layerwise: %s; giving up on it", error)
            for part in self.gates.pending(buffer.slot):
                self.gates.mark_failed(buffer.slot, part, error)

    def _wait_own_saves(self, buffer: _Buffer) -> None:
        """After another part failed the slot's round (a decode's read), let this worker's own
        store save of the slot finish before the slot is overwritten.

        A failed round wakes its waiters at once, but the save may still be reading the
        buffer: overwriting it then would tear the stored value, so the save would have to
        poison its keys, and the next chunk of the same request would find the layer missing
        from the store and fail the request (seen under load: a decode's failed pull turned
        into a prefill error). Bounded by the layer deadline; a save still running then is
        failed (and poisons its own keys) as on a timeout.
        """
        prefix = f"{STORE_PART}:"
        limit = time.monotonic() + self.layer_deadline_s
        while True:
            own = [part for part in self.gates.pending(buffer.slot) if part.startswith(prefix)]
            if not own:
                return
            if time.monotonic() >= limit:
                error = SlotTimeoutError(f"store save of slot {buffer.slot} still running "
                                         f"after {self.layer_deadline_s:g} s")
                for part in own:
                    self.gates.mark_failed(buffer.slot, part, error)
                return
            time.sleep(0.0005)

    def _load_layer(self, buffer: _Buffer) -> list[int]:
        """Load the step's blocks into every part of the layer; the block ids that failed.

        A block is loaded only when all its parts are: one part missing (or poisoned) fails
        the block, and vLLM recomputes it.
        """
        self._wait_slot(buffer)
        refs = self._loads[buffer.layer.shared]
        if not refs:
            return []
        started = time.perf_counter()
        layer = buffer.layer.index
        keys = buffer.keys(self.keys, refs)
        addrs, sizes = buffer.locations(refs)
        # Two requests with one prefix load the same key into two device blocks. Each key is
        # read from the store once (a batched get does not fill two destinations of one key:
        # measured with Mooncake) and copied to its other blocks on the device.
        first_of: dict[str, int] = {}
        copies: list[tuple[int, int]] = []
        poisoned = self.poisoned.poisoned_among(keys)
        for i, key in enumerate(keys):
            if key in poisoned:
                continue
            if key in first_of:
                copies.append((i, first_of[key]))
            else:
                first_of[key] = i
        chosen = list(first_of.values())
        found = [False] * len(keys)
        count = len(refs)
        absent: set[int] = set()  # keys the store answered as not there
        if chosen:
            result = self._get_with_retries(buffer, [keys[i] for i in chosen],
                                            [addrs[i] for i in chosen],
                                            [sizes[i] for i in chosen])
            if result is not None:
                for i, ok in zip(chosen, result, strict=True):
                    found[i] = bool(ok)
                    if not ok:
                        absent.add(i)
        for target, source in copies:
            if found[source]:
                part = buffer.parts[target // count]
                # memmove, not a torch copy: on this loader thread a torch op would start an
                # OpenMP team that spins against the forward's (staging.SaveStaging.gather).
                ctypes.memmove(part.address(refs[target % count].block_id),
                               part.address(refs[source % count].block_id),
                               part.planned.block_bytes)
                found[target] = True
            elif source in absent:
                absent.add(target)
        complete = [all(found[p * count + r] for p in range(len(buffer.parts)))
                    for r in range(count)]
        failed = [ref.block_id for ref, ok in zip(refs, complete, strict=True) if not ok]
        loaded = [ref.block_id for ref, ok in zip(refs, complete, strict=True) if ok]
        if failed:
            lost = [key for key, ok in zip(keys, found, strict=True) if not ok]
            logger.warning("kvo layerwise: layer %s: %d of %d blocks missing from the store "
                           "(%d keys, e.g. %s)", buffer.layer.name, len(failed), len(refs),
                           len(lost), lost[:2])
        if self.load_hook is not None and loaded:
            for part in buffer.parts:
                self.load_hook(part.planned.cache_name, part.tensor, loaded)
        with self._stats_lock:
            self.stats.loaded_blocks += len(loaded)
            by_layer = self.stats.loaded_blocks_by_layer
            by_layer[layer] = by_layer.get(layer, 0) + len(loaded)
            for part in buffer.parts:
                moved = len(loaded) * part.planned.block_bytes
                self.stats.loaded_bytes += moved
                by_part = self.stats.loaded_bytes_by_part
                by_part[part.planned.part] = by_part.get(part.planned.part, 0) + moved
            self.stats.failed_loads += len(failed)
            self.stats.missing_blocks += len({i % count for i in absent})
            self.stats.load_seconds += time.perf_counter() - started
        return failed

    def _get_with_retries(self, buffer: _Buffer, keys: list[str], addrs: list[int],
                          sizes: list[int]) -> list[bool] | None:
        """The store's per-key answer, or None when every try raised (all keys failed).

        A raised get may have written part of the destination; a retry rewrites all of it.
        """
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            try:
                return list(self.store.get_into(keys, addrs, sizes))
            except Exception as error:
                if attempt == LOAD_ATTEMPTS:
                    logger.error("kvo layerwise: loading layer %s failed after %d tries: %s",
                                 buffer.layer.name, attempt, error)
                else:
                    logger.warning("kvo layerwise: loading layer %s failed (try %d of %d), "
                                   "retrying: %s", buffer.layer.name, attempt, LOAD_ATTEMPTS,
                                   error)
        return None

    def _staging_offset(self, buffer: _Buffer, refs: list[BlockRef]) -> int | None:
        """Where the layer's save goes in the staging area; None: put it from the buffer."""
        if self.staging is None:
            return None
        offset = self.staging.reserve(len(refs) * buffer.block_bytes)
        if offset is None:
            with self._stats_lock:
                self.stats.staging_fallbacks += 1
        return offset

    def _stage_layer(self, buffer: _Buffer, refs: list[BlockRef], offset: int) -> None:
        """Copy the layer's blocks to the staging area; the put follows after the forward
        (``_put_staged``).

        The copy is over before this returns, and no load into the slot is submitted before
        then (``_prefetch_from`` runs after the save, and never reaches a slot still in use:
        ``prefetch_depth`` < shared buffers). So when nothing else reads the buffer (no part
        announced, ``SlotGates.is_quiet``) the slot needs no round of its own: closing one
        and ending it right after the copy would cost two lock round trips per layer inside
        the forward. Otherwise the round holds the slot for the
        announced readers too, and a reader's early failure is seen by the next user.

        Runs on the forward's thread: the copy is a memmove of the step's new blocks (a few
        MiB, GIL released), and handing it to another thread cost more than it saved: that
        thread's Python (keys, gates, bookkeeping) took the GIL each time a torch op of the
        forward let it go, and the forward then waited to get it back (docs/benchmarks.md).
        """
        assert self.staging is not None
        started = time.perf_counter()
        part = None if self.gates.is_quiet(buffer.slot) else self._close_round(buffer)
        runs = self._runs(refs)
        count = len(refs)
        at = offset
        try:
            for cache in buffer.parts:
                self.staging.gather(cache.rows, runs, at)
                at += count * cache.planned.block_bytes
            # False: the slot was given up on (deadline) and may have been overwritten
            # mid-copy.
            copied = part is None or self.gates.mark_done(buffer.slot, part)
        except Exception as error:
            self._fail_save(buffer, part, self._save_keys(buffer, refs), count, error)
            return
        if not copied:
            self._poison(self._save_keys(buffer, refs))
            return
        self._deferred.append(_DeferredSave(buffer=buffer, refs=refs, staged_at=offset))
        counts = self._step_counts
        counts.staged_bytes += count * buffer.block_bytes
        counts.stage_seconds += time.perf_counter() - started

    def _close_round(self, buffer: _Buffer) -> str:
        """Start the slot's round for this layer's save; the save's part name.

        Further consumers of the buffer (a composing connector's remote reads) announced
        their parts on the gates in this step; the round takes them with the save."""
        part = self._save_part(buffer)
        self.gates.close(buffer.slot, {part}, take_announced=True)
        return part

    def _save_part(self, buffer: _Buffer) -> str:
        """The gate part of this step's save of the layer (unique per round)."""
        return f"{STORE_PART}:{self._step}:{buffer.layer.index}"

    def _fold_step_counts(self) -> None:
        """Add the step's forward-thread counters to ``stats`` (one lock per step, not one
        per layer)."""
        counts, self._step_counts = self._step_counts, _StepCounts()
        with self._stats_lock:
            self.stats.ready_wait_seconds += counts.ready_wait_seconds
            self.stats.staged_bytes += counts.staged_bytes
            self.stats.stage_seconds += counts.stage_seconds
            self.stats.held_bytes += counts.held_bytes

    def _hold_layer(self, buffer: _Buffer, refs: list[BlockRef]) -> None:
        """Put the layer's blocks as they lie in its buffer, which no later layer of the step
        reuses: no copy, and nothing else now (``_batch_deferred`` adds them to the step's
        batched put and closes the slot's round until that put ends)."""
        if refs:
            self._deferred.append(_DeferredSave(buffer=buffer, refs=refs, staged_at=None))
        elif not self.gates.is_quiet(buffer.slot):
            # Nothing to save, but announced readers (or a failed round to replace).
            self.gates.mark_done(buffer.slot, self._close_round(buffer))

    def _batch_deferred(self) -> None:
        """Add the step's staged and held layers to its batched put, and close the held
        buffers' rounds until the put ends (``_release_held``).

        Done once at the step's end rather than in each layer's hook: inside the forward,
        every Python call runs several times slower than in a loop (its caches are cold after
        the layer's torch ops), and the keys of a layer are not needed before the put. A held
        round closed now instead of at its layer changes nothing a waiter sees: no later
        layer of the step uses that buffer, and the next step waits for the put before it
        writes any buffer (``wait_staged_puts``). Parts announced on it in this step (a
        composing connector's reads) are taken by the round as at its layer.
        """
        deferred, self._deferred = self._deferred, []
        assert self.staging is not None
        held: list[tuple[SlotKey, str]] = []
        for save in deferred:
            buffer, refs, count = save.buffer, save.refs, len(save.refs)
            keys = self._save_keys(buffer, refs)
            if save.staged_at is None:
                runs = self._runs(refs)
                # A range per run pays off for long runs only (a step's sorted saves).
                addrs, sizes = (buffer.run_locations(runs) if 4 * len(runs) <= count
                                else buffer.locations(refs))
                part = self._save_part(buffer)
                held.append((buffer.slot, part))
                self._staged.held.append(HeldSlot(slot=buffer.slot, part=part, keys=keys))
                self._step_counts.held_bytes += count * buffer.block_bytes
            else:
                addrs, sizes = [], []
                at = self.staging.pointer + save.staged_at
                for cache in buffer.parts:
                    width = cache.planned.block_bytes
                    addrs += range(at, at + count * width, width)
                    sizes += [width] * count
                    at += count * width
            self._add_to_batch(buffer, count, keys, addrs, sizes)
        if held:  # one lock round trip for every held buffer
            self.gates.close_each(held, take_announced=True)

    def _add_to_batch(self, buffer: _Buffer, blocks: int, keys: list[str], addrs: list[int],
                      sizes: list[int]) -> None:
        """Append ``blocks`` blocks of the layer (every part) to the step's batched put."""
        staged = self._staged
        staged.keys += keys
        staged.addrs += addrs
        staged.sizes += sizes
        staged.blocks += blocks
        for cache in buffer.parts:
            staged.bytes_by_part[cache.planned.part] = (
                staged.bytes_by_part.get(cache.planned.part, 0)
                + blocks * cache.planned.block_bytes)

    def _release_held(self, batch: StagedBatch) -> list[str]:
        """End the rounds of the buffers the put read directly; the keys of those given up on
        meanwhile (a deadline passed: the buffer may have been overwritten during the put)."""
        torn: list[str] = []
        for held in batch.held:
            if not self.gates.mark_done(held.slot, held.part):
                torn += held.keys
        return torn

    def _put_staged(self, batch: StagedBatch) -> bool:
        """One batched put of a step's staged blocks; True when it failed or some of its keys
        were poisoned."""
        try:
            stored = self._put_batch(batch)
        finally:
            torn = self._release_held(batch)
        if torn and stored:
            logger.error("kvo layerwise: %d keys were put from a buffer given up on during the "
                         "put (deadline); removing them", len(torn))
            self._poison_keys(torn)
        return bool(torn) or not stored

    def _put_batch(self, batch: StagedBatch) -> bool:
        """The batched put itself; whether it stored (else its keys are poisoned)."""
        started = time.perf_counter()
        try:
            ticket = self.poisoned.begin_save(batch.keys, self.layer_deadline_s)
        except RemovalStillRunningError as error:
            self._fail_staged(batch, error)
            return False
        stored = False
        try:
            self.store.put_from(batch.keys, batch.addrs, batch.sizes)
            stored = True
        except Exception as error:
            self._fail_staged(batch, error)
        finally:
            self.poisoned.end_save(ticket, stored=stored)
        if stored:
            with self._stats_lock:
                self.stats.staged_puts += 1
                self.stats.saved_blocks += batch.blocks
                self.stats.saved_bytes += sum(batch.sizes)
                for name, moved in batch.bytes_by_part.items():
                    by_part = self.stats.saved_bytes_by_part
                    by_part[name] = by_part.get(name, 0) + moved
                self.stats.flush_seconds += time.perf_counter() - started
        return stored

    def _fail_staged(self, batch: StagedBatch, error: Exception) -> None:
        logger.error("kvo layerwise: saving %d staged blocks failed: %s", batch.blocks, error)
        self._poison_keys(batch.keys)
        with self._stats_lock:
            self.stats.staged_puts += 1
            self.stats.failed_saves += batch.blocks

    def _put_layer(self, buffer: _Buffer, part: str, refs: list[BlockRef]) -> None:
        started = time.perf_counter()
        keys = self._save_keys(buffer, refs)
        addrs, sizes = buffer.locations(refs)
        try:
            ticket = self.poisoned.begin_save(keys, self.layer_deadline_s)
        except RemovalStillRunningError as error:
            self._fail_save(buffer, part, keys, len(refs), error)
            return
        stored = False
        try:
            if keys:
                self.store.put_from(keys, addrs, sizes)
            # False: the slot was given up on (deadline) and may have been overwritten
            # mid-save.
            stored = self.gates.mark_done(buffer.slot, part)
        except Exception as error:
            self._fail_save(buffer, part, keys, len(refs), error)
            return
        finally:
            self.poisoned.end_save(ticket, stored=stored)
        if not stored:
            self._poison(keys)
            return
        with self._stats_lock:
            self.stats.saved_blocks += len(refs)
            self.stats.saved_bytes += sum(sizes)
            for cache in buffer.parts:
                by_part = self.stats.saved_bytes_by_part
                by_part[cache.planned.part] = (by_part.get(cache.planned.part, 0)
                                               + len(refs) * cache.planned.block_bytes)
            self.stats.save_seconds += time.perf_counter() - started

    def _fail_save(self, buffer: _Buffer, part: str | None, keys: list[str], blocks: int,
                   error: Exception) -> None:
        """A save failed: its keys are poisoned, and its round (``part``; None: the save
        had none) fails."""
        logger.error("kvo layerwise: saving layer %s failed: %s", buffer.layer.name, error)
        self._poison(keys)
        with self._stats_lock:
            self.stats.failed_saves += blocks
        if part is not None:
            self.gates.mark_failed(buffer.slot, part, error)

    def _poison(self, keys: list[str]) -> None:
        self._step_poisoned = True
        self._poison_keys(keys)

    def _poison_keys(self, keys: list[str]) -> None:
        """Poison without ending the step on their removal (a staged put after the step:
        the next step waits for the removal in ``wait_staged_puts``)."""
        self.poisoned.poison(keys)
        with self._stats_lock:
            self.stats.poisoned_keys += len(keys)
