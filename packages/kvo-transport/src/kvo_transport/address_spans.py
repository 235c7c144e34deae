"""Which registered span an address falls in: the lookup engine wrappers use to tell layers apart.

A read's local address says which KV layer (or which part of it) the bytes land in; wrappers
that count, time or fault reads per layer all need that answer, and only for a handful of
sorted, disjoint spans, so a bisect over their starts is enough.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class AddressSpans(Generic[T]):
    """Half-open address spans [start, end), each carrying a value.

    Meant for disjoint spans; where two overlap, an address in both finds the one that starts
    later (no error: tensors vLLM shares between layers may repeat a span).
    """

    def __init__(self, spans: Iterable[tuple[int, int, T]]) -> None:
        ordered = sorted(spans, key=lambda span: span[0])
        self._starts = [start for start, _, _ in ordered]
        self._ends = [end for _, end, _ in ordered]
        self._values = [value for _, _, value in ordered]

    def find(self, address: int) -> T | None:
        """The value of the span holding ``address``, or None outside every span."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0 or address >= self._ends[i]:
            return None
        return self._values[i]

    def __len__(self) -> int:
        return len(self._values)
