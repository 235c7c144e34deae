"""The prefill publisher's bookkeeping: READYs in flight, their deadlines, each request's sends.

Pure logic with no sockets, threads or clocks of its own (the caller passes ``now`` and holds
its lock), so the rules are unit-testable: an answer matches only a READY still in flight; the
first missed deadline to an endpoint fails everything queued behind it there (the decode
answers in order); a request's failure is reported as soon as none of its READYs is in flight,
its success only after its last layer, and each request once.
"""

from __future__ import annotations

import heapq

import attrs

from kvo_core.gates import SlotKey

Outcome = str | BaseException | None
"""None: READ_DONE; otherwise why the READY failed."""


@attrs.define
class PendingReady:
    """A READY waiting for its answer."""

    endpoint: str
    seq: int
    layer_index: int
    layer_name: str
    slot_key: SlotKey
    part: str
    request_ids: tuple[str, ...]
    sent_at: float
    deadline: float
    lease_words: tuple[int, ...] = ()
    """Epoch words of its requests (kvo_transport.fence): advanced if it fails."""
    connection: int = 0
    """Which connection to ``endpoint`` it went out on (a renewed session uses a new one)."""


@attrs.define
class _RequestSends:
    """A request's READYs in flight; it is reported once none is (its blocks may be in use)."""

    inflight: int = 0
    last_published: bool = False
    error: Outcome = None
    reported: bool = False


class ReadyLedger:
    """READYs in flight by (endpoint, seq), a deadline heap, and per-request send counts."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, int], PendingReady] = {}
        self._deadlines: list[tuple[float, str, int]] = []
        self._requests: dict[str, _RequestSends] = {}

    def add(self, item: PendingReady, last_request_ids: frozenset[str]) -> list[str]:
        """Record a READY just published; the request ids tracked for the first time."""
        self._pending[(item.endpoint, item.seq)] = item
        heapq.heappush(self._deadlines, (item.deadline, item.endpoint, item.seq))
        new = []
        for request_id in item.request_ids:
            sends = self._requests.get(request_id)
            if sends is None:
                sends = self._requests[request_id] = _RequestSends()
                new.append(request_id)
            sends.inflight += 1
            sends.last_published = sends.last_published or request_id in last_request_ids
        return new

    def answer(self, endpoint: str, seq: int) -> PendingReady | None:
        """The READY an answer is for, taken out of flight; None for a late or repeated one."""
        return self._pending.pop((endpoint, seq), None)

    def drop_endpoint(self, endpoint: str) -> list[PendingReady]:
        """Everything in flight to ``endpoint`` (its session is gone), taken out of flight."""
        return [self._pending.pop(key) for key in list(self._pending) if key[0] == endpoint]

    def drain(self) -> list[PendingReady]:
        """Everything in flight (the publisher closes)."""
        items = list(self._pending.values())
        self._pending.clear()
        return items

    def expire(self, now: float) -> tuple[list[PendingReady], list[PendingReady]]:
        """(READYs past their deadline, READYs queued behind them to the same endpoints)."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, endpoint, seq = heapq.heappop(self._deadlines)
            item = self._pending.pop((endpoint, seq), None)
            if item is not None:
                expired.append(item)
        late = {item.endpoint for item in expired}
        behind = [self._pending.pop(key) for key in list(self._pending) if key[0] in late]
        return expired, behind

    def next_deadline(self) -> float | None:
        """The earliest deadline still in flight (answered READYs' entries are dropped)."""
        deadlines = self._deadlines
        while deadlines and (deadlines[0][1], deadlines[0][2]) not in self._pending:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def settle(self, item: PendingReady, outcome: Outcome) -> list[tuple[str, Outcome]]:
        """Count one READY's outcome against its requests; the (request, outcome) reports due.

        A failure is due as soon as nothing of the request is in flight; a success only after
        its last layer. Later READYs of a failed request are still counted (so it is not
        tracked afresh) but not reported again.
        """
        reports: list[tuple[str, Outcome]] = []
        for request_id in item.request_ids:
            sends = self._requests.get(request_id)
            if sends is None:
                continue
            sends.inflight -= 1
            if outcome is not None and sends.error is None:
                sends.error = outcome
            if sends.inflight:
                continue
            if not sends.reported and (sends.error is not None or sends.last_published):
                sends.reported = True
                reports.append((request_id, sends.error))
            if sends.last_published:
                del self._requests[request_id]
        return reports

    def forget(self, request_id: str) -> None:
        """Stop counting a request (aborted before its last layer)."""
        self._requests.pop(request_id, None)

    def in_flight(self) -> int:
        return len(self._pending)
