"""One decode request's pull, from its registration to its one answer, as one state machine.

A request decode will pull is ``REGISTERED`` when its destination blocks are known, ``READING``
once a READY resolved them (the prefill is sending), ``RECEIVED`` when every contributor
delivered every layer. A pull that fails (a refused or failed read, a stale read, the prefill
gave it up, a deadline passed) or that vLLM stops (it aborted the request) is ``RETURNING``:
its destination is revoked, and its blocks wait until no read can write them any more
(``settled``: no read in flight, no failed read's quarantine), then it is ``RETURNED``. A
received or returned pull is handed to the engine once (``REPORTED``); the reported request ids
are remembered (bounded) so that an abort that crossed the report is not answered twice.

``TRANSITIONS`` is the whole machine: anything not in it is refused. ``DeadlinePolicy`` is the
one rule for giving up on a pull that stopped arriving. ``PullTable`` holds every request's
record and moves them (thread-safe: the receiver thread resolves destinations while the
engine's step thread registers, collects and stops); what a transition means for the engine
(revoking blocks, counting, logging) is the caller's, from the records each call returns.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import attrs

from kvo_transport.read_plan import RequestDestination


class PullState(enum.Enum):
    REGISTERED = "registered"
    READING = "reading"
    RECEIVED = "received"
    RETURNING = "returning"
    RETURNED = "returned"
    REPORTED = "reported"


class PullEvent(enum.Enum):
    READY_SEEN = "a READY resolved the destination"
    DELIVERED = "every contributor delivered every layer"
    FAILED = "the pull failed, was given up, or passed its deadline"
    STOPPED = "the engine aborted the request"
    SETTLED = "no read can write its blocks any more"
    REPORTED = "handed to the engine"


_LIVE = (PullState.REGISTERED, PullState.READING)

TRANSITIONS: dict[tuple[PullState, PullEvent], PullState] = {
    **{(live, PullEvent.READY_SEEN): PullState.READING for live in _LIVE},
    **{(live, PullEvent.DELIVERED): PullState.RECEIVED for live in _LIVE},
    **{(live, PullEvent.FAILED): PullState.RETURNING for live in _LIVE},
    **{(live, PullEvent.STOPPED): PullState.RETURNING for live in _LIVE},
    (PullState.RETURNING, PullEvent.SETTLED): PullState.RETURNED,
    (PullState.RECEIVED, PullEvent.REPORTED): PullState.REPORTED,
    (PullState.RETURNED, PullEvent.REPORTED): PullState.REPORTED,
}
"""(state, event) -> the next state; every pair not here is refused."""


class RefusedTransitionError(Exception):
    """An event that the pull's state does not allow (a bug in the caller)."""


def next_state(state: PullState, event: PullEvent) -> PullState:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise RefusedTransitionError(f"a pull that is {state.value} cannot take "
                                     f"{event.name} ({event.value})") from None


@attrs.define
class RequestPull:
    """One request's pull (transfer ``transfer_id`` of engine request ``request_id``)."""

    transfer_id: str
    request_id: str
    destination: RequestDestination
    registered_at: float
    state: PullState = PullState.REGISTERED
    last_seen: float | None = None
    """When a READY last resolved the destination (None: none yet)."""
    invalid: frozenset[int] = frozenset()
    """Blocks the engine must not use (a failed pull's, every block when nothing specific)."""
    reason: str | None = None
    """Why it failed (None: received, or stopped by the engine: no load error to report)."""

    def move(self, event: PullEvent) -> None:
        self.state = next_state(self.state, event)

    def name_invalid(self, blocks: Iterable[int]) -> None:
        """The failed reads named these blocks (else every block stays suspect)."""
        named = frozenset(blocks)
        if named:
            self.invalid = named

    def blocks(self) -> frozenset[int]:
        """The destination blocks it was to write (holes, ``-1``, left out)."""
        return frozenset(b for b in self.destination.main_block_ids if b >= 0)


@attrs.frozen
class DeadlinePolicy:
    """When a pull that stopped arriving is given up: ``first_ready_s`` after registration
    when no READY came yet (the prefill may still be handshaking), ``next_ready_s`` after the
    last READY otherwise."""

    first_ready_s: float
    next_ready_s: float

    def overdue(self, pull: RequestPull, now: float) -> str | None:
        """Why ``pull`` is given up at ``now``, or None while it may still arrive."""
        if pull.last_seen is None:
            if now - pull.registered_at > self.first_ready_s:
                return f"no READY arrived within {self.first_ready_s:g} s"
        elif now - pull.last_seen > self.next_ready_s:
            return f"no further READY arrived within {self.next_ready_s:g} s"
        return None


REPORTED_MEMORY = 65536
"""How many reported request ids are remembered (an abort that crossed the report)."""


