"""Completion gates: when a physical buffer may be overwritten, and when a request is done.

A physical KV buffer is shared by several logical layers (see ``kvo_core.buffer_plan``), so
completion is tracked per physical slot, keyed by the tuple of its base addresses: every
layer aliasing that storage computes the same key and therefore waits on the same gate.

A slot's life is a sequence of rounds. ``close(key, parts)`` starts a round: the slot is busy
until every part (the store save, each remote reader, ...) has reported. ``mark_done`` and
``mark_failed`` report parts; ``wait`` blocks until the round ends. The first failure ends the
round for every waiter with that error, so a failed save or read fails the request instead of
letting a later layer overwrite data someone still needs.

Decisions, so callers can rely on them:

- ``close`` on a slot whose round is still running (parts pending, no failure) raises
  GateStateError: overwriting would race with its consumers. ``close`` on an open or failed
  slot starts a new round; parts that never reported in a failed round are abandoned.
- ``close`` with no parts leaves the slot open (nothing reads the new content).
- A report for a part that is not pending in the slot's current round is ignored and the call
  returns False: it is a repeated acknowledgement (retries happen on the wire) or a late one
  from an abandoned round, and it must not kill the reporting thread. A misspelt part name is
  still visible: the round then never opens and ``wait``'s timeout names the missing part.
  To keep late reports from matching a new round, use part names unique per round (e.g. with
  the request id). A report for a slot that was never closed, of a part that was not
  announced or joined, is a bug and raises.
- ``wait`` timing out is only an observation: the round keeps running. To give up on a part,
  report it with ``mark_failed`` (e.g. with the SlotTimeoutError); then ``close`` may start a
  new round.
- A never-closed slot is open: fresh storage has no consumers.
- A ``GatePump`` may be attached (``attach_pump``): the transport whose answers report the
  parts. A waiter then handles those answers itself, in its own thread, instead of sleeping
  until the transport's I/O thread reports them and wakes it: one thread hand-off less on the
  latency path of every slot round. One waiter pumps at a time; the others sleep as usual, and
  a report from any other thread interrupts the pump so the pumping waiter sees it at once.
  The pump is only a shortcut: the transport must report on its own when nobody pumps.
- A part may be reported before the round that names it is closed, when it was announced
  (``announce(key, part)``): a producer that publishes its readers before the slot's owner
  closes the round (RemoteD2H publishes a layer before the layerwise pipeline closes its round,
  so the READY is out early and a shared buffer never waits for a read not yet requested). The
  first report of an announced part is held and applied when the round naming it is closed.
  Announcements whose round never comes are dropped past ``MAX_ANNOUNCED`` (oldest first).
- The slot's owner may take every announced part into its round without naming them
  (``close(..., take_announced=True)``): the announcer then only reports parts, and nothing
  carries part names from it to the owner. Announcements are keyed by epoch: the owner starts
  an epoch per step (``new_epoch``), an announcement belongs to the epoch it was made in, and
  ``close`` takes only the current epoch's. An announcement of an earlier epoch (its step
  closed no round on the slot) is stale: never taken, dropped with its held report at the
  next epoch, its later reports ignored. Else it would join a later round and could hold it
  busy or fail it with a report that belongs to another step's content.
- A part may be the join of sub-parts (``join(key, part, sub_parts)``): each sub-part (e.g. one
  per decode endpoint that was sent a READY) reports like a part; the joined part reports done
  when every sub-part is done, failed with the first sub-part failure. The joined part must be
  announced or pending in the current round. A reporter therefore only reports its own parts,
  whichever component closes the round.
- A ``SlotFence`` may be attached (``attach_fence``): the transport's epoch words. When a round
  ends with a failure (a reader failed, missed its deadline, or a waiter gave up on it), the
  fence advances the slot's epoch before any waiter is woken, so a reader still running can
  never have its read of the old content accepted once the slot is overwritten. This is the one
  place every slot reuse passes through: a slot is only overwritten after its round ended.

Request completion (``RequestCompletionTracker``) is separate: it decides when a request's
transfers are over, not when memory may be reused.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol

import attrs

from kvo_core.errors import KvoError, SlotFailedError, SlotTimeoutError

SlotKey = tuple[int, ...]
"""Base addresses of a physical slot's tensors; layers aliasing the storage share the key."""

MAX_ANNOUNCED = 4096
"""Announced parts whose round never came (e.g. the step saved nothing) kept at most."""

