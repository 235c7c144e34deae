"""Counters of the offload path inside vLLM: per layer call and running totals, logged every N.

A "layer call" is one attention forward of one layer (one vLLM step runs every layer once).
``hits`` counts the selected entries of decode rows served from the hot buffer without a copy
(with several query rows per request, a position two rows select counts for each row);
``misses`` the distinct rows copied host -> device; ``h2d_bytes`` is ``misses x row bytes`` by
construction of the copy, which tests check against the bytes the copy op really moved.
NOT_OFFLOADED rows (``identity_rows``, whose sequence fits their hot row) count their selected
entries as hits; ``identity_fills`` counts the rows copied pool -> hot row to keep them
complete (one per row and step, a whole prompt when a request joins), not in ``misses``.
``residency_seconds`` is the wall time of the layer call's gather (residency update, miss
copies, identity fills and their index work; with ``kernel_backend="fused"``: of the two fused
ops, which also score the indexer and attend).

The same totals reach vLLM's ``/metrics`` through kvo's connectors (:mod:`kvo_vllm.metrics`).
"""

from __future__ import annotations

import logging
from collections import deque

import attrs

log = logging.getLogger("kvo.vllm.dsa.offload")


@attrs.define
class OffloadLayerStats:
    """One layer call, summed over the batch. A record: nothing changes it once made (not
    ``frozen`` for speed: one is made per layer call, and a frozen class's ``__init__`` is
    several times slower at a decode step's start, docs/benchmarks.md)."""

    layer: int
    decode_rows: int        # requests that went through residency (query rows <= the limit)
    decode_tokens: int      # their query rows (> decode_rows: several rows per request, MTP)
    pool_rows: int          # requests whose tokens attended straight to the pool (prefill)
    selected: int           # valid top-k entries of the decode rows' tokens
    hits: int
    misses: int
    h2d_bytes: int
    full_reload_bytes: int  # bytes a reload of the decode rows' whole history would move
    pool_rows_used: int     # tokens the batch's requests hold in the pool (sum of seq lens)
    residency_seconds: float = 0.0
    identity_rows: int = 0     # decode rows NOT_OFFLOADED (read at identity slots, no residency)
    identity_fills: int = 0    # rows copied pool -> their identity slots (new rows, joins)
    first_offloads: int = 0    # decode rows that left NOT_OFFLOADED in this call


@attrs.define
class OffloadTotals:
    """Running sums over every layer call since start; ``steps`` counts calls of layer 0."""

    steps: int = 0
    calls: int = 0
    selected: int = 0
    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0
    full_reload_bytes: int = 0
    residency_seconds: float = 0.0

    def add(self, stats: OffloadLayerStats) -> None:
        self.calls += 1
        self.selected += stats.selected
        self.hits += stats.hits
        self.misses += stats.misses
        self.h2d_bytes += stats.h2d_bytes
        self.full_reload_bytes += stats.full_reload_bytes
        self.residency_seconds += stats.residency_seconds

    @property
    def hit_rate(self) -> float:
        return self.hits / self.selected if self.selected else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**attrs.asdict(self), "hit_rate": self.hit_rate}


class OffloadStats:
    """Keeps the last call per layer, the totals, and logs the totals every ``log_every`` steps.

    ``history`` keeps the last ``history_limit`` calls (tests and the benchmark read them); it is
    bounded so that a server running for weeks does not grow it without end.
    """

    def __init__(self, *, log_every: int = 0, history_limit: int = 0) -> None:
        if history_limit < 0:
            raise ValueError(f"history_limit is {history_limit}; allowed: >= 0")
        self.log_every = log_every
        self.totals = OffloadTotals()
        self.last: dict[int, OffloadLayerStats] = {}
        self.history: deque[OffloadLayerStats] = deque(maxlen=history_limit)

    @property
    def pool_rows_used(self) -> int:
        """The last step's level (its layer-0 call), 0 before the first."""
        first = self.last.get(0)
        return 0 if first is None else first.pool_rows_used

    def record(self, stats: OffloadLayerStats) -> None:
        if stats.layer == 0:
            self.totals.steps += 1
            if self.log_every and self.totals.steps % self.log_every == 0:
                t = self.totals
                log.info("kvo offload: %d steps, hit rate %.3f, %d misses, %.1f MiB host->device "
                         "(full reload would be %.1f MiB)", t.steps, t.hit_rate, t.misses,
                         t.h2d_bytes / 2**20, t.full_reload_bytes / 2**20)
        self.totals.add(stats)
        self.last[stats.layer] = stats
        if self.history.maxlen:
            self.history.append(stats)
