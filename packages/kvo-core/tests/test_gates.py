"""Slot completion gates and the request completion tracker, exercised from real threads."""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable
from functools import partial

import pytest
import torch

from kvo_core.errors import KvoError, SlotFailedError, SlotTimeoutError
from kvo_core.gates import (
    MAX_ANNOUNCED,
    GateStateError,
    RequestCompletionTracker,
    SlotGates,
    slot_name,
)

KEY = (0x7F00_0000_1000, 0x7F00_0000_2000)
JOIN_S = 10.0  # generous bound so a broken gate fails the test instead of hanging CI


class Waiter(threading.Thread):
    """Calls gates.wait in a thread and records what happened."""

    def __init__(self, gates: SlotGates, key: tuple[int, ...], timeout: float | None = JOIN_S):
        super().__init__(daemon=True)
        self.gates, self.key, self.timeout = gates, key, timeout
        self.error: BaseException | None = None
        self.returned = False

    def run(self) -> None:
        try:
            self.gates.wait(self.key, self.timeout)
            self.returned = True
        except BaseException as error:
            self.error = error


def start_waiters(gates: SlotGates, key: tuple[int, ...], n: int) -> list[Waiter]:
    waiters = [Waiter(gates, key) for _ in range(n)]
    for w in waiters:
        w.start()
    return waiters


def join_all(threads: list[Waiter]) -> None:
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive(), "a waiter is still blocked"


def assert_still_blocked(threads: list[Waiter]) -> None:
    for t in threads:
        t.join(0.05)
        assert t.is_alive() and not t.returned and t.error is None


# -- SlotGates -----------------------------------------------------------------------------


def test_a_fresh_slot_is_open() -> None:
    gates = SlotGates()
    assert gates.is_open(KEY)
    assert gates.pending(KEY) == frozenset()
    gates.wait(KEY, 0)
    assert gates.error(KEY) is None


def test_a_slot_is_quiet_only_when_open_and_nothing_is_announced() -> None:
    gates = SlotGates()
    other = (0x7F00_0000_3000,)
    assert gates.is_quiet(KEY)  # never closed
    gates.close(KEY, ["save"])
    assert not gates.is_quiet(KEY)  # busy
    gates.mark_done(KEY, "save")
    assert gates.is_quiet(KEY)
    gates.announce(other, "remote:1")  # an announcement on any slot: not quiet
    assert not gates.is_quiet(KEY)
    gates.close(other, [], take_announced=True)
    gates.mark_done(other, "remote:1")
    assert gates.is_quiet(KEY) and gates.is_quiet(other)
    gates.close(KEY, ["save"])
    gates.mark_failed(KEY, "save", "store full")
    assert not gates.is_quiet(KEY)  # a failed round: the next user must close a fresh one


def test_close_each_closes_several_slots_at_once_or_none() -> None:
    gates = SlotGates()
    other, third = (0x7F00_0000_3000,), (0x7F00_0000_4000,)
    gates.announce(other, "remote:1")
    gates.close_each([(KEY, "save:a"), (other, "save:b")], take_announced=True)
    assert gates.pending(KEY) == {"save:a"}
    assert gates.pending(other) == {"save:b", "remote:1"}  # its own announcement only
    with pytest.raises(GateStateError, match="still busy"):
        gates.close_each([(third, "save:c"), (KEY, "save:d")])
    assert gates.is_open(third)  # nothing closed when one slot is busy
    with pytest.raises(TypeError, match="part name"):
        gates.close_each([(third, "")])


def test_waiters_are_released_when_every_part_is_done() -> None:
    gates = SlotGates()
    gates.close(KEY, ["save", "read:d0", "read:d1"])
    assert not gates.is_open(KEY)
    assert gates.pending(KEY) == {"save", "read:d0", "read:d1"}
    waiters = start_waiters(gates, KEY, 3)

    assert gates.mark_done(KEY, "save") is True
    assert gates.mark_done(KEY, "read:d1") is True
    assert_still_blocked(waiters)
    assert gates.pending(KEY) == {"read:d0"}

    assert gates.mark_done(KEY, "read:d0") is True
    join_all(waiters)
    assert all(w.returned and w.error is None for w in waiters)
    assert gates.is_open(KEY)


