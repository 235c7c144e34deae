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
- ``finish_step`` (``wait_for_save``) waits for every save: the next step reloads from them
  (with a staging area, hands them to one batched put that the next step waits for: ``savers``).

A speculative drafter's (MTP) layers are the last layers of the plan. vLLM 0.32 runs the
drafter after the model's forward and, with ``speculative_config``, defers ``wait_for_save``
until the drafter is done, so a draft layer is readied by the model's last layer and saved in
the drafter's forward like any other. The drafter runs its layer once per draft token: the
first pass writes the step's rows and is saved; the later passes write only rows past the
step's tokens (which the next step rewrites before attending to them), so they save nothing.

A failed load or save: ``failures``.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from kvo_core.gates import SlotGates, SlotKey
from kvo_vllm.layerwise.buffers import EMPTY_BLOCKS, BlockSet, LayerBuffers
from kvo_vllm.layerwise.errors import PipelineError
from kvo_vllm.layerwise.failures import FailurePolicy
from kvo_vllm.layerwise.keys import REQUEST_BLOCK_MARK, StoreKeys
from kvo_vllm.layerwise.layout import LayerLayout
from kvo_vllm.layerwise.loader import LayerLoader
from kvo_vllm.layerwise.metadata import BlockRef, LayerwiseMetadata
from kvo_vllm.layerwise.pipeline_parts import PipelineParts
from kvo_vllm.layerwise.poisoned_keys import PoisonedKeys
from kvo_vllm.layerwise.savers import DirectSaver, make_saver
from kvo_vllm.layerwise.slot_rounds import SlotRounds
from kvo_vllm.layerwise.staging import PendingPuts
from kvo_vllm.layerwise.worker_stats import LayerwiseStats, StatsRecorder

logger = logging.getLogger(__name__)

_block_id = operator.attrgetter("block_id")


@attrs.frozen
class Registered:
    """What exists once the caches are registered."""

    buffers: LayerBuffers
    loader: LayerLoader
    saver: DirectSaver
    memory: tuple[int, ...]
    """Start addresses registered with the store."""


