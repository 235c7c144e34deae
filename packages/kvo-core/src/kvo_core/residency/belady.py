"""Offline optimal replay: the fewest misses any policy could get on a trace (it knows the future).

The bound a real (LRU) policy is measured against. Every step's selected tokens must all be
resident after the step; when room is needed, the resident token not selected now whose next
use is furthest away is evicted (Belady's MIN, which stays optimal when a step requests a set).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvo_core.residency.inputs import overflow_message
from kvo_core.residency.state import ResidencyInputError, ResidencyOverflowError


def belady_min_misses(trace: Sequence[Sequence[int]], capacity: int) -> int:
    """Misses of the optimal policy on one row's trace (per step the selected tokens, -1 pads).

    Negative entries are padding; a token repeated within a step counts once.
    """
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ResidencyInputError(f"capacity must be an integer >= 1, got {capacity!r}")
    steps = [list(dict.fromkeys(int(t) for t in step if t >= 0)) for step in trace]
    for i, selected in enumerate(steps):
        if len(selected) > capacity:
            raise ResidencyOverflowError(
                f"step {i}: " + overflow_message(0, len(selected), capacity))

    never = len(steps)
    next_use: list[dict[int, int]] = [{} for _ in steps]
    upcoming: dict[int, int] = {}
    for i in range(len(steps) - 1, -1, -1):
        next_use[i] = {t: upcoming.get(t, never) for t in steps[i]}
        for t in steps[i]:
            upcoming[t] = i

    resident: dict[int, int] = {}  # token -> step of its next use
    furthest: list[tuple[int, int]] = []  # max-heap of (-next use, token); stale entries skipped
    misses = 0
    for i, selected in enumerate(steps):
        missing = [t for t in selected if t not in resident]
        misses += len(missing)
        # Tokens selected now have next use == i, every other resident one a later step, so the
        # heap yields unselected tokens first.
        excess = len(resident) + len(missing) - capacity
        while excess > 0:
            key, token = heapq.heappop(furthest)
            if resident.get(token) == -key:
                del resident[token]
                excess -= 1
        for t in selected:
            resident[t] = next_use[i][t]
            heapq.heappush(furthest, (-next_use[i][t], t))
    return misses
