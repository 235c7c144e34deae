"""A circuit breaker: once a service is known to be down, calls fail at once instead of waiting.

Why: with its master gone, a Mooncake Store client call can block for seconds (an RPC timeout)
and the layerwise connector makes store calls from vLLM's forward and scheduler; a dead store
must cost a failed load or save (the connector's poison / recompute rules), not seconds per
layer. States:

- CLOSED: calls go through. A call that fails with an outage (the backend says so, or it failed
  slower than ``slow_call_s``), or a failed health probe, opens the breaker.
- OPEN: calls fail at once (``open_error``). A health probe that succeeds (or, without a probe,
  ``retry_after_s`` elapsed) half-opens it.
- HALF_OPEN: one trial call goes through (others still fail fast); success closes the breaker,
  failure opens it again.

Every transition is logged once. The health probe runs in a daemon thread (``HealthWatcher``),
never in a caller's path.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

import attrs

log = logging.getLogger("kvo.transport.breaker")

Probe = Callable[[], str | None]
"""Checks the service once; None when healthy, else why not. Must return within its timeout."""


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


@attrs.define
class CircuitBreaker:
    """Thread-safe breaker state for one service (see the module docstring)."""

    name: str
    open_error: Callable[[str], Exception]
    """Builds the error a fast-failed call raises, from a message naming the cause."""
    slow_call_s: float = 1.0
    retry_after_s: float = 1.0
    """Without a health probe: how long OPEN lasts before a trial call is let through."""
    has_probe: bool = False
    state: BreakerState = BreakerState.CLOSED
    opened_at: float = 0.0
    last_error: str = ""
    fast_failures: int = 0
    """Calls refused without reaching the service, over the breaker's life."""
    times_opened: int = 0
    _trial_running: bool = False
    _lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)

    def before_call(self) -> None:
        """Raise ``open_error`` unless a call may go to the service now."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return
            if (self.state is BreakerState.OPEN and not self.has_probe
                    and time.monotonic() - self.opened_at >= self.retry_after_s):
                self._move(BreakerState.HALF_OPEN, "retry interval elapsed")
            if self.state is BreakerState.HALF_OPEN and not self._trial_running:
                self._trial_running = True
                return
            self.fast_failures += 1
            down_s = time.monotonic() - self.opened_at
            message = (f"{self.name} is unavailable (circuit {self.state.value} for "
                       f"{down_s:.1f} s; last error: {self.last_error}); failing fast")
        raise self.open_error(message)

    def on_success(self) -> None:
        with self._lock:
            self._trial_running = False
            if self.state is not BreakerState.CLOSED:
                self._move(BreakerState.CLOSED, "a call succeeded")

    def on_failure(self, error: str) -> None:
        """An outage seen by a call."""
        with self._lock:
            self._trial_running = False
            self.last_error = error
            if self.state is not BreakerState.OPEN:
                self._move(BreakerState.OPEN, error)

    def on_neutral(self) -> None:
        """A call ended without telling whether the service is up (e.g. refused arguments)."""
        with self._lock:
            self._trial_running = False

    def on_probe(self, problem: str | None) -> None:
        """A health probe's result: None when the service answered."""
        with self._lock:
            if problem is None and self.state is BreakerState.OPEN:
                self._move(BreakerState.HALF_OPEN, "the health probe succeeded")
            elif problem is not None and self.state is not BreakerState.OPEN:
                self.last_error = problem
                self._move(BreakerState.OPEN, f"health probe: {problem}")

    def _move(self, state: BreakerState, why: str) -> None:
        """Change state (lock held) and log it."""
        previous, self.state = self.state, state
        now = time.monotonic()
        if state is BreakerState.OPEN:
            self.opened_at = now
            self.times_opened += 1
            log.error("%s: circuit OPEN (%s): calls fail fast until it recovers", self.name, why)
        elif state is BreakerState.CLOSED:
            log.warning("%s: circuit CLOSED again after %.1f s (%s); %d calls failed fast "
                        "meanwhile", self.name, now - self.opened_at, why, self.fast_failures)
        else:
            log.warning("%s: circuit HALF-OPEN (%s, was %s): the next call is a trial",
                        self.name, why, previous.value)

    def timed(self, started: float) -> bool:
        """Whether a call that began at ``started`` (monotonic) was slow."""
        return time.monotonic() - started > self.slow_call_s


class HealthWatcher:
    """Runs ``probe`` every ``interval_s`` in a daemon thread and reports it to ``breaker``."""

    def __init__(self, breaker: CircuitBreaker, probe: Probe, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s!r}")
        self._breaker = breaker
        self._probe = probe
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvo-health-{breaker.name}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                problem = self._probe()
            except Exception as exc:  # a broken probe says nothing about the service
                log.exception("%s: health probe raised", self._breaker.name)
                problem = f"health probe raised {exc!r}"
            if not self._stop.is_set():
                self._breaker.on_probe(problem)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._interval_s + 5.0)
