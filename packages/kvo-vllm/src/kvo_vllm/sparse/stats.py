"""Counters of the sparse decode path: what each step moved and what the device holds.

The point of the design is that a step moves bytes in proportion to the misses, not to the
history length; these counters are how tests and benchmarks check that.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class LayerStepStats:
    """One layer of one decode step, summed over the batch."""

    layer: int
    requests: int
    selected: int          # valid top-k entries (distinct tokens per request)
    hits: int              # selected tokens already in the hot buffer
    misses: int            # selected tokens copied host -> device
    h2d_bytes: int         # bytes that sparse_copy moved host -> device
    full_reload_bytes: int  # bytes a whole-history reload of this layer would move


@attrs.frozen
class StepStats:
    """One decode step (all layers), summed over the batch."""

    layers: tuple[LayerStepStats, ...]

    @property
    def selected(self) -> int:
        return sum(s.selected for s in self.layers)

    @property
    def hits(self) -> int:
        return sum(s.hits for s in self.layers)

    @property
    def misses(self) -> int:
        return sum(s.misses for s in self.layers)

    @property
    def h2d_bytes(self) -> int:
        return sum(s.h2d_bytes for s in self.layers)

    @property
    def full_reload_bytes(self) -> int:
        return sum(s.full_reload_bytes for s in self.layers)


@attrs.define
class Totals:
    """Running sums since the engine started."""

    steps: int = 0
    selected: int = 0
    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0

    def add(self, step: StepStats) -> None:
        self.steps += 1
        self.selected += step.selected
        self.hits += step.hits
        self.misses += step.misses
        self.h2d_bytes += step.h2d_bytes

    @property
    def hit_rate(self) -> float:
        return self.hits / self.selected if self.selected else 0.0


@attrs.frozen
class DeviceBytes:
    """Device memory the engine allocated: hot top-k buffers and the indexer cache."""

    hot_buffers: int
    indexer_cache: int

    @property
    def total(self) -> int:
        return self.hot_buffers + self.indexer_cache