PUMP_SLICE_S = 0.05
"""Longest single pump call: a bound on how late a waiter notices a timeout or a new pump."""


class GatePump(Protocol):
    """A transport that can handle its answers in the calling thread (see ``attach_pump``)."""

    def pump(self, timeout_s: float) -> bool:
        """Handle the answers that have arrived, waiting up to ``timeout_s`` for the first;
        True when something was handled. Returns early when ``interrupt`` is called."""
        ...

    def interrupt(self) -> None:
        """Make a ``pump`` call running in another thread return soon."""
        ...


class SlotFence(Protocol):
    """Epoch words guarding slots against readers that are still running (kvo_transport.fence)."""

    def advance(self, key: SlotKey) -> None:
        """Readers of the slot's current content must now fail their fence check."""
        ...


class GateStateError(KvoError, RuntimeError):
    """A gate was used out of order (closing a busy slot, reporting on a never-closed slot...)."""


def _check_key(key: SlotKey) -> SlotKey:
    if type(key) is tuple and len(key) == 1 and type(key[0]) is int and key[0] >= 0:
        return key  # the common one-tensor slot, checked without a generator (hot path)
    if (not isinstance(key, tuple) or not key
            or any(not isinstance(a, int) or isinstance(a, bool) or a < 0 for a in key)):
        raise TypeError(f"a slot key must be a non-empty tuple of base addresses "
                        f"(non-negative ints), got {key!r}")
    return key


def _check_part(part: str) -> str:
    if not isinstance(part, str) or not part:
        raise TypeError(f"a part name must be a non-empty string, got {part!r}")
    return part


def slot_name(key: SlotKey) -> str:
    """Readable slot name for messages: its base addresses in hex."""
    return "(" + ", ".join(f"{address:#x}" for address in key) + ")"


def _describe_error(error: str | BaseException) -> str:
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}"
    return str(error)


@attrs.define
class _Round:
    """One close..open cycle of a slot; waiters hold on to the round they started waiting on."""

    expected: frozenset[str]
    pending: set[str]
    failed_part: str | None = None
    error: str | BaseException | None = None

    @property
    def over(self) -> bool:
        return not self.pending or self.error is not None


_Outcome = str | BaseException | None
"""A report: None (done) or the failure."""


@attrs.define
class _Join:
    """A part reported by its sub-parts: done when all are, failed with the first failure."""

    part: str
    pending: set[str]
    failed: bool = False


