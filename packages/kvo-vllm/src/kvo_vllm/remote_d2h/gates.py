"""Joining the remote reads of a layer buffer to the store save in one slot gate.

On a prefill that both saves layers to the store (LayerwiseStoreConnector) and exposes them to
decode (RemoteD2HConnector), a reused buffer may only be overwritten when the save *and* every
remote read of its previous content are done. The layerwise pipeline closes the slot's round
with its store part plus one "remote" part per layer and step; this module makes the remote
side report that single part:

- ``ReadPartsForwarder`` stands in for the gates of a ``PrefillPublisher``: the publisher closes
  a round with one part per decode endpoint it sent a READY to; the forwarder folds those parts
  into the one remote part and reports it done when all are, or failed with the first error.
- ``JoinedSlotGates`` is the shared ``SlotGates``. The remote side publishes a layer *before*
  the layerwise pipeline closes the round (so the READY is out as early as possible, and so a
  single shared buffer cannot wait on a read that was never requested); an answer can then
  arrive before the round exists. Parts announced with ``announce`` are kept until the round
  that names them is closed, then applied.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import attrs

from kvo_core.gates import SlotGates, SlotKey

_MAX_ORPHANS = 4096
"""Announced parts whose round never came (the step had no save) are dropped past this many."""


class JoinedSlotGates(SlotGates):
    """SlotGates that accept reports for announced parts before the round naming them closes."""

    def __init__(self) -> None:
        super().__init__()
        self._early_lock = threading.Lock()
        self._announced: dict[tuple[SlotKey, str], list[str | BaseException | None]] = {}

    def announce(self, key: SlotKey, part: str) -> None:
        """``part`` will be one of the parts of the next round closed on ``key``."""
        with self._early_lock:
            if len(self._announced) >= _MAX_ORPHANS:
                self._announced.pop(next(iter(self._announced)))
            self._announced[(key, part)] = []

    def close(self, key: SlotKey, parts: Iterable[str]) -> None:
        parts = list(parts)
        with self._early_lock:
            super().close(key, parts)
            early = []
            for part in parts:
                reports = self._announced.pop((key, part), None)
                if reports:
                    early.append((part, reports[0]))
            for part, error in early:
                if error is None:
                    super().mark_done(key, part)
                else:
                    super().mark_failed(key, part, error)

    def mark_done(self, key: SlotKey, part: str) -> bool:
        return self._early_report(key, part, None) or super().mark_done(key, part)

    def mark_failed(self, key: SlotKey, part: str, error: str | BaseException) -> bool:
        return self._early_report(key, part, error) or super().mark_failed(key, part, error)

    def _early_report(self, key: SlotKey, part: str, error: str | BaseException | None) -> bool:
        with self._early_lock:
            reports = self._announced.get((key, part))
            if reports is None:
                return False
            reports.append(error)
            return True


@attrs.define
class _Group:
    key: SlotKey
    part: str | None
    pending: set[str]
    failed: bool = False


class ReadPartsForwarder:
    """The ``gates`` of a PrefillPublisher: one publish's read parts -> one part of a target.

    Call ``target_next(key, part)`` right before ``publish_layer``; with no target (RemoteD2H
    alone, no buffer reuse) the parts are only tracked, nothing waits on them.
    """

    def __init__(self, target: SlotGates | None = None) -> None:
        self._target = target
        self._lock = threading.Lock()
        self._next: tuple[SlotKey, str] | None = None
        self._groups: dict[str, _Group] = {}

    def target_next(self, key: SlotKey, part: str) -> None:
        with self._lock:
            self._next = (key, part)

    def close(self, key: SlotKey, parts: Iterable[str]) -> None:
        parts = set(parts)
        with self._lock:
            target_part = None
            if self._next is not None and self._next[0] == key:
                target_part = self._next[1]
            self._next = None
            group = _Group(key=key, part=target_part, pending=set(parts))
            for part in parts:
                self._groups[part] = group
        if not parts:
            self._report(group, None)

    def mark_done(self, key: SlotKey, part: str) -> bool:
        return self._settle(part, None)

    def mark_failed(self, key: SlotKey, part: str, error: str | BaseException) -> bool:
        return self._settle(part, error)

    def _settle(self, part: str, error: str | BaseException | None) -> bool:
        with self._lock:
            group = self._groups.pop(part, None)
            if group is None:
                return False
            group.pending.discard(part)
            report = False
            if error is not None and not group.failed:
                group.failed = True
                report = True
            elif error is None and not group.pending and not group.failed:
                report = True
        if report:
            self._report(group, error)
        return True

    def _report(self, group: _Group, error: str | BaseException | None) -> None:
        if self._target is None or group.part is None:
            return
        if error is None:
            self._target.mark_done(group.key, group.part)
        else:
            self._target.mark_failed(group.key, group.part, error)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._groups)
