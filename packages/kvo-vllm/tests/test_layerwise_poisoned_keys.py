"""PoisonedKeys: a removal asked for before a save of the same key never lands after it.

A dict stands in for the store (a unit test of kvo's own ordering logic; the real store and
vLLM run in tests/e2e/test_layerwise.py). Its removal can be held mid-call, as Mooncake's is
while it waits out a read lease.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvo_vllm.layerwise.poisoned_keys import PoisonedKeys, RemovalStillRunningError

WAIT_S = 30.0
"""Bound on every wait here, so a broken ordering fails the test instead of hanging it."""


class HeldStore:
    """Keys to values; ``remove`` announces itself and waits for ``release`` first."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.removing = threading.Event()
        self.release = threading.Event()
        self.removed: list[list[str]] = []

    def remove(self, keys: list[str]) -> None:
        self.removing.set()
        assert self.release.wait(WAIT_S)
        for key in keys:
            self.values.pop(key, None)
        self.removed.append(list(keys))

    def save(self, poisoned: PoisonedKeys, keys: list[str], value: str,
             timeout_s: float = WAIT_S) -> None:
        """What the worker's saver does around a put."""
        ticket = poisoned.begin_save(keys, timeout_s)
        try:
            for key in keys:
                self.values[key] = value
        finally:
            poisoned.end_save(ticket, stored=True)


@pytest.fixture
def rig():
    store = HeldStore()
    poisoned = PoisonedKeys(store.remove)
    yield store, poisoned
    store.release.set()
    poisoned.close()


def test_a_save_waits_for_a_running_removal_of_its_key(rig) -> None:
    store, poisoned = rig
    store.values["k"] = "stale"
    poisoned.poison(["k"])
    assert store.removing.wait(WAIT_S)  # the removal runs, held (a read lease)
    saver = threading.Thread(target=store.save, args=(poisoned, ["k"], "fresh"))
    saver.start()
    store.release.set()
    saver.join(WAIT_S)
    poisoned.settle()
    # Had the save not waited, the held removal would have deleted the fresh value.
    assert store.values == {"k": "fresh"}
    assert poisoned.poisoned_among(["k"]) == set()


def test_a_save_cancels_a_removal_that_has_not_started(rig) -> None:
    store, poisoned = rig
    poisoned.remove_later(["other"])
    assert store.removing.wait(WAIT_S)  # the removal thread is busy with "other"
    store.values["k"] = "stale"
    poisoned.poison(["k"])  # queued behind it
    assert poisoned.poisoned_among(["k", "x"]) == {"k"}
    store.save(poisoned, ["k"], "fresh", timeout_s=WAIT_S)  # must not wait for "other"
    store.release.set()
    poisoned.settle()
    assert store.values == {"k": "fresh"}
    assert store.removed == [["other"]]
    assert poisoned.cancelled_removals == 1


def test_a_key_poisoned_during_its_save_stays_poisoned_and_is_removed_after_it(rig) -> None:
    store, poisoned = rig
    store.release.set()
    ticket = poisoned.begin_save(["k"], WAIT_S)
    store.values["k"] = "written"
    poisoned.poison(["k"])  # e.g. the slot was given up on while the put ran
    poisoned.settle()
    assert store.values == {"k": "written"}  # no removal while the save runs
    poisoned.end_save(ticket, stored=True)
    poisoned.settle()
    assert poisoned.poisoned_among(["k"]) == {"k"}
    assert store.values == {}


def test_a_failed_save_leaves_its_keys_poisoned(rig) -> None:
    store, poisoned = rig
    store.release.set()
    poisoned.poison(["k"])
    poisoned.settle()
    ticket = poisoned.begin_save(["k"], WAIT_S)
    poisoned.end_save(ticket, stored=False)
    assert poisoned.poisoned_among(["k"]) == {"k"}


def test_a_save_gives_up_on_a_removal_that_runs_too_long(rig) -> None:
    store, poisoned = rig
    poisoned.poison(["k", "j"])
    assert store.removing.wait(WAIT_S)
    with pytest.raises(RemovalStillRunningError, match=r"removal of \['j', 'k'\].*0.05 s"):
        poisoned.begin_save(["k", "j", "free"], timeout_s=0.05)
    store.release.set()
    poisoned.settle()
    # Nothing was taken by the refused save: a later one runs normally.
    store.save(poisoned, ["k", "free"], "fresh")
    assert store.values == {"k": "fresh", "free": "fresh"}


class LeasedStore(HeldStore):
    """Its removal fails ``refusals`` more times (like Mooncake's giving up on a read lease)."""

    def __init__(self, refusals: int) -> None:
        super().__init__()
        self.release.set()
        self.refusals = refusals
        self.tries = 0

    def remove(self, keys: list[str]) -> None:
        self.tries += 1
        if self.refusals > 0:
            self.refusals -= 1
            raise RuntimeError(f"keys {keys} still hold a read lease")
        super().remove(keys)


def wait_until(check, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_failed_removal_is_retried_until_it_succeeds_and_counted() -> None:
    store = LeasedStore(refusals=2)
    counted: list[dict] = []
    poisoned = PoisonedKeys(store.remove, retry_delays_s=(0.05, 0.05, 0.05),
                            count=lambda **amounts: counted.append(amounts))
    try:
        store.values["k"] = "torn?"
        poisoned.poison(["k"])
        wait_until(lambda: "k" not in store.values)
        assert store.tries == 3 and poisoned.removal_retries == 2
        assert counted == [{"removal_retries": 1}] * 2
        assert poisoned.retries_waiting() == set() and poisoned.removals_given_up == 0
        assert poisoned.poisoned_among(["k"]) == {"k"}  # removed, still never loaded
    finally:
        poisoned.close()


def test_a_save_cancels_the_retry_of_a_failed_removal() -> None:
    """Else the retry would delete the fresh value the save stored."""
    store = LeasedStore(refusals=1)
    poisoned = PoisonedKeys(store.remove, retry_delays_s=(0.3,))
    try:
        poisoned.poison(["k"])
        wait_until(lambda: poisoned.retries_waiting() == {"k"})
        store.save(poisoned, ["k"], "fresh")
        assert poisoned.retries_waiting() == set()
        time.sleep(0.5)  # past the retry's time
        poisoned.settle()
        assert store.values == {"k": "fresh"} and store.tries == 1
        assert poisoned.removal_retries == 0 and poisoned.cancelled_removals == 1
        assert poisoned.poisoned_among(["k"]) == set()
    finally:
        poisoned.close()


def test_a_removal_that_fails_every_retry_is_given_up_logged_and_counted(caplog) -> None:
    store = LeasedStore(refusals=100)
    counted: list[dict] = []
    poisoned = PoisonedKeys(store.remove, retry_delays_s=(0.02, 0.02),
                            count=lambda **amounts: counted.append(amounts))
    try:
        store.values["k"] = "torn?"
        with caplog.at_level("INFO", logger="kvo_vllm.layerwise.poisoned_keys"):
            poisoned.poison(["k"])
            wait_until(lambda: poisoned.removals_given_up == 1)
        assert store.tries == 3 and store.values == {"k": "torn?"}
        assert counted == [{"removal_retries": 1}] * 2 + [{"removals_given_up": 1}]
        assert poisoned.poisoned_among(["k"]) == {"k"}
        assert "retry 1 of 2" in caplog.text and "failed 3 times" in caplog.text
        assert "they stay in the store" in caplog.text
    finally:
        poisoned.close()