class SlotGates:
    """Thread-safe completion gates for physical buffer slots (rules in the module docstring)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._rounds: dict[SlotKey, _Round] = {}
        self._announced: OrderedDict[tuple[SlotKey, str], list[_Outcome]] = OrderedDict()
        self._announced_epoch: dict[tuple[SlotKey, str], int] = {}
        self._epoch = 0
        self._joins: dict[tuple[SlotKey, str], _Join] = {}  # (key, sub-part) -> its join
        self._pump: GatePump | None = None
        self._pumping_thread: int | None = None
        self._fence: SlotFence | None = None

    def attach_fence(self, fence: SlotFence | None) -> None:
        """Advance ``fence`` for a slot whose round fails, before its waiters wake (None
        detaches). One fence per table."""
        with self._changed:
            if fence is not None and self._fence is not None and self._fence is not fence:
                raise GateStateError("a slot fence is already attached; detach it first")
            self._fence = fence

    def attach_pump(self, pump: GatePump | None) -> None:
        """Let waiters drive ``pump`` while they wait (None detaches). One pump per table."""
        with self._changed:
            if pump is not None and self._pump is not None and self._pump is not pump:
                raise GateStateError("a gate pump is already attached; detach it first")
            self._pump = pump
            self._changed.notify_all()

    def new_epoch(self) -> int:
        """Start the owner's next epoch (one per step): announcements made before it are
        stale for ``close(..., take_announced=True)`` and are dropped now."""
        with self._changed:
            self._epoch += 1
            for entry in [e for e, epoch in self._announced_epoch.items()
                          if epoch != self._epoch]:
                self._forget_announcement(entry)
            return self._epoch

    def close(self, key: SlotKey, parts: Iterable[str], *, take_announced: bool = False) -> None:
        """Mark the slot busy until every one of ``parts`` reports; with ``take_announced``
        also until every part announced on the slot in the current epoch reports."""
        key = _check_key(key)
        expected = frozenset(_check_part(p) for p in parts)
        with self._changed:
            self._refuse_busy(key)
            self._open_round(key, expected, take_announced)
            self._changed.notify_all()

    def close_each(self, rounds: Iterable[tuple[SlotKey, str]], *,
                   take_announced: bool = False) -> None:
        """``close`` several slots under one lock, each until its pairs' parts report; none
        is closed if one is still busy. A step's end closes the rounds of every buffer its
        batched put reads like this."""
        wanted: dict[SlotKey, set[str]] = {}
        for key, part in rounds:
            wanted.setdefault(_check_key(key), set()).add(_check_part(part))
        with self._changed:
            for key in wanted:
                self._refuse_busy(key)
            for key, parts in wanted.items():
                self._open_round(key, frozenset(parts), take_announced)
            self._changed.notify_all()

    def _refuse_busy(self, key: SlotKey) -> None:
        """(lock held) Raise if the slot's round is still running."""
        current = self._rounds.get(key)
        if current is not None and not current.over:
            raise GateStateError(
                f"slot {slot_name(key)} is still busy (waiting for "
                f"{_names(current.pending)}); wait for it before closing it again")

    def _open_round(self, key: SlotKey, expected: frozenset[str], take_announced: bool) -> None:
        """(lock held) Start the slot's next round (``close``)."""
        if take_announced and self._announced_epoch:
            expected |= {part for (slot, part), epoch in self._announced_epoch.items()
                         if slot == key and epoch == self._epoch}
        current = self._rounds[key] = _Round(expected=expected, pending=set(expected))
        for part in sorted(expected):
            early = self._forget_announcement((key, part))
            if early:  # reported before this round existed: apply the first report
                self._apply(key, current, part, early[0])

    def _forget_announcement(self, entry: tuple[SlotKey, str]) -> list[_Outcome] | None:
        """(lock held) Drop an announcement; its held reports, or None if there was none."""
        self._announced_epoch.pop(entry, None)
        return self._announced.pop(entry, None)

    def announce(self, key: SlotKey, part: str) -> None:
        """``part`` will be a part of the next round closed on ``key``; its report may come
        first and is then held until that round is closed."""
        key, part = _check_key(key), _check_part(part)
        with self._changed:
            if (key, part) in self._announced:
                raise GateStateError(f"part {part!r} of slot {slot_name(key)} is already "
                                     f"announced; use part names unique per round")
            while len(self._announced) >= MAX_ANNOUNCED:
                oldest, _ = self._announced.popitem(last=False)  # its round never came
                self._announced_epoch.pop(oldest, None)
            self._announced[(key, part)] = []
            self._announced_epoch[(key, part)] = self._epoch

    def join(self, key: SlotKey, part: str, sub_parts: Iterable[str]) -> None:
        """``part`` (announced, or pending in the current round) is reported by ``sub_parts``:
        done once every one is done (at once if there are none), failed at the first failure."""
        key, part = _check_key(key), _check_part(part)
        subs = {_check_part(sub) for sub in sub_parts}
        with self._changed:
            current = self._rounds.get(key)
            if (key, part) not in self._announced and (current is None
                                                        or part not in current.pending):
                raise GateStateError(
                    f"part {part!r} of slot {slot_name(key)} is neither announced nor pending "
                    f"in its current round; announce it before joining sub-parts into it")
            taken = sorted(sub for sub in subs if (key, sub) in self._joins)
            if taken:
                raise GateStateError(f"sub-part(s) {taken} of slot {slot_name(key)} already "
                                     f"report into another part; use names unique per round")
            group = _Join(part=part, pending=subs)
            for sub in subs:
                self._joins[(key, sub)] = group
            if not subs:
                self._settle(key, part, None)
            self._changed.notify_all()
            interrupt = self._interrupt_needed()
        if interrupt is not None:
            interrupt.interrupt()

    def in_flight_sub_parts(self) -> int:
        """Sub-parts joined into a part that have not reported yet."""
        with self._changed:
            return len(self._joins)

    def mark_done(self, key: SlotKey, part: str) -> bool:
        """Report that ``part`` no longer needs the slot; False if the report was ignored."""
        return self._report(key, part, None)

    def mark_failed(self, key: SlotKey, part: str, error: str | BaseException) -> bool:
        """Report that ``part`` failed; the first failure is raised to every waiter."""
        return self._report(key, part, error)

    def _report(self, key: SlotKey, part: str, error: _Outcome) -> bool:
        key = _check_key(key)
        part = _check_part(part)
        with self._changed:
            joined = self._joins.pop((key, part), None)
            if joined is not None:
                joined.pending.discard(part)
                if error is not None and not joined.failed:
                    joined.failed = True
                    self._settle(key, joined.part, error)
                elif error is None and not joined.pending and not joined.failed:
                    self._settle(key, joined.part, None)
                handled = True
            elif (key, part) not in self._announced and key not in self._rounds:
                raise GateStateError(
                    f"part {part!r} reported on slot {slot_name(key)}, which was never closed")
            else:
                handled = self._settle(key, part, error)
            self._changed.notify_all()
            interrupt = self._interrupt_needed()
        if interrupt is not None:
            interrupt.interrupt()  # the pumping waiter is not on the condition: tell it
        return handled

    def _settle(self, key: SlotKey, part: str, error: _Outcome) -> bool:
        """(lock held) Report ``part``: held if announced, else to the current round; False
        when ignored (not pending, or a joined part whose slot's round is gone)."""
        early = self._announced.get((key, part))
        if early is not None:
            early.append(error)
            return True
        current = self._rounds.get(key)
        if current is None:
            return False
        return self._apply(key, current, part, error)

    def _apply(self, key: SlotKey, current: _Round, part: str, error: _Outcome) -> bool:
        """(lock held) Report ``part`` to the round ``current``."""
        if part not in current.pending:
            return False
        current.pending.discard(part)
        if error is not None and current.error is None:
            if self._fence is not None:  # before any waiter may overwrite the slot
                self._fence.advance(key)
            current.error = error
            current.failed_part = part
        return True

    def _interrupt_needed(self) -> GatePump | None:
        """(lock held) The pump to interrupt: one run by a thread other than this one."""
        pumping = self._pumping_thread
        if pumping is not None and self._pump is not None and pumping != threading.get_ident():
            return self._pump
        return None

    def wait(self, key: SlotKey, timeout: float | None) -> None:
        """Block until the slot's current round ends (``timeout`` seconds; None = forever).

        Raises SlotFailedError if a part failed, SlotTimeoutError (naming the slot and the
        parts still missing) if the deadline passes first.
        """
        key = _check_key(key)
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be None or a number >= 0 seconds, got {timeout!r}")
        current = self._rounds.get(key)
        if current is None or (not current.pending and current.error is None):
            # Without the lock: a round only ever moves towards over, so one seen over (and
            # not failed) is over. The per-layer path of a forward waits like this mostly.
            return
        if timeout is not None and math.isinf(timeout):
            timeout = None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            current = self._rounds.get(key)
            if current is None:
                return
            while not current.over:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise SlotTimeoutError(
                        f"slot {slot_name(key)} was not released within {timeout:g} s; "
                        f"still waiting for {_names(current.pending)}")
                pump = self._pump
                if pump is None or self._pumping_thread is not None:
                    self._changed.wait(remaining)
                else:
                    slice_s = PUMP_SLICE_S if remaining is None else min(remaining, PUMP_SLICE_S)
                    started = time.monotonic()
                    if not self._pump_once(pump, slice_s) and not current.over:
                        # Back early with nothing handled (a closed or busy pump): sleep out
                        # the slice on the condition rather than call it again at once.
                        rest = slice_s - (time.monotonic() - started)
                        if rest > 0:
                            self._changed.wait(rest)
            if current.error is not None:
                raise _failure(key, current.failed_part, current.error)

    def _pump_once(self, pump: GatePump, timeout_s: float) -> bool:
        """Drive the pump for one slice with the lock released (the caller holds it once);
        whether it handled anything."""
        self._pumping_thread = threading.get_ident()
        self._changed.release()
        try:
            return pump.pump(timeout_s)
        finally:
            self._changed.acquire()
            self._pumping_thread = None
            self._changed.notify_all()  # another waiter may take over the pump

    def is_quiet(self, key: SlotKey) -> bool:
        """True when the slot is open (its round ended well, or it was never closed) and no
        part is announced on any slot.

        Then a round the caller would close on ``key`` with parts of its own only, and end
        itself before anything else can use the slot, changes nothing a waiter can see; the
        caller may skip it. Read without the lock: an open round stays open until the next
        ``close``, and the caller is the only thread that closes the slot or announces on it
        (else the answer may be stale by the time it is used)."""
        if self._announced:
            return False
        current = self._rounds.get(_check_key(key))
        return current is None or (not current.pending and current.error is None)

    def is_open(self, key: SlotKey) -> bool:
        """True when the slot may be overwritten: never closed, or every part reported ok."""
        key = _check_key(key)
        with self._changed:
            current = self._rounds.get(key)
            return current is None or (not current.pending and current.error is None)

    def pending(self, key: SlotKey) -> frozenset[str]:
        """Parts of the current round that have not reported yet."""
        key = _check_key(key)
        with self._changed:
            current = self._rounds.get(key)
            return frozenset() if current is None else frozenset(current.pending)

    def error(self, key: SlotKey) -> str | None:
        """The first failure of the current round, described, or None."""
        key = _check_key(key)
        with self._changed:
            current = self._rounds.get(key)
            if current is None or current.error is None:
                return None
            return f"{current.failed_part}: {_describe_error(current.error)}"


