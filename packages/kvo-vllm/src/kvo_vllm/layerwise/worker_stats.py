"""The layerwise worker's counters: one owner (``StatsRecorder``), written from the forward's
thread, the loader, the savers and the flush thread."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import attrs

from kvo_vllm.layerwise.buffers import LayerBuffer


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
    removal_retries: int = 0
    """Retries of removals that failed (e.g. Mooncake's, given up on a read lease)."""
    removals_given_up: int = 0
    """Keys whose removal failed on every retry: they stay in the store (still poisoned)."""
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
            "layerwise_removal_retries": self.removal_retries,
            "layerwise_removals_given_up": self.removals_given_up,
            "layerwise_ready_wait_seconds": self.ready_wait_seconds,
            "layerwise_step_end_wait_seconds": self.step_end_wait_seconds,
        }


@attrs.define
class StepCounts:
    """Counters the forward's thread adds to during a step, with no lock, folded into
    ``LayerwiseStats`` at its end (one lock per step, not one per layer)."""

    ready_wait_seconds: float = 0.0
    staged_bytes: int = 0
    stage_seconds: float = 0.0
    held_bytes: int = 0


def bytes_by_part(buffer: LayerBuffer, blocks: int) -> dict[str, int]:
    """What ``blocks`` blocks of ``buffer``'s layer weigh in each cache part."""
    return {part.planned.part: blocks * part.planned.block_bytes for part in buffer.parts}


def _add_by_part(into: dict[str, int], amounts: Mapping[str, int]) -> None:
    for name, moved in amounts.items():
        into[name] = into.get(name, 0) + moved


class StatsRecorder:
    """Owns ``stats``: every thread adds through it, under one lock."""

    def __init__(self) -> None:
        self.stats = LayerwiseStats()
        self.step = StepCounts()
        """The forward thread's counters of the running step (``fold_step``)."""
        self._lock = threading.Lock()

    def add(self, **amounts: float) -> None:
        """Add to the named counters (``LayerwiseStats`` fields)."""
        with self._lock:
            for name, amount in amounts.items():
                setattr(self.stats, name, getattr(self.stats, name) + amount)

    def fold_step(self) -> None:
        """Add the step's forward-thread counters to ``stats``."""
        counts, self.step = self.step, StepCounts()
        self.add(**attrs.asdict(counts))

    def loaded(self, buffer: LayerBuffer, *, loaded: int, failed: int, missing: int,
               seconds: float) -> None:
        """A layer's load ended: ``loaded`` blocks in, ``failed`` not (``missing`` of them
        absent from the store)."""
        moved = bytes_by_part(buffer, loaded)
        with self._lock:
            stats = self.stats
            stats.loaded_blocks += loaded
            layer = buffer.layer.index
            stats.loaded_blocks_by_layer[layer] = (
                stats.loaded_blocks_by_layer.get(layer, 0) + loaded)
            stats.loaded_bytes += sum(moved.values())
            _add_by_part(stats.loaded_bytes_by_part, moved)
            stats.failed_loads += failed
            stats.missing_blocks += missing
            stats.load_seconds += seconds

    def saved(self, blocks: int, moved: Mapping[str, int], **times: float) -> None:
        """A put stored ``blocks`` blocks (``moved``: their bytes by part); ``times``: what to
        add to ``save_seconds`` (a layer's direct put) or ``flush_seconds`` and
        ``staged_puts`` (a step's batched put)."""
        self.add(saved_blocks=blocks, saved_bytes=sum(moved.values()), **times)
        with self._lock:
            _add_by_part(self.stats.saved_bytes_by_part, moved)
