"""PoisonedKeys: a removal asked for before a save of the same key never lands after it.

A dict stands in for the store (a unit test of kvo's own ordering logic; the real store and
vLLM run in tests/e2e/test_layerwise.py). Its removal can be held mid-call, as Mooncake's is
while it waits out a read lease.
"""

from __future__ import annotations

import threading

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