def test_first_error_reaches_every_waiter() -> None:
    gates = SlotGates()
    gates.close(KEY, ["save", "read:d0"])
    waiters = start_waiters(gates, KEY, 4)
    assert_still_blocked(waiters)
    cause = ConnectionError("peer vanished")
    gates.mark_failed(KEY, "read:d0", cause)
    gates.mark_failed(KEY, "save", "store full")  # a later error does not replace the first
    join_all(waiters)

    errors = [w.error for w in waiters]
    assert all(isinstance(e, SlotFailedError) for e in errors)
    assert len({id(e) for e in errors}) == len(errors), "each waiter gets its own exception"
    for e in errors:
        assert str(e) == ("slot (0x7f0000001000, 0x7f0000002000): part 'read:d0' failed: "
                          "ConnectionError: peer vanished")
        assert e is not None and e.__cause__ is cause
    assert not gates.is_open(KEY)
    assert gates.error(KEY) == "read:d0: ConnectionError: peer vanished"
    with pytest.raises(SlotFailedError, match="peer vanished"):
        gates.wait(KEY, 0)


def test_failure_wakes_waiters_even_with_parts_still_pending() -> None:
    gates = SlotGates()
    gates.close(KEY, ["save", "read:d0", "read:d1"])
    waiters = start_waiters(gates, KEY, 2)
    gates.mark_failed(KEY, "save", "disk error")
    join_all(waiters)
    assert all(isinstance(w.error, SlotFailedError) for w in waiters)
    assert gates.pending(KEY) == {"read:d0", "read:d1"}


def test_timeout_names_the_slot_and_the_missing_parts() -> None:
    gates = SlotGates()
    gates.close(KEY, ["save", "read:d1", "read:d0"])
    gates.mark_done(KEY, "save")
    with pytest.raises(SlotTimeoutError) as caught:
        gates.wait(KEY, 0.05)
    message = str(caught.value)
    assert message == ("slot (0x7f0000001000, 0x7f0000002000) was not released within 0.05 s; "
                       "still waiting for read:d0, read:d1")
    assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, KvoError)
    # a timeout is only an observation: the round keeps running and can still complete
    assert gates.pending(KEY) == {"read:d0", "read:d1"}
    gates.mark_done(KEY, "read:d0")
    gates.mark_done(KEY, "read:d1")
    gates.wait(KEY, 0)


def test_aliased_layers_share_one_gate() -> None:
    # Two logical layers whose caches alias the same storage compute the same key.
    storage = torch.zeros(4, 16, 8)
    main_kv_layer_1 = storage.view(4, 128)
    main_kv_layer_3 = storage.view(64, 8)
    other = torch.zeros(4, 16, 8)

    def key_of(*tensors: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in tensors)

    gates = SlotGates()
    gates.close(key_of(main_kv_layer_1), ["save"])
    assert key_of(main_kv_layer_3) == key_of(main_kv_layer_1)
    waiter = Waiter(gates, key_of(main_kv_layer_3))
    waiter.start()
    assert_still_blocked([waiter])
    assert gates.is_open(key_of(other))  # distinct storage, distinct gate
    gates.mark_done(key_of(main_kv_layer_1), "save")
    join_all([waiter])
    assert waiter.returned


def test_closing_a_busy_slot_is_an_error() -> None:
    gates = SlotGates()
    gates.close(KEY, ["save", "read:d0"])
    with pytest.raises(GateStateError,
                       match=r"slot \(0x7f0000001000, 0x7f0000002000\) is still busy "
                             r"\(waiting for read:d0, save\)"):
        gates.close(KEY, ["save"])
    assert gates.pending(KEY) == {"save", "read:d0"}


def test_close_after_open_or_failure_starts_a_new_round() -> None:
    gates = SlotGates()
    gates.close(KEY, ["save@r1"])
    gates.mark_done(KEY, "save@r1")
    gates.close(KEY, ["save@r2", "read@r2"])
    assert gates.pending(KEY) == {"save@r2", "read@r2"}

    gates.mark_failed(KEY, "save@r2", "boom")
    gates.close(KEY, ["save@r3"])  # the failure was delivered; read@r2 is abandoned
    assert gates.error(KEY) is None
    assert gates.mark_done(KEY, "read@r2") is False  # late report of the abandoned round
    assert gates.pending(KEY) == {"save@r3"}
    gates.mark_done(KEY, "save@r3")
    gates.wait(KEY, 0)


