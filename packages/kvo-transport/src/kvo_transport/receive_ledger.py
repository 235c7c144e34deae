"""The decode receiver's per-request bookkeeping, without sockets or engines.

Which contributor (prefill rank) delivered which layers of a request, which destination blocks
a failed read made invalid, and when a request is terminal: finished once every contributor
delivered every layer, failed at its first failure but reported only once its invalid blocks
settled (``settled``: no read in flight into them, no quarantine; kvo_transport.destinations),
and never reported once forgotten. Thread-safe (its own lock); unit-tested on its own.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable

import attrs

from kvo_core.gates import RequestCompletionTracker


@attrs.frozen
class InvalidBlocks:
    """Destination blocks of a request that must not be used: a read into them failed."""

    main: frozenset[int] = frozenset()
    indexer: frozenset[int] = frozenset()


@attrs.define
class _Progress:
    """Layers each contributor has delivered for one request."""

    instance_id: str
    layers: dict[str, set[int]] = attrs.Factory(dict)


class ReceiveLedger:
    """Per-request delivery, invalid blocks and terminal states (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._progress: dict[str, _Progress] = {}
        self._invalid: dict[str, InvalidBlocks] = {}
        self._forgotten: set[str] = set()
        self._held: dict[str, str] = {}
        """Failed requests whose invalid blocks have not settled yet (reported later)."""
        self._tracker = RequestCompletionTracker()

    def expect(self, request_id: str, instance_id: str,
               contributor_parts: frozenset[str]) -> str | None:
        """Track ``request_id`` (first READY of it, from prefill ``instance_id``); returns the
        instance it started from when that differs (for a warning), else None."""
        with self._lock:
            progress = self._progress.get(request_id)
            if progress is None:
                self._progress[request_id] = _Progress(instance_id=instance_id)
                self._tracker.expect(request_id, contributor_parts)
                return None
            return None if progress.instance_id == instance_id else progress.instance_id

    def layer_failed(self, request_id: str, part: str, reason: str) -> None:
        self._tracker.mark_failed(request_id, part, reason)

    def layer_done(self, request_id: str, part: str, layer_index: int, layer_count: int,
                   last: bool, label: str) -> None:
        """Contributor ``part`` delivered a layer; with ``last`` its sends are over: done if it
        delivered all ``layer_count`` layers, failed naming the missing ones otherwise."""
        with self._lock:
            progress = self._progress.get(request_id)
            if progress is None:
                return
            seen = progress.layers.setdefault(part, set())
            seen.add(layer_index)
            missing = sorted(set(range(layer_count)) - seen) if last else None
        if missing is None:
            return
        if missing:
            shown = ", ".join(map(str, missing[:6])) + (", ..." if len(missing) > 6 else "")
            self._tracker.mark_failed(request_id, part,
                                      f"{label} sent its last layer without layers [{shown}]")
        else:
            self._tracker.mark_done(request_id, part)

    def invalidate(self, request_id: str, main: Iterable[int], indexer: Iterable[int]) -> None:
        with self._lock:
            known = self._invalid.get(request_id, InvalidBlocks())
            self._invalid[request_id] = InvalidBlocks(known.main | frozenset(main),
                                                      known.indexer | frozenset(indexer))

    def invalid(self, request_id: str) -> InvalidBlocks:
        with self._lock:
            return self._invalid.get(request_id, InvalidBlocks())

    def fail_pending(self, request_id: str, reason: str) -> None:
        """Fail every part of ``request_id`` that has not reported."""
        for part in self._tracker.pending(request_id):
            self._tracker.mark_failed(request_id, part, reason)

    def forget(self, request_id: str) -> None:
        """Drop the request (its blocks were released); it is never reported."""
        with self._lock:
            tracked = self._progress.pop(request_id, None) is not None  # not popped yet
            self._invalid.pop(request_id, None)
            self._held.pop(request_id, None)
            if tracked or self._tracker.pending(request_id):
                self._forgotten.add(request_id)
        self.fail_pending(request_id, "forgotten by the decode")

    def wait_finished(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until a request is terminal (done or failed)."""
        return self._tracker.wait_finished(timeout_s)

    def pop_finished(self, settled: Callable[[InvalidBlocks], bool]
                     ) -> tuple[set[str], dict[str, str]]:
        """Requests terminal since the last call: (finished ids, failed id -> first reason);
        a failed one only once ``settled`` says its invalid blocks may be handed back."""
        finished, failed = self._tracker.pop_finished()
        with self._lock:
            for request_id in itertools.chain(finished, failed):
                self._progress.pop(request_id, None)
            forgotten = self._forgotten & (finished | failed.keys())
            self._forgotten -= forgotten
            for request_id, reason in failed.items():  # a later failure keeps the first reason
                if request_id not in forgotten:
                    self._held.setdefault(request_id, reason)
            held = [(r, e, self._invalid.get(r, InvalidBlocks())) for r, e in self._held.items()]
        ready = {r: e for r, e, invalid in held if settled(invalid)}
        with self._lock:
            for request_id in ready:
                self._held.pop(request_id, None)
        return finished - forgotten, ready