class LayerwiseWorker:
    """Drives loads and saves around each attention layer of one worker: owns the step's
    lifecycle; the loader readies layers, the saver saves them, the failure policy decides
    what a failed load or save drops (module docstring)."""

    def __init__(self, *, layout: LayerLayout, keys: StoreKeys, store: Any,
                 prefetch_depth: int, layer_deadline_s: float, staging_bytes: int = 0,
                 flush_nice: int = 0, saves_blocks: bool = True,
                 pending_puts: PendingPuts | None = None) -> None:
        """``pending_puts``: where this worker's batched puts are counted while they run (the
        store client's, ``store_client.SharedStore``; a fresh one when the store is this
        worker's alone)."""
        self.layout = layout
        self.store = store
        self.saves_blocks = saves_blocks
        """False on a TP rank other than 0 when the KV is replicated across TP ranks (MLA):
        rank 0 saves every block once under keys all ranks share; this rank only loads them
        (and removes nothing: the request-private keys are rank 0's too)."""
        self._prefetch_depth = prefetch_depth
        self._staging_bytes = staging_bytes
        self._flush_nice = flush_nice
        self.gates = SlotGates()
        recorder = StatsRecorder()
        # Removals run in the background (they may wait out a store read lease) but never
        # land after a later save of the same key (poisoned_keys.py).
        self.poisoned = PoisonedKeys(lambda keys: self.store.remove(keys), count=recorder.add)
        self.parts = PipelineParts(
            store=store, keys=keys, rounds=SlotRounds(self.gates, layer_deadline_s),
            poisoned=self.poisoned, recorder=recorder, deadline_s=layer_deadline_s,
            pending_puts=PendingPuts() if pending_puts is None else pending_puts,
            failures=FailurePolicy(poisoned=self.poisoned, recorder=recorder, keys=keys,
                                   deadline_s=layer_deadline_s))
        self._registered: Registered | None = None
        self._request_blocks: dict[str, set[str]] = {}
        self._step_active = False
        """A step with work is between ``start_step`` and ``finish_step``."""
        self._saves = EMPTY_BLOCKS
        """The blocks every layer of the running step saves."""
        self._saved_positions: set[int] = set()
        """Layers (plan positions) saved in the running step: each is saved once."""

    # -- set-up -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        buffers = LayerBuffers(self.layout, kv_caches)
        self.store.register(buffers.start, self.layout.physical_bytes)
        memory = [buffers.start]
        saver = make_saver(self.parts, buffers, staging_bytes=self._staging_bytes,
                           flush_nice=self._flush_nice)
        if saver.staging is not None:
            self.store.register(saver.staging.pointer, saver.staging.capacity)
            memory.append(saver.staging.pointer)
        self._registered = Registered(
            buffers=buffers, loader=LayerLoader(self.parts, buffers, self._prefetch_depth),
            saver=saver, memory=tuple(memory))
        logger.info("kvo layerwise: %s; device KV %d of %d bytes (ratio %.3f)",
                    self.layout.describe(), self.layout.physical_bytes,
                    self.layout.logical_bytes,
                    self.layout.physical_bytes / self.layout.logical_bytes)

    @property
    def registered(self) -> Registered:
        if self._registered is None:
            raise PipelineError("register_kv_caches must run before the first step")
        return self._registered

    def slot_key(self, cache_name: str) -> SlotKey:
        """The slot of the layer owning ``cache_name`` (a layer's main KV or indexer cache)."""
        return self.registered.buffers.slot_key(cache_name)

    @property
    def stats(self) -> LayerwiseStats:
        return self.parts.recorder.stats

    # -- one step -----------------------------------------------------------------------

    def start_step(self, meta: LayerwiseMetadata) -> None:
        """Begin a step: ready the first layer and prefetch the following ones."""
        registered = self.registered
        self.parts.rounds.new_step()  # announcements of earlier steps never join this one
        self._step_active = meta.has_work
        self._saved_positions = set()
        self.parts.failures.start_step(meta)
        if not meta.has_work:
            return
        registered.saver.wait_for_puts()
        self.parts.recorder.add(steps=1)
        registered.loader.start_step(meta.loads(shared_layer=True), meta.loads(shared_layer=False))
        # In block order: vLLM frees a request's blocks last first, so a later prompt often
        # gets them in descending order; sorted, they are a few runs to copy and address
        # (a copy and a range per run) instead of one per block (the order of a batched put
        # does not matter to the store).
        saves = sorted(meta.saves(), key=_block_id) if self.saves_blocks else []
        self._saves = BlockSet.of(saves, self.parts.keys)
        for request in meta.requests if self.saves_blocks else ():
            names = {name for ref in request.save
                     if (name := ref.name).startswith(REQUEST_BLOCK_MARK)}
            if names:
                self._request_blocks.setdefault(request.request_id, set()).update(names)
        self._ready_layer(registered.loader, 0)

    def before_attention(self, layer_name: str) -> None:
        """``wait_for_layer_load``: the layer must already be ready (see module docstring)."""
        if not self._step_active or layer_name in self.registered.loader.ready or (
                layer_name not in self.registered.buffers.position):
            return
        raise PipelineError(
            f"layer {layer_name!r} reached attention before its buffer was made ready; "
            f"start_load_kv must run before the forward (vLLM hook order changed?)")

    def after_attention(self, layer_name: str) -> None:
        """``save_kv_layer``: save this layer, then ready the next one."""
        if not self._step_active:
            return
        registered = self.registered
        position = registered.buffers.position.get(layer_name)
        if position is None or position in self._saved_positions:
            return   # not a planned layer, or a drafter's later pass (module docstring)
        self._saved_positions.add(position)
        buffer = registered.buffers.in_order[position]
        saves = (self.parts.failures.trusted_saves(buffer, self._saves)
                 if self.parts.failures.any_load_failed else self._saves)
        registered.saver.save_layer(buffer, saves)
        if position + 1 < len(registered.buffers.in_order):
            self._ready_layer(registered.loader, position + 1)

    def _ready_layer(self, loader: LayerLoader, position: int) -> None:
        loader.prefetch_from(position)
        failed = loader.make_ready(position)
        if failed:
            self.parts.failures.loads_failed(failed)

    def finish_step(self) -> None:
        """``wait_for_save``: every save of the step is done (the next step loads them), or
        with staging handed to the batched put."""
        if self._registered is not None:
            self._registered.saver.finish_step()
        self._step_active = False
        self.parts.recorder.fold_step()
        self.parts.failures.end_step()

    def staged_put_pending(self) -> bool:
        """Whether the last step's batched put is still running (``put_progress``)."""
        return self._registered is not None and self._registered.saver.put_pending()

    def wait_staged_puts(self) -> None:
        """Wait until the last step's staged blocks are in the store (or their keys are
        poisoned and removed); then the staging area is free again."""
        if self._registered is not None:
            self._registered.saver.wait_for_puts()

    def requests_with_failed_loads(self) -> set[str]:
        """Requests of this step that lost a load so far (``FailurePolicy``)."""
        return self.parts.failures.requests_with_failed_loads()

    def take_load_errors(self) -> set[int]:
        """The step's failed block ids (``FailurePolicy.take_load_errors``)."""
        return self.parts.failures.take_load_errors()

    def forget_requests(self, request_ids: Iterable[str]) -> None:
        """Remove finished requests' private blocks from the store (in the background)."""
        names: set[str] = set()
        for request_id in request_ids:
            names |= self._request_blocks.pop(request_id, set())
        if names:
            refs = [BlockRef(block_id=0, name=name) for name in sorted(names)]
            keys = [key for buffer in self.registered.buffers.in_order
                    for key in buffer.keys(self.parts.keys, refs)]
            # After the staged put of these keys: removing first would leave them stored
            # (and the put's begin_save would cancel a removal not yet started).
            self.registered.saver.after_puts(lambda: self.poisoned.remove_later(keys))

    def close(self) -> None:
        registered, self._registered = self._registered, None
        if registered is not None:
            registered.loader.close()
            registered.saver.close()
        self.poisoned.close()
        for pointer in registered.memory if registered is not None else ():
            try:
                self.store.unregister(pointer)
            except Exception as error:  # shutting down: report, do not mask the real exit
                logger.warning("kvo layerwise: unregistering KV memory failed: %s", error)