def test_closing_with_no_parts_leaves_the_slot_open() -> None:
    gates = SlotGates()
    gates.close(KEY, [])
    assert gates.is_open(KEY)
    gates.wait(KEY, 0)


def test_repeated_and_unknown_reports_are_ignored() -> None:
    gates = SlotGates()
    gates.close(KEY, ["save", "read:d0"])
    assert gates.mark_done(KEY, "save") is True
    assert gates.mark_done(KEY, "save") is False
    assert gates.mark_failed(KEY, "save", "late failure after done") is False
    assert gates.mark_done(KEY, "read:d9") is False
    assert gates.error(KEY) is None
    assert gates.pending(KEY) == {"read:d0"}


def test_reporting_on_a_never_closed_slot_is_an_error() -> None:
    gates = SlotGates()
    with pytest.raises(GateStateError, match=r"part 'save' reported on slot \(0x10\), which "
                                             r"was never closed"):
        gates.mark_done((0x10,), "save")


@pytest.mark.parametrize("key", [(), [0x10], (0x10, -1), (True,), ("0x10",), 0x10])
def test_bad_keys(key: object) -> None:
    with pytest.raises(TypeError, match="a slot key must be a non-empty tuple"):
        SlotGates().close(key, ["save"])  # type: ignore[arg-type]


@pytest.mark.parametrize("parts", [[""], [None], ["save", 3]])
def test_bad_part_names(parts: list[object]) -> None:
    with pytest.raises(TypeError, match="a part name must be a non-empty string"):
        SlotGates().close(KEY, parts)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [-1.0, float("nan")])
