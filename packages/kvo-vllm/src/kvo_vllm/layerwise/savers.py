"""Saving a layer's new blocks to the store after its attention, one of two ways chosen when
the caches are registered (``make_saver``); both offer ``DirectSaver``'s methods.

- ``DirectSaver``: a saver thread puts the layer from its buffer, whose slot stays closed until
  the put ends; the step's end waits for every put.
- ``StagedSaver`` (``save_staging_bytes`` > 0): the forward's thread copies the layer into
  registered host memory (``staging``) and the slot is free at once; the last layer of each
  buffer is not copied: it is put in place, its slot closed at the step's end until the put
  ends (nothing in the step overwrites it). The step's staged and held blocks go to the store
  in one batched put on a flush thread after the step; the next step waits for it before
  anything writes a buffer (``handle_preemptions``, then ``start_step``). Their keys and
  addresses are built at the step's end, in one loop, not in each layer's hook. A layer that
  does not fit the staging area is saved directly.

Every put is ordered against removals of its keys (``PoisonedKeys.begin_save``); a failed or
torn save poisons its keys (``failures``).

No put ever publishes bytes its source may have lost while they were read. A slot is given
up on when a deadline passes (the next layer then writes it), so a put reading a buffer can
read another layer's KV. Poisoning such keys and removing them does not keep them from other
engines sharing the store: the value is readable from the put's end until the removal, and
Mooncake's removal gives up while another engine holds a read lease (10 s by default, longer
than ``remove_timeout_s``), or never runs if this engine dies first; a tombstone or version
that loaders check would cost every load a store round trip and leave the same window before
it is written. So the check comes before the value exists, not after: every put is made from
a copy of its ranges (the store's bounce memory, ``KVStore.put_from``'s ``settle``), and once
the copy is taken the slot's round ends; a round given up on meanwhile leaves its keys out of
the put. A staged layer's copy in the
staging area is checked the same way (``StagedSaver._stage_layer``). Mooncake publishes a key
only when its whole value has arrived (PutEnd; an in-place upsert hides the key until then,
a revoked or abandoned one never shows it), so what another engine can read under a key is
a value kvo confirmed whole. A poisoned key left in the store therefore holds bytes of a
confirmed save (for a request-private key possibly an earlier state of its partial block,
which no other engine names): poisoning keeps this engine from trusting the key, and the
removal only keeps prefix lookups from finding it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import attrs

from kvo_vllm.layerwise.buffers import BlockSet, LayerBuffer, LayerBuffers
from kvo_vllm.layerwise.errors import PipelineError
from kvo_vllm.layerwise.pipeline_parts import PipelineParts
from kvo_vllm.layerwise.poisoned_keys import RemovalStillRunningError
from kvo_vllm.layerwise.slot_rounds import SaveRound
from kvo_vllm.layerwise.staging import SaveStaging
from kvo_vllm.layerwise.worker_stats import bytes_by_part

logger = logging.getLogger(__name__)


def _guarded_put(parts: PipelineParts, keys: list[str], addrs: list[int], sizes: list[int],
                 *, settle: Callable[[], list[str]], on_torn: Callable[[list[str]], None],
                 on_error: Callable[[Exception], None]) -> list[str] | None:
    """Put ``keys`` ordered against their removals, each from a copy of its range: once the
    copy is taken, ``settle`` names the keys whose range may have changed while it was read
    (module docstring); those are left out of the put and handed to ``on_torn`` before the
    save counts as stored. The keys left out, or None when the put failed (``on_error`` ran,
    before the removals waiting on the put resume)."""
    try:
        ticket = parts.poisoned.begin_save(keys, parts.deadline_s)
    except RemovalStillRunningError as error:
        on_error(error)
        return None
    torn: list[str] = []
    settled = False

    def settle_once() -> list[str]:
        nonlocal settled
        settled = True
        torn.extend(settle())
        return torn

    stored = False
    try:
        if keys:
            parts.store.put_from(keys, addrs, sizes, settle=settle_once)
            if not settled:
                raise PipelineError(f"{type(parts.store).__name__}.put_from stored without "
                                    f"calling settle: its values may hold torn bytes")
        else:
            settle_once()
        if torn:
            on_torn(torn)  # poisoned anew: ``end_save`` leaves them poisoned
        stored = True
    except Exception as error:
        on_error(error)
        return None
    finally:
        parts.poisoned.end_save(ticket, stored=stored)
    return torn


class DirectSaver:
    """Each layer put from its buffer by a saver thread, the slot closed until it ends."""

    staging: SaveStaging | None = None
    """The staging area (``StagedSaver``), or None."""

    def __init__(self, parts: PipelineParts) -> None:
        self._parts = parts
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvo-lw-save")
        self._futures: list[Future[None]] = []

    def save_layer(self, buffer: LayerBuffer, blocks: BlockSet) -> None:
        """After the layer's attention: save ``blocks`` of it."""
        save = self._parts.rounds.open(buffer)
        self._futures.append(self._executor.submit(self._put_layer, buffer, save, blocks))

    def finish_step(self) -> None:
        """The forward is over: wait for the step's puts (the next step loads them)."""
        started = time.perf_counter()
        for future in self._futures:
            future.result()
        if self._futures:
            self._parts.recorder.add(step_end_wait_seconds=time.perf_counter() - started)
        self._futures = []

    def wait_for_puts(self) -> None:
        """Before anything writes a buffer again: the last step's batched put is over."""

    def put_pending(self) -> bool:
        """Whether the last step's batched put still runs (``put_progress``)."""
        return False

    def after_puts(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the puts now running are over (now when none is)."""
        action()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _put_layer(self, buffer: LayerBuffer, save: SaveRound, blocks: BlockSet) -> None:
        parts = self._parts
        started = time.perf_counter()
        keys = blocks.keys_in(buffer)
        addrs, sizes = buffer.locations(blocks.refs)
        ended = False

        def settle() -> list[str]:
            """The put has its copy: the slot is free. All keys are left out when the slot
            was given up on meanwhile (a deadline: the copy may hold another layer's KV)."""
            nonlocal ended
            ended = True
            return [] if parts.rounds.done(save) else keys

        def failed(error: Exception) -> None:
            parts.failures.save_failed(buffer.layer.name, keys, len(blocks), error)
            if not ended:
                parts.rounds.failed(save, error)

        def torn(left_out: list[str]) -> None:
            logger.error("kvo layerwise: layer %s: its slot was given up on while the save "
                         "read it (deadline); %d keys not stored, poisoned", buffer.layer.name,
                         len(left_out))
            parts.failures.poison(left_out)

        left_out = _guarded_put(parts, keys, addrs, sizes, settle=settle, on_torn=torn,
                                on_error=failed)
        if left_out == []:
            parts.recorder.saved(len(blocks), bytes_by_part(buffer, len(blocks)),
                                 save_seconds=time.perf_counter() - started)


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


@attrs.frozen
class HeldSlot:
    """A buffer the batched put reads directly: its slot's round ends with the put."""

    round: SaveRound
    keys: list[str]
    """The keys put from it (poisoned if the slot was given up on during the put)."""


@attrs.define
class StagedBatch:
    """What a step staged: one batched put after the forward."""

    keys: list[str] = attrs.field(factory=list)
    addrs: list[int] = attrs.field(factory=list)
    sizes: list[int] = attrs.field(factory=list)
    blocks: int = 0
    bytes_by_part: dict[str, int] = attrs.field(factory=dict)
    held: list[HeldSlot] = attrs.field(factory=list)
    """Buffers put from directly (no copy), released when the put ends."""

    def add(self, keys: list[str], addrs: list[int], sizes: list[int], blocks: int,
            moved: dict[str, int]) -> None:
        """Append ``blocks`` blocks of a layer (every part; ``moved``: bytes by part)."""
        self.keys += keys
        self.addrs += addrs
        self.sizes += sizes
        self.blocks += blocks
        for name, amount in moved.items():
            self.bytes_by_part[name] = self.bytes_by_part.get(name, 0) + amount


@attrs.frozen
class _DeferredSave:
    """A layer's save whose keys and batch entries are built at the step's end
    (``finish_step``), off the per-layer path."""

    buffer: LayerBuffer
    blocks: BlockSet
    staged_at: int | None
    """Offset of the layer's copy in the staging area; None: put in place from the buffer."""


@attrs.define
class _Flush:
    """A step's batched put on the flush thread."""

    future: Future[bool]
    started: float
    """``time.monotonic()`` when it was submitted."""
    overdue_logged: bool = False


class StagedSaver(DirectSaver):
    """Layers copied to a staging area (or held in place) and put in one batch after the
    step; saved directly when they do not fit (module docstring)."""

    def __init__(self, parts: PipelineParts, buffers: LayerBuffers, *, staging_bytes: int,
                 flush_nice: int) -> None:
        super().__init__(parts)
        self.staging: SaveStaging = SaveStaging(staging_bytes,
                                                min_bytes=buffers.widest_block_bytes)
        self._held_layers = buffers.last_of_each_slot()
        """The last layer of each buffer, which the step's batched put reads in place."""
        self._deferred: list[_DeferredSave] = []
        # The batched put of staged blocks, and what must follow it, in a thread of its own
        # at a lower priority (``LayerwiseOffloadConfig.flush_nice``).
        self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvo-lw-flush",
                                           initializer=lower_thread_priority,
                                           initargs=(flush_nice,))
        self._flush: _Flush | None = None

    def save_layer(self, buffer: LayerBuffer, blocks: BlockSet) -> None:
        if buffer.layer.name in self._held_layers:
            self._hold_layer(buffer, blocks)
        elif (offset := self.staging.reserve(len(blocks) * buffer.block_bytes)) is not None:
            self._stage_layer(buffer, blocks, offset)
        else:
            self._parts.recorder.add(staging_fallbacks=1)
            super().save_layer(buffer, blocks)

    def finish_step(self) -> None:
        """The forward is over: the step's staged and held blocks go to the flush thread."""
        super().finish_step()
        if not self._deferred:
            return
        batch = self._batch_deferred()
        if batch.keys:
            future = self._flusher.submit(self._put_staged, batch)
            self._flush = _Flush(future=future, started=time.monotonic())
            self._parts.pending_puts.add(future)

    def put_pending(self) -> bool:
        """A put running past ``2 x layer_deadline_s`` counts as not pending (logged once):
        an idle engine must not spin on a hung store; the next step with work raises on it."""
        flush = self._flush
        if flush is None or flush.future.done():
            return False
        limit = 2 * self._parts.deadline_s
        if time.monotonic() - flush.started <= limit:
            return True
        if not flush.overdue_logged:
            flush.overdue_logged = True
            logger.warning("kvo layerwise: a staged put has run for more than %g s (store "
                           "hung?); /metrics will count its bytes late", limit)
        return False

    def wait_for_puts(self) -> None:
        """The last step's staged blocks are in the store (or their keys are poisoned and
        removed); then the staging area is free again."""
        flush, self._flush = self._flush, None
        if flush is None:
            return
        started = time.perf_counter()
        limit = 2 * self._parts.deadline_s
        try:
            poisoned = flush.future.result(timeout=limit)
        except TimeoutError as error:
            raise PipelineError(f"the staged saves of the last step did not end within "
                                f"{limit:g} s (store put hung)") from error
        if poisoned:
            self._parts.failures.remove_poisoned_now()
        self.staging.reset()
        self._parts.recorder.add(flush_wait_seconds=time.perf_counter() - started)

    def after_puts(self, action: Callable[[], None]) -> None:
        if self._flush is not None and not self._flush.future.done():
            self._flusher.submit(action)
        else:
            action()

    def close(self) -> None:
        super().close()
        self._flusher.shutdown(wait=True, cancel_futures=True)

    # -- on the forward's thread ----------------------------------------------------------

    def _stage_layer(self, buffer: LayerBuffer, blocks: BlockSet, offset: int) -> None:
        """Copy the layer's blocks to the staging area; the put follows after the forward.

        The copy is over before this returns, and no load into the slot is submitted before
        then (the loader prefetches after the save, and never reaches a slot still in use:
        ``prefetch_depth`` < shared buffers). So when nothing else reads the buffer (no part
        announced, ``SlotGates.is_quiet``) the slot needs no round of its own: opening one
        and ending it right after the copy would cost two lock round trips per layer inside
        the forward. Otherwise the round holds the slot for the announced readers too, and a
        reader's early failure is seen by the next user.

        Runs on the forward's thread: the copy is a memmove of the step's new blocks (a few
        MiB, GIL released), and handing it to another thread cost more than it saved: that
        thread's Python (keys, gates, bookkeeping) took the GIL each time a torch op of the
        forward let it go, and the forward then waited to get it back (docs/benchmarks.md).
        """
        parts = self._parts
        started = time.perf_counter()
        save = None if parts.rounds.is_quiet(buffer.slot) else parts.rounds.open(buffer)
        count = len(blocks)
        at = offset
        try:
            for cache in buffer.parts:
                self.staging.gather(cache.rows, blocks.runs, at)
                at += count * cache.planned.block_bytes
            # False: the slot was given up on (deadline) and may have been overwritten
            # mid-copy.
            copied = save is None or parts.rounds.done(save)
        except Exception as error:
            parts.failures.save_failed(buffer.layer.name, blocks.keys_in(buffer), count, error)
            if save is not None:
                parts.rounds.failed(save, error)
            return
        if not copied:
            parts.failures.poison(blocks.keys_in(buffer))
            return
        self._deferred.append(_DeferredSave(buffer=buffer, blocks=blocks, staged_at=offset))
        counts = parts.recorder.step
        counts.staged_bytes += count * buffer.block_bytes
        counts.stage_seconds += time.perf_counter() - started

    def _hold_layer(self, buffer: LayerBuffer, blocks: BlockSet) -> None:
        """Put the layer's blocks as they lie in its buffer, which no later layer of the step
        reuses: no copy, and nothing else now (``_batch_deferred`` adds them to the step's
        batched put and opens the slot's round until that put ends)."""
        rounds = self._parts.rounds
        if blocks.refs:
            self._deferred.append(_DeferredSave(buffer=buffer, blocks=blocks, staged_at=None))
        elif not rounds.is_quiet(buffer.slot):
            # Nothing to save, but announced readers (or a failed round to replace).
            rounds.done(rounds.open(buffer))

    # -- at the step's end ----------------------------------------------------------------

    def _batch_deferred(self) -> StagedBatch:
        """The step's batched put of its staged and held layers; the held buffers' rounds
        open until the put ends (``_release_held``).

        Done once at the step's end rather than in each layer's hook: inside the forward,
        every Python call runs several times slower than in a loop (its caches are cold after
        the layer's torch ops), and the keys of a layer are not needed before the put. A held
        round opened now instead of at its layer changes nothing a waiter sees: no later
        layer of the step uses that buffer, and the next step waits for the put before it
        writes any buffer (``wait_for_puts``). Parts announced on it in this step (a
        composing connector's reads) are taken by the round as at its layer.
        """
        deferred, self._deferred = self._deferred, []
        batch = StagedBatch()
        held: list[tuple[LayerBuffer, list[str]]] = []
        for save in deferred:
            buffer, blocks, count = save.buffer, save.blocks, len(save.blocks)
            keys = blocks.keys_in(buffer)
            if save.staged_at is None:
                # A range per run pays off for long runs only (a step's sorted saves).
                addrs, sizes = (buffer.run_locations(blocks.runs) if 4 * len(blocks.runs) <= count
                                else buffer.locations(blocks.refs))
                held.append((buffer, keys))
                self._parts.recorder.step.held_bytes += count * buffer.block_bytes
            else:
                addrs, sizes = [], []
                at = self.staging.pointer + save.staged_at
                for cache in buffer.parts:
                    width = cache.planned.block_bytes
                    addrs += range(at, at + count * width, width)
                    sizes += [width] * count
                    at += count * width
            batch.add(keys, addrs, sizes, count, bytes_by_part(buffer, count))
        # one lock round trip for every held buffer
        rounds = self._parts.rounds.open_each([buffer for buffer, _ in held])
        batch.held = [HeldSlot(round=save, keys=keys)
                      for save, (_, keys) in zip(rounds, held, strict=True)]
        return batch

    # -- on the flush thread --------------------------------------------------------------

    def _put_staged(self, batch: StagedBatch) -> bool:
        """One batched put of a step's staged blocks; True when it failed or some of its keys
        were poisoned."""
        released = False

        def settle() -> list[str]:
            """The put has its copy: the held slots are free; the keys of those given up
            on meanwhile are left out."""
            nonlocal released
            released = True
            return self._release_held(batch)

        try:
            left_out = self._put_batch(batch, settle)
        finally:
            if not released:  # the put failed before it read anything: its keys are poisoned
                self._release_held(batch)
        return left_out != []

    def _put_batch(self, batch: StagedBatch, settle: Callable[[], list[str]]
                   ) -> list[str] | None:
        """The batched put itself: the keys it left out (poisoned), or None when it failed
        (its keys are poisoned)."""
        parts = self._parts
        started = time.perf_counter()

        def torn(left_out: list[str]) -> None:
            logger.error("kvo layerwise: %d keys were to be put from a buffer given up on "
                         "before the put copied it (deadline); not stored, poisoned",
                         len(left_out))
            parts.failures.poison_after_step(left_out)

        left_out = _guarded_put(parts, batch.keys, batch.addrs, batch.sizes, settle=settle,
                                on_torn=torn,
                                on_error=lambda error: parts.failures.staged_put_failed(
                                    batch.keys, batch.blocks, error))
        if left_out is not None:
            parts.recorder.saved(batch.blocks, batch.bytes_by_part, staged_puts=1,
                                 flush_seconds=time.perf_counter() - started)
        return left_out

    def _release_held(self, batch: StagedBatch) -> list[str]:
        """End the rounds of the buffers the put read directly; the keys of those given up on
        meanwhile (a deadline passed: the buffer may have been overwritten while read)."""
        torn: list[str] = []
        for held in batch.held:
            if not self._parts.rounds.done(held.round):
                torn += held.keys
        return torn


def make_saver(parts: PipelineParts, buffers: LayerBuffers, *, staging_bytes: int,
               flush_nice: int) -> DirectSaver:
    """The saver for these settings: staged when there is a staging area."""
    if staging_bytes:
        return StagedSaver(parts, buffers, staging_bytes=staging_bytes, flush_nice=flush_nice)
    return DirectSaver(parts)
