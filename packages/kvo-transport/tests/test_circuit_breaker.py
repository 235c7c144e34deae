"""The circuit breaker's state machine (pure logic; the real dead-master case is in
test_store_outage.py)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvo_transport.circuit_breaker import BreakerState, CircuitBreaker, HealthWatcher


class Down(Exception):
    pass


def breaker(**kwargs: object) -> CircuitBreaker:
    return CircuitBreaker(name="test store", open_error=Down, **kwargs)  # type: ignore[arg-type]


def test_a_failure_opens_and_calls_then_fail_fast_naming_the_cause() -> None:
    b = breaker(has_probe=True)
    b.before_call()
    b.on_failure("RPC_FAIL")
    assert b.state is BreakerState.OPEN and b.times_opened == 1
    for _ in range(3):
        with pytest.raises(Down, match=r"test store is unavailable .*RPC_FAIL.*failing fast"):
            b.before_call()
    assert b.fast_failures == 3


def test_a_good_probe_half_opens_one_trial_closes_or_reopens() -> None:
    b = breaker(has_probe=True)
    b.on_failure("down")
    b.on_probe(None)
    assert b.state is BreakerState.HALF_OPEN
    b.before_call()  # the trial
    with pytest.raises(Down):
        b.before_call()  # one trial at a time
    b.on_failure("still down")
    assert b.state is BreakerState.OPEN and b.times_opened == 2
    b.on_probe(None)
    b.before_call()
    b.on_success()
    assert b.state is BreakerState.CLOSED
    b.before_call()


def test_a_failed_probe_opens_a_closed_breaker() -> None:
    b = breaker(has_probe=True)
    b.on_probe("connection refused")
    assert b.state is BreakerState.OPEN and b.last_error == "connection refused"
    b.on_probe("connection refused")
    assert b.times_opened == 1  # logged once, not per probe


def test_without_a_probe_a_trial_goes_through_after_the_retry_interval() -> None:
    b = breaker(retry_after_s=0.05)
    b.on_failure("down")
    with pytest.raises(Down):
        b.before_call()
    time.sleep(0.06)
    b.before_call()
    assert b.state is BreakerState.HALF_OPEN
    b.on_neutral()  # a refused argument says nothing: the next call may try again
    b.before_call()
    b.on_success()
    assert b.state is BreakerState.CLOSED


def test_transitions_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    b = breaker(has_probe=True)
    with caplog.at_level(logging.WARNING, logger="kvo.transport.breaker"):
        b.on_failure("down")
        b.on_probe(None)
        b.before_call()
        b.on_success()
    text = caplog.text
    assert "circuit OPEN (down)" in text and "HALF-OPEN" in text and "CLOSED again" in text


def test_the_watcher_reports_its_probe_until_stopped() -> None:
    b = breaker(has_probe=True)
    healthy = threading.Event()
    watcher = HealthWatcher(b, lambda: None if healthy.is_set() else "refused", 0.01)
    try:
        deadline = time.monotonic() + 5
        while b.state is not BreakerState.OPEN and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.state is BreakerState.OPEN
        healthy.set()
        while b.state is not BreakerState.HALF_OPEN and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.state is BreakerState.HALF_OPEN
    finally:
        watcher.stop()
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        HealthWatcher(b, lambda: None, 0)
