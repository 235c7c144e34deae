"""Readies a layer's buffer for its attention: its slot free (the previous occupant's save
over), then the step's blocks for it loaded from the store, in the background ahead of the
forward (``prefetch_depth`` layers) or on the forward's thread when there is nothing to load.
"""

from __future__ import annotations

import ctypes
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from kvo_vllm.layerwise.buffers import LayerBuffer, LayerBuffers
from kvo_vllm.layerwise.errors import PipelineError
from kvo_vllm.layerwise.metadata import BlockRef
from kvo_vllm.layerwise.pipeline_parts import PipelineParts

logger = logging.getLogger(__name__)

LOAD_ATTEMPTS = 3
"""Tries of one layer's batched get before its blocks are reported as load errors."""


class LayerLoader:
    """Makes layers ready in forward order, one step at a time."""

    def __init__(self, parts: PipelineParts, buffers: LayerBuffers, prefetch_depth: int) -> None:
        self._parts = parts
        self._buffers = buffers
        self._prefetch_depth = prefetch_depth
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvo-lw-load")
        self._loads: dict[bool, list[BlockRef]] = {True: [], False: []}
        """The step's blocks to load, for shared layers (True) and layers owning a buffer."""
        self._any_loads = False
        self._pending: dict[str, Future[list[int]]] = {}
        self.ready: set[str] = set()
        """Layers of the running step whose buffer is ready."""

    def start_step(self, loads_shared: list[BlockRef], loads_owned: list[BlockRef]) -> None:
        self._loads = {True: loads_shared, False: loads_owned}
        self._any_loads = bool(loads_shared or loads_owned)
        self._pending = {}
        self.ready = set()

    @property
    def loads_pending(self) -> bool:
        return bool(self._pending)

    def prefetch_from(self, position: int) -> None:
        """Submit the loads of the layers from ``position`` to ``prefetch_depth`` past it."""
        if not self._any_loads:
            return
        order = self._buffers.in_order
        last = min(position + self._prefetch_depth, len(order) - 1)
        for buffer in order[position:last + 1]:
            name = buffer.layer.name
            # A layer with nothing to load only waits for its slot; make_ready does that on
            # the forward's thread (a cold prefill: no hand-off to the loader per layer).
            if self.loads_of(buffer) and name not in self._pending and name not in self.ready:
                self._pending[name] = self._executor.submit(self.load_layer, buffer)

    def make_ready(self, position: int) -> list[int]:
        """Ready the layer at ``position``; the block ids whose load failed."""
        buffer = self._buffers.in_order[position]
        name = buffer.layer.name
        future = self._pending.pop(name, None) if self._pending else None
        if future is None and self._parts.rounds.is_quiet(buffer.slot):
            # Nothing to load (see prefetch_from) and the slot is free: the common cold
            # layer, made ready with no wait and no clock read.
            self.ready.add(name)
            return []
        started = time.perf_counter()
        if future is None:  # nothing to load: wait for the slot
            self._parts.rounds.wait_free(buffer)
            failed: list[int] = []
        else:
            try:
                failed = future.result(timeout=2 * self._parts.deadline_s)
            except TimeoutError as error:
                raise PipelineError(
                    f"layer {name!r} was not ready within {2 * self._parts.deadline_s:g} s "
                    f"(slot release or store load hung)") from error
        self._parts.recorder.step.ready_wait_seconds += time.perf_counter() - started
        self.ready.add(name)
        return failed

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def loads_of(self, buffer: LayerBuffer) -> list[BlockRef]:
        """The running step's blocks to load into ``buffer``'s layer."""
        return self._loads[buffer.layer.shared]

    def load_layer(self, buffer: LayerBuffer) -> list[int]:
        """Load the step's blocks into every part of the layer; the block ids that failed.

        A block is loaded only when all its parts are: one part missing (or poisoned) fails
        the block, and vLLM recomputes it.
        """
        self._parts.rounds.wait_free(buffer)
        refs = self.loads_of(buffer)
        if not refs:
            return []
        started = time.perf_counter()
        keys = buffer.keys(self._parts.keys, refs)
        addrs, sizes = buffer.locations(refs)
        # Two requests with one prefix load the same key into two device blocks. Each key is
        # read from the store once (a batched get does not fill two destinations of one key:
        # measured with Mooncake) and copied to its other blocks on the device.
        first_of: dict[str, int] = {}
        copies: list[tuple[int, int]] = []
        poisoned = self._parts.poisoned.poisoned_among(keys)
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
        self._parts.recorder.loaded(buffer, loaded=len(loaded), failed=len(failed),
                              missing=len({i % count for i in absent}),
                              seconds=time.perf_counter() - started)
        return failed

    def _get_with_retries(self, buffer: LayerBuffer, keys: list[str], addrs: list[int],
                          sizes: list[int]) -> list[bool] | None:
        """The store's per-key answer, or None when every try raised (all keys failed).

        A raised get may have written part of the destination; a retry rewrites all of it.
        """
        for attempt in range(1, LOAD_ATTEMPTS + 1):
            try:
                return list(self._parts.store.get_into(keys, addrs, sizes))
            except Exception as error:
                if attempt == LOAD_ATTEMPTS:
                    logger.error("kvo layerwise: loading layer %s failed after %d tries: %s",
                                 buffer.layer.name, attempt, error)
                else:
                    logger.warning("kvo layerwise: loading layer %s failed (try %d of %d), "
                                   "retrying: %s", buffer.layer.name, attempt, LOAD_ATTEMPTS,
                                   error)
        return None
