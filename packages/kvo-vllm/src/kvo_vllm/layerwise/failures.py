"""What the layerwise worker does when a load or a save fails.

A get that raises (e.g. Mooncake's LEASE_EXPIRED under load) is retried ``LOAD_ATTEMPTS``
times (``loader``). A load that still fails is reported as invalid blocks: vLLM then drops the
affected requests' output of this step and recomputes them from their first failed block, or
fails them, as ``kv_load_failure_policy`` says. The step's forward still runs over the failed
layer's buffer (for a shared layer it holds another layer's KV), so from that layer on the
affected requests' KV is wrong: their saves for those layers are dropped and the keys poisoned
(removed, never loaded), so neither another request nor a later step loads wrong or outdated KV
from the store. A failed save poisons its keys the same way. A step that poisoned keys ends
(``finish_step``) only once they are gone from the store (at most ``layer_deadline_s``): the
scheduler's next prefix lookup must not promise them to another request, whose load would fail.
A removal that takes longer still never lands after a later save of the same key
(``poisoned_keys``): it would delete the fresh value and fail the next request that loads it.
"""

from __future__ import annotations

import logging
import time

from kvo_vllm.layerwise.buffers import BlockSet, LayerBuffer
from kvo_vllm.layerwise.keys import StoreKeys
from kvo_vllm.layerwise.metadata import BlockRef, LayerwiseMetadata, RequestTransfers
from kvo_vllm.layerwise.poisoned_keys import PoisonedKeys
from kvo_vllm.layerwise.worker_stats import StatsRecorder

logger = logging.getLogger(__name__)


class FailurePolicy:
    """One step's failed loads and poisoned keys, and the failed block ids not yet reported."""

    def __init__(self, *, poisoned: PoisonedKeys, recorder: StatsRecorder, keys: StoreKeys,
                 deadline_s: float) -> None:
        self.poisoned = poisoned
        self._recorder = recorder
        self._keys = keys
        self._deadline_s = deadline_s
        self._meta: LayerwiseMetadata | None = None
        self._step_failed: set[int] = set()
        """Block ids whose load failed in the running step."""
        self._load_errors: set[int] = set()
        """Failed block ids not yet reported to vLLM."""
        self._step_poisoned = False

    def start_step(self, meta: LayerwiseMetadata | None) -> None:
        self._meta = meta
        self._step_failed = set()
        self._step_poisoned = False

    def end_step(self) -> None:
        """The step's forward is over: wait for the removal of the keys it poisoned."""
        self._meta = None
        if self._step_poisoned:
            self._step_poisoned = False
            self.remove_poisoned_now()

    def loads_failed(self, block_ids: list[int]) -> None:
        self._load_errors.update(block_ids)
        self._step_failed.update(block_ids)

    @property
    def any_load_failed(self) -> bool:
        return bool(self._step_failed)

    def _lost_a_load(self, request: RequestTransfers) -> bool:
        failed = self._step_failed
        return any(ref.block_id in failed
                   for ref in (*request.load_every_layer, *request.load_shared_layers))

    def requests_with_failed_loads(self) -> set[str]:
        """Requests of this step that lost a load so far: from that layer on their KV is wrong
        (see ``trusted_saves``), so nothing may hand it on (e.g. to a remote decode)."""
        if not self._step_failed or self._meta is None:
            return set()
        return {request.request_id for request in self._meta.requests
                if self._lost_a_load(request)}

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

    def trusted_saves(self, buffer: LayerBuffer, saves: BlockSet) -> BlockSet:
        """The step's saves for a layer, less those of requests a failed load made wrong.

        A request that lost a load in this layer or an earlier one attended over KV that is
        not its own; everything it computed from that layer on is wrong. It is not saved, and
        its keys for this layer are poisoned: an older value under the same name (a partial
        block saved last step) must not be loaded as if it were current. vLLM recomputes or
        fails the request once ``take_load_errors`` reports the blocks; its re-save un-poisons.
        """
        if not self._step_failed or self._meta is None or not saves.refs:
            return saves
        trusted = LayerwiseMetadata(requests=tuple(
            request for request in self._meta.requests if not self._lost_a_load(request))
        ).saves()
        kept = {ref.name for ref in trusted}
        dropped = sorted({ref.name for ref in saves.refs} - kept)
        if dropped:
            self.poison(buffer.keys(self._keys, [BlockRef(0, name) for name in dropped]))
        return BlockSet.of(trusted, self._keys)

    def save_failed(self, layer_name: str, keys: list[str], blocks: int,
                    error: Exception) -> None:
        """A layer's save failed: its keys are poisoned."""
        logger.error("kvo layerwise: saving layer %s failed: %s", layer_name, error)
        self.poison(keys)
        self._recorder.add(failed_saves=blocks)

    def staged_put_failed(self, keys: list[str], blocks: int, error: Exception) -> None:
        """A step's batched put failed (after the step: the next one waits for the removal)."""
        logger.error("kvo layerwise: saving %d staged blocks failed: %s", blocks, error)
        self.poison_after_step(keys)
        self._recorder.add(failed_saves=blocks, staged_puts=1)

    def poison(self, keys: list[str]) -> None:
        """Poison ``keys``; the step ends once they are removed (``end_step``)."""
        self._step_poisoned = True
        self.poison_after_step(keys)

    def poison_after_step(self, keys: list[str]) -> None:
        """Poison without ending the step on their removal (a staged put after the step:
        the next step waits for the removal in ``wait_staged_puts``)."""
        self.poisoned.poison(keys)
        self._recorder.add(poisoned_keys=len(keys))

    def remove_poisoned_now(self) -> None:
        """Wait for the removal of the keys poisoned so far (module docstring)."""
        started = time.perf_counter()
        if not self.poisoned.settle(self._deadline_s):
            logger.warning("kvo layerwise: removing poisoned keys from the store takes longer "
                           "than %g s; until it ends a prefix lookup may still find them",
                           self._deadline_s)
        self._recorder.add(step_end_wait_seconds=time.perf_counter() - started)
