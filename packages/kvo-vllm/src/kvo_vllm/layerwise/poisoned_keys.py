"""Poisoned store keys, and background removals that never delete a newer save.

A key is poisoned when the value under it may be wrong (a dropped or failed save): this worker
stops loading it at once, and the key is removed from the store in the background so that no
prefix lookup (``exists``) finds it. A removal can take a while (Mooncake's
waits out a read lease, seconds), and a later step may save the same key again meanwhile: the
block is computed afresh, e.g. by the next request with the same prefix. Were the removal to
land after that save, it would delete the new, right value while the key no longer counts as
poisoned; the next step's load of it fails and vLLM fails (or recomputes) a request that did
nothing wrong (issue 13 §6: a request ending after 4 of 6 tokens, no cause of its own).

So store mutations of one key are ordered as they were asked for: a save cancels the key's
removal if it has not started, and waits for it if it is running; a removal asked for while a
save of the key runs starts after that save. A save un-poisons only keys nobody poisoned while
it ran.

A removal that fails (Mooncake's gives up while another engine holds a read lease) is tried
again later, a bounded number of times (``RETRY_DELAYS_S``; each retry and each removal given
up on is logged and counted), unless a save of the key comes first: a save cancels a waiting
retry as it cancels a removal not started.

A removal is not what keeps other engines sharing the store from a poisoned key's value:
Mooncake's may give up on a read lease, and this engine may die first. No save publishes
bytes that may be wrong in the first place (``savers``).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import attrs

from kvo_core.errors import KvoError

logger = logging.getLogger(__name__)

RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
"""Waits before each retry of a failed removal (1 min in all: several of Mooncake's 10 s read
leases, which every read renews); then the removal is given up on."""


class RemovalStillRunningError(KvoError, RuntimeError):
    """A save waited too long for a running removal of one of its keys."""


@attrs.frozen(eq=False)
class SaveTicket:
    """A save under way: its keys, and the poisoning of those poisoned when it began (to tell
    whether they were poisoned again meanwhile)."""

    keys: frozenset[str]
    serials: dict[str, int]


class PoisonedKeys:
    """One worker's poisoned keys and removals, ordered against its saves (module docstring)."""

    def __init__(self, remove: Callable[[list[str]], None], *,
                 thread_name: str = "kvo-lw-clean",
                 retry_delays_s: Sequence[float] = RETRY_DELAYS_S,
                 count: Callable[..., None] | None = None) -> None:
        """``count(removal_retries=n)`` / ``count(removals_given_up=n)``: where retries and
        removals given up on are counted (``StatsRecorder.add``), besides this object's own
        counters."""
        self._remove = remove
        self._retry_delays_s = tuple(retry_delays_s)
        self._count = count
        self._failures: dict[str, int] = {}
        """Key -> removals of it that failed in a row (while it waits for a retry)."""
        self._waiting: dict[str, None] = {}
        """Keys whose removal failed, waiting for their retry (a dict as an ordered set)."""
        self._timers: set[threading.Timer] = set()
        self._closed = False
        self.removal_retries = 0
        """Retries of failed removals started."""
        self.removals_given_up = 0
        """Keys left in the store after every retry failed."""
        self._cond = threading.Condition()
        self._poisoned: dict[str, int] = {}
        """Poisoned key -> serial of its latest poisoning."""
        self._serials = itertools.count(1)
        self._pending: dict[str, None] = {}
        """Keys to remove, in the order asked (a dict as an ordered set)."""
        self._running: set[str] = set()
        self._saves: list[SaveTicket] = []
        """Saves under way (one at a time from the worker's saver thread)."""
        self.cancelled_removals = 0
        """Removals a later save made moot before they started."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)

    # -- asked by the worker ------------------------------------------------------------

    def poison(self, keys: Iterable[str]) -> None:
        """Never load ``keys`` again until a save of them succeeds; remove them meanwhile."""
        keys = list(keys)
        with self._cond:
            for key in keys:
                self._poisoned[key] = next(self._serials)
        self.remove_later(keys)

    def remove_later(self, keys: Iterable[str]) -> None:
        """Remove ``keys`` from the store in the background (after any save of them now
        under way)."""
        with self._cond:
            added = False
            for key in keys:
                self._pending[key] = None
                added = True
        if added:
            self._executor.submit(self._drain)

    def poisoned_among(self, keys: Iterable[str]) -> set[str]:
        with self._cond:
            if not self._poisoned:
                return set()
            return {key for key in keys if key in self._poisoned}

    def begin_save(self, keys: Sequence[str], timeout_s: float) -> SaveTicket:
        """Before putting ``keys``: cancel their removals not yet started, wait for running
        ones (at most ``timeout_s``, else ``RemovalStillRunningError``; nothing taken)."""
        wanted = frozenset(keys)
        with self._cond:
            if self._pending:
                for key in wanted.intersection(self._pending):
                    del self._pending[key]
                    self._failures.pop(key, None)
                    self.cancelled_removals += 1
            if self._waiting:
                for key in wanted.intersection(self._waiting):
                    del self._waiting[key]
                    self._failures.pop(key, None)
                    self.cancelled_removals += 1
            if self._running and not self._cond.wait_for(
                    lambda: self._running.isdisjoint(wanted), timeout_s):
                raise RemovalStillRunningError(
                    f"kvo layerwise: a removal of {sorted(wanted & self._running)[:2]} (of "
                    f"{len(wanted & self._running)} keys) still runs after {timeout_s:g} s; the "
                    f"save of these keys is given up (they stay poisoned)")
            serials = ({key: self._poisoned[key] for key in wanted.intersection(self._poisoned)}
                       if self._poisoned else {})
            ticket = SaveTicket(keys=wanted, serials=serials)
            self._saves.append(ticket)
        return ticket

    def end_save(self, ticket: SaveTicket, *, stored: bool) -> None:
        """After the put: ``stored`` un-poisons keys not poisoned again while it ran."""
        with self._cond:
            self._saves.remove(ticket)
            if stored:
                for key, serial in ticket.serials.items():
                    if self._poisoned.get(key) == serial:
                        del self._poisoned[key]
            waiting = bool(self._pending) and not ticket.keys.isdisjoint(self._pending)
        if waiting:
            self._executor.submit(self._drain)

    def settle(self, timeout_s: float | None = None) -> bool:
        """Wait until every removal asked for so far has run (except those waiting for a save
        under way); False if that took longer than ``timeout_s``."""
        try:
            self._executor.submit(lambda: None).result(timeout_s)
        except TimeoutError:
            return False
        return True

    def retries_waiting(self) -> set[str]:
        """Keys whose removal failed and waits for a retry."""
        with self._cond:
            return set(self._waiting)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            timers, self._timers = self._timers, set()
        for timer in timers:
            timer.cancel()
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -- the removal thread -------------------------------------------------------------

    def _drain(self) -> None:
        with self._cond:
            saving = frozenset().union(*(ticket.keys for ticket in self._saves))
            batch = [key for key in self._pending if key not in saving]
            for key in batch:
                del self._pending[key]
            self._running.update(batch)
        if not batch:
            return
        failed: Exception | None = None
        try:
            self._remove(batch)
        except Exception as error:  # tried again later (poisoned keys are never loaded)
            failed = error
        finally:
            with self._cond:
                self._running.difference_update(batch)
                if failed is None:
                    for key in batch:
                        self._failures.pop(key, None)
                self._cond.notify_all()
        if failed is not None:
            self._retry_later(batch, failed)

    def _retry_later(self, batch: list[str], error: Exception) -> None:
        """Wait for the retry of ``batch``'s removal, or give it up after the last one."""
        timer: threading.Timer | None = None
        with self._cond:
            if self._closed:
                return
            # A key asked for again meanwhile is pending anew: that removal comes anyway.
            keys = [key for key in batch if key not in self._pending]
            tries = 1 + max((self._failures.get(key, 0) for key in keys), default=0)
            if keys and tries > len(self._retry_delays_s):
                for key in keys:
                    self._failures.pop(key, None)
                self.removals_given_up += len(keys)
            elif keys:
                for key in keys:
                    self._failures[key] = tries
                    self._waiting[key] = None
                timer = threading.Timer(self._retry_delays_s[tries - 1], self._retry_due,
                                        args=(keys,))
                timer.daemon = True
                timer.name = "kvo-lw-clean-retry"
                self._timers.add(timer)
        if not keys:
            return
        if timer is None:
            logger.warning("kvo layerwise: removing %d keys (e.g. %s) failed %d times, the last "
                           "with %s; they stay in the store (poisoned for this engine until "
                           "saved again)", len(keys), keys[:2], tries, error)
            if self._count is not None:
                self._count(removals_given_up=len(keys))
            return
        logger.info("kvo layerwise: removing %d keys (e.g. %s) failed (%s); retry %d of %d in "
                    "%g s", len(keys), keys[:2], error, tries, len(self._retry_delays_s),
                    timer.interval)
        timer.start()

    def _retry_due(self, keys: list[str]) -> None:
        """A retry's wait is over: its keys no save took meanwhile are removed again."""
        with self._cond:
            self._timers = {timer for timer in self._timers if timer.is_alive()
                            and timer is not threading.current_thread()}
            if self._closed:
                return
            due = [key for key in keys if key in self._waiting]
            for key in due:
                del self._waiting[key]
                self._pending[key] = None
            self.removal_retries += bool(due)
        if due:
            if self._count is not None:
                self._count(removal_retries=1)
            try:
                self._executor.submit(self._drain)
            except RuntimeError:  # closed meanwhile
                pass
