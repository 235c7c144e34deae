"""Names a decode step that stays away while pulls wait: how long, and where the threads are.

A P/D decode's reads run on the receiver's thread, but vLLM learns of a finished pull, and
registers a new request's destination, only when its step calls the connector
(``start_load_kv``, ``get_finished``). A decode that stops stepping while pulls wait (a worker
blocked inside a step, or an engine core that sent no step) looks, from the prefill, like a
decode that missed its layer deadline. The watchdog says it from the decode's side, once per
stall and before the prefill's deadline gives the requests up: how long the step has been
away, how many pulls wait, and the stacks of the thread that last stepped and of kvo's
threads; then, when the step comes back, how long it was away.

A thread that holds the GIL inside native code freezes every Python thread of the process, this
watchdog's too. For that case the watchdog also keeps Python's ``faulthandler`` armed while
pulls wait (re-armed at most once a second, from the step): if the process stays frozen for
twice the threshold, faulthandler's native thread writes every thread's stack to stderr.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

logger = logging.getLogger(__name__)

REARM_S = 1.0
"""How often, at most, a step re-arms the native dump (re-arming starts a new native thread)."""
STACK_FRAMES = 14
"""Innermost frames shown per thread (enough to reach vLLM's worker loop from a kvo call)."""


class StepWatchdog:
    """Watches the gap between connector calls of one decode worker (module docstring)."""

    def __init__(self, *, name: str, threshold_s: float, waiting: Callable[[], int],
                 poll_s: float | None = None) -> None:
        if not threshold_s > 0:
            raise ValueError(f"threshold_s must be > 0 seconds, got {threshold_s!r}")
        self.name = name
        self.threshold_s = threshold_s
        self._waiting = waiting
        self._poll_s = min(1.0, threshold_s / 4) if poll_s is None else poll_s
        self._last_step = time.monotonic()
        self._step_thread: int | None = None
        self._stalled_since: float | None = None
        self._armed_at: float | None = None
        self.stalls = 0
        """Stalls logged so far (for the stats file)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvo-step-watch-{name}",
                                        daemon=True)

    def start(self) -> StepWatchdog:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._disarm()
        if self._thread.is_alive():
            self._thread.join(timeout=self._poll_s + 1)

    def stepped(self) -> None:
        """vLLM's step called the connector (its thread)."""
        now = time.monotonic()
        stalled_since, self._stalled_since = self._stalled_since, None
        self._last_step = now
        self._step_thread = threading.get_ident()
        if not self._waiting():
            self._disarm()
        elif self._armed_at is None or now - self._armed_at >= REARM_S:
            faulthandler.dump_traceback_later(2 * self.threshold_s + REARM_S, exit=False)
            self._armed_at = now
        if stalled_since is not None:
            logger.warning("kvo remote_d2h %s: vLLM's step came back after %.1f s away "
                           "(%d pull(s) or READY(s) waiting now)", self.name, now - stalled_since,
                           self._waiting())

    def check(self, now: float | None = None) -> bool:
        """Log a stall if the step has been away too long while pulls wait; whether it did."""
        now = time.monotonic() if now is None else now
        away = now - self._last_step
        if self._stalled_since is not None or away < self.threshold_s:
            return False
        waiting = self._waiting()
        if not waiting:
            return False
        self._stalled_since = self._last_step
        self.stalls += 1
        self._disarm()  # this thread runs: the stacks below say it all
        logger.warning("kvo remote_d2h %s: vLLM's step has not called the connector for %.1f s "
                       "while %d pull(s) or READY(s) wait (READYs are read, but no new "
                       "destination is registered and no finished pull is reported until it "
                       "does); the threads now:\n%s", self.name, away, waiting, self._stacks())
        return True

    def _disarm(self) -> None:
        if self._armed_at is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at = None

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.check()
            except Exception:  # a watchdog bug must never take the worker down
                logger.exception("kvo remote_d2h %s: step watchdog check failed", self.name)

    def _stacks(self) -> str:
        names = {t.ident: t.name for t in threading.enumerate()}
        shown = []
        for ident, frame in sys._current_frames().items():
            name = names.get(ident, "?")
            if ident != self._step_thread and not name.startswith("kvo-"):
                continue
            if ident == self._thread.ident:
                continue
            role = "last stepped" if ident == self._step_thread else "kvo"
            lines = traceback.format_stack(frame)[-STACK_FRAMES:]
            shown.append(f"--- thread {name!r} ({role}):\n{''.join(lines).rstrip()}")
        return "\n".join(shown)
