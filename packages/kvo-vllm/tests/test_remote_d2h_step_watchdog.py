"""The decode's step watchdog: a step that stays away while pulls wait is logged once, with the
stack of the thread that last stepped; its return is logged with the time away."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvo_vllm.remote_d2h.step_watchdog import StepWatchdog

LOGGER = "kvo_vllm.remote_d2h.step_watchdog"


def _blocked_inside_a_step(release: threading.Event, dog: StepWatchdog) -> None:
    dog.stepped()
    release.wait(10)  # the "step" that does not come back until released
    dog.stepped()


def test_a_step_away_while_pulls_wait_is_logged_once_with_its_stack(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    release = threading.Event()
    dog = StepWatchdog(name="decode test", threshold_s=0.2, waiting=lambda: 3, poll_s=0.05)
    step = threading.Thread(target=_blocked_inside_a_step, args=(release, dog),
                            name="vllm-step")
    dog.start()
    try:
        step.start()
        deadline = time.monotonic() + 5
        while dog.stalls == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # more checks: still one report per stall
        release.set()
        step.join(5)
    finally:
        dog.close()
    stalls = [r.getMessage() for r in caplog.records if "has not called" in r.getMessage()]
    assert dog.stalls == 1 and len(stalls) == 1, stalls
    assert "3 pull(s) or READY(s) wait" in stalls[0]
    assert "'vllm-step' (last stepped)" in stalls[0]
    assert "_blocked_inside_a_step" in stalls[0]  # where the step thread is blocked
    back = [r.getMessage() for r in caplog.records if "came back after" in r.getMessage()]
    assert len(back) == 1, back


def test_nothing_is_logged_without_waiting_pulls_or_within_the_threshold(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    waiting = [0]
    dog = StepWatchdog(name="decode test", threshold_s=5.0, waiting=lambda: waiting[0])
    dog.stepped()
    start = time.monotonic()
    assert not dog.check(start + 10)  # away long, but nothing waits
    waiting[0] = 1
    assert not dog.check(start + 1)   # something waits, not away long
    assert dog.check(start + 10)
    assert not dog.check(start + 20)  # the same stall is reported once
    assert dog.stalls == 1


def test_a_non_positive_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="threshold_s must be > 0"):
        StepWatchdog(name="x", threshold_s=0, waiting=lambda: 0)


FROZEN_PROCESS = """
import re, time
from kvo_vllm.remote_d2h.step_watchdog import StepWatchdog

def _hold_the_gil():
    # catastrophic backtracking: the regex engine holds the GIL throughout
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        re.match(r"(a+)+$", "a" * 22 + "b")

# poll_s: the Python watchdog thread would not get to check before the native dump anyway
dog = StepWatchdog(name="frozen", threshold_s=0.3, waiting=lambda: 1, poll_s=60).start()
dog.stepped()
_hold_the_gil()
"""


def test_a_process_frozen_with_the_gil_held_still_gets_its_stacks_written() -> None:
    """The Python watchdog thread cannot run while native code holds the GIL; faulthandler's
    native thread, armed by the step while pulls wait, writes the stacks anyway."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FROZEN_PROCESS], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Timeout (0:00:01" in done.stderr, done.stderr
    assert "_hold_the_gil" in done.stderr, done.stderr