def _failure(key: SlotKey, part: str | None, cause: str | BaseException) -> SlotFailedError:
    """A fresh exception per waiter (one instance raised in several threads would share a
    traceback), chained to the reported exception when there is one."""
    error = SlotFailedError(
        f"slot {slot_name(key)}: part {part!r} failed: {_describe_error(cause)}")
    if isinstance(cause, BaseException):
        error.__cause__ = cause
    return error


def _names(parts: Iterable[str]) -> str:
    return ", ".join(sorted(parts)) or "(nothing)"


@attrs.define
class _Request:
    pending: set[str]
    error: str | None = None


class RequestCompletionTracker:
    """Thread-safe: which requests have finished all their transfer parts, and which failed.

    A request is finished once every expected part has reported, done or failed; it is
    reported as failed (with its first error) if any part failed. Waiting for every part even
    after a failure keeps a request's blocks alive while some reader may still use them; a
    part that will never report (lost acknowledgement) must be reported failed by the caller's
    deadline. Reports for unknown or already reported parts are ignored (returning False), for
    the same reasons as in SlotGates.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._finished = threading.Condition(self._lock)
        self._requests: dict[str, _Request] = {}

    def wait_finished(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until some request has finished (and is not popped yet);
        whether one has. Lets a consumer with nothing else to do sleep instead of polling."""
        with self._finished:
            return self._finished.wait_for(
                lambda: any(not r.pending for r in self._requests.values()), timeout_s)

    def expect(self, request_id: str, parts: Iterable[str]) -> None:
        """Start tracking ``request_id``; with no parts it is finished at once."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"a request id must be a non-empty string, got {request_id!r}")
        expected = {_check_part(p) for p in parts}
        with self._lock:
            if request_id in self._requests:
                raise GateStateError(
                    f"request {request_id!r} is already tracked (its parts: "
                    f"{_names(self._requests[request_id].pending)} still pending, or it has "
                    f"finished and was not popped yet)")
            self._requests[request_id] = _Request(pending=expected)

    def mark_done(self, request_id: str, part: str) -> bool:
        return self._report(request_id, part, None)

    def mark_failed(self, request_id: str, part: str, error: str | BaseException) -> bool:
        return self._report(request_id, part, _describe_error(error))

    def _report(self, request_id: str, part: str, error: str | None) -> bool:
        part = _check_part(part)
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or part not in request.pending:
                return False
            request.pending.discard(part)
            if error is not None and request.error is None:
                request.error = f"{part}: {error}"
            if not request.pending:
                self._finished.notify_all()
            return True

    def pending(self, request_id: str) -> frozenset[str]:
        """Parts of ``request_id`` that have not reported (empty if unknown or finished)."""
        with self._lock:
            request = self._requests.get(request_id)
            return frozenset() if request is None else frozenset(request.pending)

    def pop_finished(self) -> tuple[set[str], dict[str, str]]:
        """Requests finished since the last call: (ids that succeeded, failed id -> error)."""
        succeeded: set[str] = set()
        failed: dict[str, str] = {}
        with self._lock:
            for request_id, request in list(self._requests.items()):
                if request.pending:
                    continue
                del self._requests[request_id]
                if request.error is None:
                    succeeded.add(request_id)
                else:
                    failed[request_id] = request.error
        return succeeded, failed