def test_bad_timeouts(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout must be None or a number >= 0"):
        SlotGates().wait(KEY, timeout)


def test_infinite_timeout_waits_like_none() -> None:
    gates = SlotGates()
    gates.close(KEY, ["save"])
    waiter = Waiter(gates, KEY, timeout=float("inf"))
    waiter.start()
    assert_still_blocked([waiter])
    gates.mark_done(KEY, "save")
    join_all([waiter])
    assert waiter.returned


def test_a_waiter_sees_the_outcome_of_the_round_it_waited_for() -> None:
    # The round ends and a new one starts before the waiter gets the lock back; the waiter must
    # return (its round is over) instead of waiting on the next round. Holding the gates' lock
    # (reentrant) makes the interleaving deterministic.
    gates = SlotGates()
    gates.close(KEY, ["save@r1"])
    waiter = Waiter(gates, KEY)
    waiter.start()
    assert_still_blocked([waiter])
    with gates._changed:
        gates.mark_done(KEY, "save@r1")
        gates.close(KEY, ["save@r2"])
    join_all([waiter])
    assert waiter.returned
    assert not gates.is_open(KEY)


def test_slot_name() -> None:
    assert slot_name((255, 4096)) == "(0xff, 0x1000)"


def test_concurrent_rounds_on_many_slots() -> None:
    """Prefill-like threads cycle their slots while reporter threads acknowledge parts in
    random order; every wait must end exactly when its round does, with the right outcome."""
    gates = SlotGates()
    rounds, parts_per_round, slots = 40, 3, 6
    work: queue.Queue[tuple[Callable[[], bool], set[str], str] | None] = queue.Queue()
    problems: list[str] = []
    rng = random.Random(1234)
    plans = {s: [rng.random() < 0.2 for _ in range(rounds)] for s in range(slots)}

    def reporter() -> None:
        while (item := work.get()) is not None:
            report, reported, part = item
            reported.add(part)
            report()

    def prefill(slot: int) -> None:
        key = (0x1000 * (slot + 1),)
        for r, fail in enumerate(plans[slot]):
            parts = [f"s{slot}r{r}p{j}" for j in range(parts_per_round)]
            reported: set[str] = set()
            gates.close(key, parts)
            for j, part in enumerate(parts):
                if fail and j == 0:
                    report = partial(gates.mark_failed, key, part, "injected")
                else:
                    report = partial(gates.mark_done, key, part)
                work.put((report, reported, part))
            try:
                gates.wait(key, JOIN_S)
            except SlotFailedError:
                if not fail:
                    problems.append(f"slot {slot} round {r}: unexpected failure")
                continue
            except SlotTimeoutError as error:
                problems.append(f"slot {slot} round {r}: {error}")
                return
            if fail:
                problems.append(f"slot {slot} round {r}: failure was not reported")
            if reported != set(parts):
                problems.append(f"slot {slot} round {r}: opened before all parts reported")

    reporters = [threading.Thread(target=reporter, daemon=True) for _ in range(4)]
    producers = [threading.Thread(target=prefill, args=(s,), daemon=True) for s in range(slots)]
    for t in reporters + producers:
        t.start()
    for t in producers:
        t.join(4 * JOIN_S)
        assert not t.is_alive(), "a prefill thread hung"
    for _ in reporters:
        work.put(None)
    for t in reporters:
        t.join(JOIN_S)
        assert not t.is_alive()
    assert problems == []


# -- RequestCompletionTracker --------------------------------------------------------------


class QueuePump:
    """A transport stand-in: answers queued by the test are reported by whoever pumps."""

    def __init__(self, gates: SlotGates) -> None:
        self.gates = gates
        self.answers: queue.Queue[tuple[tuple[int, ...], str, str | None]] = queue.Queue()
        self.interrupted = threading.Event()
        self.interrupts = 0
        self.pumping = 0
        self.most_pumping = 0
        self.reporters: list[int] = []
        self._lock = threading.Lock()

    def pump(self, timeout_s: float) -> bool:
        with self._lock:
            self.pumping += 1
            self.most_pumping = max(self.most_pumping, self.pumping)
        try:
            try:
                key, part, error = self.answers.get(timeout=min(timeout_s, 0.005))
            except queue.Empty:
                self.interrupted.wait(timeout_s)
                self.interrupted.clear()
                return False
            self.reporters.append(threading.get_ident())
            if error is None:
                self.gates.mark_done(key, part)
            else:
                self.gates.mark_failed(key, part, error)
            return True
        finally:
            with self._lock:
                self.pumping -= 1

    def interrupt(self) -> None:
        self.interrupts += 1
        self.interrupted.set()


def test_a_waiter_handles_the_answers_itself_when_a_pump_is_attached() -> None:
    gates = SlotGates()
    pump = QueuePump(gates)
    gates.attach_pump(pump)
    gates.close((1,), ["read", "save"])
    pump.answers.put(((1,), "read", None))
    pump.answers.put(((1,), "save", None))
    gates.wait((1,), 5.0)
    assert pump.reporters == [threading.get_ident()] * 2  # no hand-off to another thread
    assert pump.interrupts == 0  # the pumping thread's own reports need no interrupt


def test_a_report_from_another_thread_interrupts_the_pump(monkeypatch) -> None:
    import kvo_core.gates as gates_module

    monkeypatch.setattr(gates_module, "PUMP_SLICE_S", 30.0)  # only an interrupt ends a slice
    gates = SlotGates()
    pump = QueuePump(gates)
    gates.attach_pump(pump)
    gates.close((1,), ["save"])
    reporter = threading.Timer(0.1, gates.mark_done, ((1,), "save"))
    reporter.start()
    gates.wait((1,), 20.0)  # returns once interrupted, not after a 30 s slice
    reporter.join()
    assert pump.interrupts >= 1 and pump.reporters == []


def test_one_waiter_pumps_at_a_time_and_failures_and_timeouts_still_work() -> None:
    gates = SlotGates()
    pump = QueuePump(gates)
    gates.attach_pump(pump)
    keys = [(k,) for k in range(6)]
    for key in keys:
        gates.close(key, ["read"])
    results: dict[tuple[int, ...], object] = {}

    def wait(key: tuple[int, ...]) -> None:
        try:
            gates.wait(key, 10.0)
            results[key] = "ok"
        except SlotFailedError as exc:
            results[key] = exc

    waiters = [threading.Thread(target=wait, args=(key,)) for key in keys]
    for waiter in waiters:
        waiter.start()
    for key in keys:
        pump.answers.put((key, "read", "broken" if key == (3,) else None))
    for waiter in waiters:
        waiter.join(20)
        assert not waiter.is_alive()
    assert pump.most_pumping == 1
    assert isinstance(results.pop((3,)), SlotFailedError)
    assert set(results.values()) == {"ok"}
    gates.close((9,), ["never"])
    with pytest.raises(SlotTimeoutError, match="never"):
        gates.wait((9,), 0.2)


def test_a_pump_that_returns_at_once_is_not_called_in_a_busy_loop() -> None:
    class ClosedPump:  # e.g. a publisher closed while still attached
        calls = 0

        def pump(self, timeout_s: float) -> bool:
            self.calls += 1
            return False

        def interrupt(self) -> None:
            pass

    gates = SlotGates()
    pump = ClosedPump()
    gates.attach_pump(pump)
    gates.close((1,), ["save"])
    reporter = threading.Timer(0.3, gates.mark_done, ((1,), "save"))
    reporter.start()
    gates.wait((1,), 10.0)  # still ends when another thread reports
    reporter.join()
    assert 1 <= pump.calls <= 20  # ~one call per 50 ms slice, not thousands


def test_one_pump_per_table() -> None:
    gates = SlotGates()
    first, second = QueuePump(gates), QueuePump(gates)
    gates.attach_pump(first)
    gates.attach_pump(first)  # the same one again is fine
    with pytest.raises(GateStateError, match="already attached"):
        gates.attach_pump(second)
    gates.attach_pump(None)
    gates.attach_pump(second)


def test_request_finishes_when_all_parts_are_done() -> None:
    tracker = RequestCompletionTracker()
    tracker.expect("req-1", ["layer0", "layer1"])
    tracker.expect("req-2", ["layer0"])
    assert tracker.mark_done("req-1", "layer0") is True
    assert tracker.pop_finished() == (set(), {})
    assert tracker.pending("req-1") == {"layer1"}
    tracker.mark_done("req-1", "layer1")
    tracker.mark_done("req-2", "layer0")
    assert tracker.pop_finished() == ({"req-1", "req-2"}, {})
    assert tracker.pop_finished() == (set(), {})
    assert tracker.pending("req-1") == frozenset()


def test_failed_request_is_reported_once_every_part_reported() -> None:
    tracker = RequestCompletionTracker()
    tracker.expect("req-1", ["read:d0", "read:d1"])
    tracker.mark_failed("req-1", "read:d0", ValueError("bad block"))
    assert tracker.pop_finished() == (set(), {}), "read:d1 may still be using the blocks"
    tracker.mark_failed("req-1", "read:d1", "timeout")
    assert tracker.pop_finished() == (set(), {"req-1": "read:d0: ValueError: bad block"})


def test_request_with_no_parts_finishes_at_once() -> None:
    tracker = RequestCompletionTracker()
    tracker.expect("req-1", [])
    assert tracker.pop_finished() == ({"req-1"}, {})


def test_request_id_reuse_and_stray_reports() -> None:
    tracker = RequestCompletionTracker()
    tracker.expect("req-1", ["a"])
    with pytest.raises(GateStateError, match="request 'req-1' is already tracked"):
        tracker.expect("req-1", ["b"])
    assert tracker.mark_done("req-1", "zzz") is False
    assert tracker.mark_done("req-9", "a") is False
    tracker.mark_done("req-1", "a")
    assert tracker.mark_done("req-1", "a") is False
    with pytest.raises(GateStateError, match="already tracked"):
        tracker.expect("req-1", ["a"])  # finished but not popped yet
    assert tracker.pop_finished() == ({"req-1"}, {})
    tracker.expect("req-1", ["a"])  # popped: the id may be used again
    with pytest.raises(TypeError, match="request id must be a non-empty string"):
        tracker.expect("", ["a"])


def test_tracker_under_concurrent_reports() -> None:
    tracker = RequestCompletionTracker()
    requests = {f"req-{i}": [f"p{j}" for j in range(8)] for i in range(30)}
    for request_id, parts in requests.items():
        tracker.expect(request_id, parts)
    reports = [(r, p) for r, parts in requests.items() for p in parts]
    random.Random(7).shuffle(reports)
    failing = {"req-3", "req-17"}

    def report(chunk: list[tuple[str, str]]) -> None:
        for request_id, part in chunk:
            if request_id in failing and part == "p5":
                tracker.mark_failed(request_id, part, "lost")
            else:
                tracker.mark_done(request_id, part)

    threads = [threading.Thread(target=report, args=(reports[k::4],)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
        assert not t.is_alive()
    succeeded, failed = tracker.pop_finished()
    assert succeeded == set(requests) - failing
    assert failed == {r: "p5: lost" for r in failing}


class RecordingFence:
    """A SlotFence that records, at each advance, whether a waiter could already see the end."""

    def __init__(self, gates: SlotGates) -> None:
        self.gates = gates
        self.advanced: list[tuple[tuple[int, ...], bool]] = []

    def advance(self, key: tuple[int, ...]) -> None:
        # Called under the gate lock: the round's failure is not visible to anyone yet.
        self.advanced.append((key, self.gates._rounds[key].error is not None))


def test_a_failed_round_advances_the_slot_fence_before_waiters_see_it() -> None:
    gates = SlotGates()
    fence = RecordingFence(gates)
    gates.attach_fence(fence)
    gates.close((1,), ["save", "read"])
    gates.mark_done((1,), "save")
    gates.mark_failed((1,), "read", "deadline")
    gates.mark_failed((1,), "read", "again")  # ignored: no second advance
    assert fence.advanced == [((1,), False)]
    with pytest.raises(SlotFailedError):
        gates.wait((1,), 0)
    gates.close((1,), ["read"])
    gates.mark_done((1,), "read")  # a round that succeeds needs no advance
    gates.close((2,), ["a", "b"])
    gates.mark_failed((2,), "b", "x")
    gates.mark_failed((2,), "a", "y")  # the round already failed: one advance per round
    assert fence.advanced == [((1,), False), ((2,), False)]


def test_one_fence_per_gate_table() -> None:
    gates = SlotGates()
    first = RecordingFence(gates)
    gates.attach_fence(first)
    gates.attach_fence(first)
    with pytest.raises(GateStateError, match="slot fence is already attached"):
        gates.attach_fence(RecordingFence(gates))
    gates.attach_fence(None)
    gates.attach_fence(RecordingFence(gates))


# -- announced parts and joined sub-parts (one producer reports into another's round) ------


def test_a_report_of_an_announced_part_before_its_round_is_applied_at_close() -> None:
    gates = SlotGates()
    gates.announce(KEY, "remote:1:0")
    gates.join(KEY, "remote:1:0", ["read:a#1", "read:b#2"])  # one per decode endpoint
    assert gates.mark_done(KEY, "read:a#1") and gates.mark_done(KEY, "read:b#2")
    assert gates.is_open(KEY)  # no round yet: the report is held
    gates.close(KEY, ["store:1:0", "remote:1:0"])
    assert gates.pending(KEY) == {"store:1:0"}  # the early remote answer was applied
    gates.mark_done(KEY, "store:1:0")
    gates.wait(KEY, 0)
    assert gates.in_flight_sub_parts() == 0


def test_the_slot_opens_only_after_the_save_and_every_joined_read() -> None:
    gates = SlotGates()
    gates.announce(KEY, "remote:2:0")
    gates.join(KEY, "remote:2:0", ["read:a#3", "read:b#4"])
    gates.close(KEY, ["store:2:0", "remote:2:0"])
    gates.mark_done(KEY, "store:2:0")
    gates.mark_done(KEY, "read:a#3")
    assert not gates.is_open(KEY)  # decode b still reads the buffer
    waiters = start_waiters(gates, KEY, 2)
    assert_still_blocked(waiters)
    gates.mark_done(KEY, "read:b#4")
    join_all(waiters)
    assert all(w.returned for w in waiters)


def test_a_failed_sub_part_fails_the_round_once_and_later_ones_are_absorbed() -> None:
    gates = SlotGates()
    fence = RecordingFence(gates)
    gates.attach_fence(fence)
    gates.announce(KEY, "remote:3:0")
    gates.join(KEY, "remote:3:0", ["read:a#5", "read:b#6"])
    gates.close(KEY, ["remote:3:0", "store:3:0"])
    assert gates.mark_failed(KEY, "read:a#5", "decode lost")
    assert gates.mark_done(KEY, "read:b#6")  # a late success changes nothing
    assert fence.advanced == [(KEY, False)]
    with pytest.raises(SlotFailedError, match=r"remote:3:0.*decode lost"):
        gates.wait(KEY, 0)
    assert gates.in_flight_sub_parts() == 0
    assert not gates.mark_done(KEY, "read:b#6")  # unknown now: ignored


def test_an_early_failure_fails_the_round_when_it_closes() -> None:
    gates = SlotGates()
    gates.announce(KEY, "remote:4:0")
    gates.join(KEY, "remote:4:0", ["read:a#7"])
    gates.mark_failed(KEY, "read:a#7", "READ_FAILED")
    gates.close(KEY, ["store:4:0", "remote:4:0"])
    with pytest.raises(SlotFailedError, match="READ_FAILED"):
        gates.wait(KEY, 0)


def test_a_join_into_a_part_of_the_running_round_and_an_empty_join() -> None:
    gates = SlotGates()
    gates.close(KEY, ["store", "remote", "other"])
    gates.join(KEY, "remote", ["read:a#1"])  # the round closed first: reports go straight in
    gates.join(KEY, "other", [])  # nothing reads: done at once
    assert gates.pending(KEY) == {"store", "remote"}
    gates.mark_done(KEY, "read:a#1")
    assert gates.pending(KEY) == {"store"}


def test_join_and_announce_misuse_is_refused_naming_the_part() -> None:
    gates = SlotGates()
    with pytest.raises(GateStateError, match=r"'remote:9' of slot .* neither announced"):
        gates.join(KEY, "remote:9", ["read:a#1"])
    gates.announce(KEY, "remote:9")
    with pytest.raises(GateStateError, match="already announced"):
        gates.announce(KEY, "remote:9")
    gates.join(KEY, "remote:9", ["read:a#1"])
    gates.announce(KEY, "remote:10")
    with pytest.raises(GateStateError, match=r"\['read:a#1'\] .* another part"):
        gates.join(KEY, "remote:10", ["read:a#1", "read:b#2"])
    with pytest.raises(GateStateError, match="never closed"):
        gates.mark_done(KEY, "read:zz")  # neither joined, announced, nor in a round


def test_announcements_whose_round_never_comes_are_bounded() -> None:
    gates = SlotGates()
    gates.announce(KEY, "remote:0:0")
    gates.join(KEY, "remote:0:0", ["read:a#0"])
    for step in range(1, MAX_ANNOUNCED + 1):
        gates.announce(KEY, f"remote:{step}:0")
    assert gates.mark_done(KEY, "read:a#0")  # its announcement was dropped (oldest first)...
    gates.close(KEY, ["remote:0:0", f"remote:{MAX_ANNOUNCED}:0"])
    assert gates.pending(KEY) == {"remote:0:0", f"remote:{MAX_ANNOUNCED}:0"}  # ...not held
    gates.mark_done(KEY, f"remote:{MAX_ANNOUNCED}:0")  # while recent ones still count
    assert gates.pending(KEY) == {"remote:0:0"}


def test_close_takes_the_parts_announced_on_the_slot_in_its_epoch() -> None:
    """The owner closes with its own part only; the announcer only reports (no part names
    handed over), and its early answers are applied at close."""
    gates = SlotGates()
    other = (0x7F00_0000_3000,)
    gates.new_epoch()
    gates.announce(KEY, "remote:1:0")
    gates.join(KEY, "remote:1:0", ["read:a#1", "read:b#2"])
    gates.announce(other, "remote:1:1")  # another slot's: not this round's
    assert gates.mark_done(KEY, "read:a#1")
    gates.close(KEY, ["store:1:0"], take_announced=True)
    assert gates.pending(KEY) == {"store:1:0", "remote:1:0"}
    gates.mark_done(KEY, "store:1:0")
    assert not gates.is_open(KEY)  # decode b still reads
    gates.mark_done(KEY, "read:b#2")
    gates.wait(KEY, 0)
    gates.close(other, ["store:1:1"], take_announced=True)
    assert gates.pending(other) == {"store:1:1", "remote:1:1"}


def test_a_stale_announcement_never_joins_a_later_round() -> None:
    """A step announced a remote part on the slot but closed no round there (e.g. its layer
    pipeline had nothing to do on it); its read then failed. The next step's round on the slot
    must neither wait for that part nor fail with its report."""
    gates = SlotGates()
    gates.new_epoch()
    gates.announce(KEY, "remote:1:0")
    gates.join(KEY, "remote:1:0", ["read:a#1"])
    gates.announce(KEY, "remote:1:0b")  # never reported at all
    assert gates.mark_failed(KEY, "read:a#1", "decode failed to read")  # held, no round
    gates.new_epoch()
    gates.close(KEY, ["store:2:0"], take_announced=True)
    assert gates.pending(KEY) == {"store:2:0"}
    assert gates.error(KEY) is None
    gates.mark_done(KEY, "store:2:0")
    gates.wait(KEY, 0)  # open, not failed
    assert gates.mark_done(KEY, "remote:1:0b") is False  # a late report: ignored
    assert gates.is_open(KEY)


def test_an_announcement_of_the_current_epoch_with_a_held_failure_fails_the_round() -> None:
    gates = SlotGates()
    fence = RecordingFence(gates)
    gates.attach_fence(fence)
    gates.new_epoch()
    gates.announce(KEY, "remote:3:0")
    gates.mark_failed(KEY, "remote:3:0", "decode failed to read")
    gates.close(KEY, ["store:3:0"], take_announced=True)
    gates.mark_done(KEY, "store:3:0")
    with pytest.raises(SlotFailedError, match="decode failed to read"):
        gates.wait(KEY, 0)
    assert fence.advanced == [(KEY, False)]  # advanced once, before anyone saw the failure


def test_joined_reads_from_many_threads_release_the_slot_exactly_when_all_are_in() -> None:
    rng = random.Random(3)
    for round_ in range(50):
        gates = SlotGates()
        part = f"remote:{round_}"
        subs = [f"read:{i}#{round_}" for i in range(rng.randint(1, 6))]
        gates.announce(KEY, part)
        gates.join(KEY, part, subs)
        close_after = rng.randint(0, len(subs))  # the round closes somewhere among the reports
        early = [threading.Thread(target=gates.mark_done, args=(KEY, sub))
                 for sub in subs[:close_after]]
        for thread in early:
            thread.start()
        for thread in early:
            thread.join(JOIN_S)
        gates.close(KEY, ["store", part])
        gates.mark_done(KEY, "store")
        for sub in subs[close_after:]:
            assert not gates.is_open(KEY), (round_, close_after, len(subs))
            gates.mark_done(KEY, sub)
        assert gates.is_open(KEY), (round_, close_after, len(subs))
        assert gates.in_flight_sub_parts() == 0


def test_tracker_wait_finished_wakes_when_a_request_ends() -> None:
    """A consumer with nothing else to do sleeps until a request is terminal (done or
    failed), instead of polling ``pop_finished``."""
    tracker = RequestCompletionTracker()
    tracker.expect("r1", {"a", "b"})
    assert tracker.wait_finished(0.01) is False  # nothing finished: the wait times out
    tracker.mark_done("r1", "a")
    assert tracker.wait_finished(0.01) is False  # one part still pending
    reporter = threading.Timer(0.05, tracker.mark_failed, ("r1", "b", "lost"))
    reporter.start()
    try:
        assert tracker.wait_finished(30.0) is True
    finally:
        reporter.join()
    assert tracker.pop_finished() == (set(), {"r1": "b: lost"})
    assert tracker.wait_finished(0.0) is False  # popped: nothing left to report
    tracker.expect("r2", ())
    assert tracker.wait_finished(0.0) is True  # no parts: finished at once