class PullTable:
    """Every decode request's pull, each in one state of the machine (module docstring)."""

    def __init__(self, deadlines: DeadlinePolicy, *, reported_memory: int = REPORTED_MEMORY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.deadlines = deadlines
        self._clock = clock
        self._reported_memory = reported_memory
        self._lock = threading.Lock()
        self._live: dict[str, RequestPull] = {}  # transfer id -> REGISTERED or READING
        self._returning: list[RequestPull] = []
        self._answers: list[RequestPull] = []  # RECEIVED or RETURNED, not reported yet
        self._reported: OrderedDict[str, None] = OrderedDict()  # request ids, oldest first

    @property
    def live(self) -> int:
        """Pulls registered and not over (received, failed or stopped)."""
        return len(self._live)

    @property
    def returning(self) -> int:
        """Given-up pulls whose blocks may still be written."""
        return len(self._returning)

    def register(self, transfer_id: str, request_id: str,
                 destination: RequestDestination) -> RequestPull:
        pull = RequestPull(transfer_id=transfer_id, request_id=request_id,
                           destination=destination, registered_at=self._clock())
        with self._lock:
            self._live[transfer_id] = pull
        return pull

    def pull(self, transfer_id: str) -> RequestPull | None:
        """The live pull of ``transfer_id``, or None."""
        with self._lock:
            return self._live.get(transfer_id)

    def resolve(self, transfer_id: str) -> RequestDestination | None:
        """The destination a READY of ``transfer_id`` may write (receiver thread), or None
        once the pull is over."""
        with self._lock:
            pull = self._live.get(transfer_id)
            if pull is None:
                return None
            pull.move(PullEvent.READY_SEEN)
            pull.last_seen = self._clock()
            return pull.destination

    def deliver(self, transfer_id: str) -> RequestPull | None:
        """Every layer arrived: RECEIVED. None when the pull was over already."""
        with self._lock:
            pull = self._live.pop(transfer_id, None)
            if pull is not None:
                pull.move(PullEvent.DELIVERED)
                self._answers.append(pull)
            return pull

    def fail(self, transfer_id: str, reason: str) -> RequestPull | None:
        """The pull failed: RETURNING, every block suspect until ``name_invalid`` says which.
        None when it was over already."""
        with self._lock:
            pull = self._live.pop(transfer_id, None)
            if pull is not None:
                self._give_up(pull, PullEvent.FAILED, reason)
            return pull

    def expire(self) -> list[RequestPull]:
        """Give up (FAILED) every live pull the deadline policy says is overdue."""
        now = self._clock()
        with self._lock:
            overdue = [(p, why) for p in self._live.values()
                       if (why := self.deadlines.overdue(p, now)) is not None]
            for pull, why in overdue:
                del self._live[pull.transfer_id]
                self._give_up(pull, PullEvent.FAILED, f"{why} (prefill lost or too slow)")
        return [pull for pull, _ in overdue]

    def stop(self, request_id: str) -> tuple[list[RequestPull], bool]:
        """The engine aborted ``request_id``: its live pulls are STOPPED (returned first).
        With none, it still gets its one answer, unless it has one on the way or had one
        already (second item: it was reported before, for the caller's log)."""
        with self._lock:
            found = [p for p in self._live.values() if p.request_id == request_id]
            for pull in found:
                del self._live[pull.transfer_id]
                self._give_up(pull, PullEvent.STOPPED, None)
            reported = not found and request_id in self._reported
            pending = any(p.request_id == request_id for p in (*self._returning, *self._answers))
            if not found and not reported and not pending:
                # Never registered: vLLM waits for one answer all the same.
                self._answers.append(RequestPull(
                    transfer_id="", request_id=request_id, destination=RequestDestination(()),
                    registered_at=self._clock(), state=PullState.RETURNED))
        return found, reported

    def settle(self, settled: Callable[[RequestPull], bool]) -> list[RequestPull]:
        """RETURNED: the returning pulls whose blocks ``settled`` says no read can write."""
        with self._lock:
            waiting, self._returning = self._returning, []
        done: list[RequestPull] = []
        still: list[RequestPull] = []
        for pull in waiting:  # outside the lock: ``settled`` takes the receiver's
            (done if settled(pull) else still).append(pull)
        with self._lock:
            self._returning.extend(still)
            for pull in done:
                pull.move(PullEvent.SETTLED)
                self._answers.append(pull)
        return done

    def report(self) -> list[RequestPull]:
        """REPORTED: the pulls received or returned since the last call, once each."""
        with self._lock:
            answers, self._answers = self._answers, []
            for pull in answers:
                pull.move(PullEvent.REPORTED)
                self._reported[pull.request_id] = None
            while len(self._reported) > self._reported_memory:
                self._reported.popitem(last=False)
        return answers

    def _give_up(self, pull: RequestPull, event: PullEvent, reason: str | None) -> None:
        """RETURNING; a failed pull's blocks are all suspect until the reads name some."""
        pull.move(event)
        pull.reason = reason
        if reason is not None:
            pull.invalid = pull.blocks()
        self._returning.append(pull)
