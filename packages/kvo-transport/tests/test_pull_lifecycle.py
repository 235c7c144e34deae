"""The decode pull state machine (kvo_transport.pull_lifecycle): every transition, allowed and
refused, and what the table does on each path a decode request can take."""

from __future__ import annotations

import itertools

import pytest

from kvo_transport.pull_lifecycle import (
    TRANSITIONS,
    DeadlinePolicy,
    PullEvent,
    PullState,
    PullTable,
    RefusedTransitionError,
    RequestPull,
    next_state,
)
from kvo_transport.read_plan import RequestDestination

S, E = PullState, PullEvent

ALLOWED = {
    (S.REGISTERED, E.READY_SEEN): S.READING,
    (S.READING, E.READY_SEEN): S.READING,
    (S.REGISTERED, E.DELIVERED): S.RECEIVED,
    (S.READING, E.DELIVERED): S.RECEIVED,
    (S.REGISTERED, E.FAILED): S.RETURNING,
    (S.READING, E.FAILED): S.RETURNING,
    (S.REGISTERED, E.STOPPED): S.RETURNING,
    (S.READING, E.STOPPED): S.RETURNING,
    (S.RETURNING, E.SETTLED): S.RETURNED,
    (S.RECEIVED, E.REPORTED): S.REPORTED,
    (S.RETURNED, E.REPORTED): S.REPORTED,
}
"""Written out by hand (not derived from TRANSITIONS): the machine the module promises."""


@pytest.mark.parametrize(("state", "event"), list(itertools.product(PullState, PullEvent)),
                         ids=lambda v: v.name)
def test_every_transition_is_allowed_or_refused_as_the_table_says(
        state: PullState, event: PullEvent) -> None:
    pull = RequestPull(transfer_id="t", request_id="r", destination=RequestDestination((1,)),
                       registered_at=0.0, state=state)
    if (state, event) in ALLOWED:
        assert next_state(state, event) is ALLOWED[(state, event)]
        pull.move(event)
        assert pull.state is ALLOWED[(state, event)]
    else:
        with pytest.raises(RefusedTransitionError, match=f"{state.value} cannot take "
                                                          f"{event.name}"):
            next_state(state, event)
        with pytest.raises(RefusedTransitionError):
            pull.move(event)
        assert pull.state is state


def test_the_module_table_is_the_hand_written_one() -> None:
    assert TRANSITIONS == ALLOWED
    # Nothing leaves REPORTED, and every state but REGISTERED is reached by some transition.
    assert not any(state is S.REPORTED for state, _ in TRANSITIONS)
    assert set(TRANSITIONS.values()) == set(PullState) - {S.REGISTERED}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _table(clock: Clock, reported_memory: int = 8) -> PullTable:
    return PullTable(DeadlinePolicy(first_ready_s=10.0, next_ready_s=2.0),
                     reported_memory=reported_memory, clock=clock)


def _register(table: PullTable, transfer_id: str, request_id: str,
              blocks: tuple[int, ...] = (4, 5, -1)) -> RequestPull:
    return table.register(transfer_id, request_id, RequestDestination(blocks))


def test_a_received_pull_is_reported_once_without_invalid_blocks() -> None:
    table = _table(Clock())
    pull = _register(table, "t1", "r1")
    assert table.resolve("t1") == RequestDestination((4, 5, -1)) and pull.state is S.READING
    assert table.deliver("t1") is pull and pull.state is S.RECEIVED
    assert table.live == 0 and table.resolve("t1") is None   # a late READY finds nothing
    assert table.report() == [pull] and pull.state is S.REPORTED
    assert table.report() == []


def test_a_failed_pull_returns_only_once_settled_with_the_blocks_its_reads_named() -> None:
    table = _table(Clock())
    pull = _register(table, "t1", "r1")
    assert table.fail("t1", "read failed") is pull and pull.state is S.RETURNING
    assert pull.invalid == {4, 5}                             # nothing named yet: all of them
    pull.name_invalid({5})
    pull.name_invalid(())                                     # naming nothing changes nothing
    assert pull.invalid == {5} and table.returning == 1
    assert table.settle(lambda p: False) == [] and table.report() == []
    assert table.settle(lambda p: True) == [pull] and pull.state is S.RETURNED
    assert table.report() == [pull] and pull.reason == "read failed"
    # Late news of a pull that is over moves nothing.
    assert table.fail("t1", "again") is None and table.deliver("t1") is None


def test_the_deadline_policy_gives_up_a_pull_that_stopped_arriving() -> None:
    clock = Clock()
    table = _table(clock)
    waiting, reading = _register(table, "t1", "r1"), _register(table, "t2", "r2")
    clock.now += 8.0
    table.resolve("t2")                    # a READY of t2: its next is due within 2 s
    clock.now += 1.5
    assert table.expire() == []
    clock.now += 1.0                       # t1: 10.5 s without a READY; t2: 2.5 s since one
    assert table.expire() == [waiting, reading]
    assert waiting.reason == "no READY arrived within 10 s (prefill lost or too slow)"
    assert reading.reason == "no further READY arrived within 2 s (prefill lost or too slow)"
    assert {p.state for p in (waiting, reading)} == {S.RETURNING} and table.live == 0


def test_a_stop_returns_live_pulls_without_a_load_error() -> None:
    table = _table(Clock())
    pull = _register(table, "t1", "r1")
    assert table.stop("r1") == ([pull], False)
    assert pull.state is S.RETURNING and pull.reason is None and pull.invalid == frozenset()
    assert table.stop("r1") == ([], False)                     # on its way back: no 2nd answer
    table.settle(lambda p: True)
    assert [p.request_id for p in table.report()] == ["r1"]


def test_a_stop_of_a_request_never_registered_is_answered_once() -> None:
    table = _table(Clock())
    assert table.stop("r9") == ([], False)
    assert table.stop("r9") == ([], False)                     # pending: not a second answer
    answers = table.report()
    assert [(p.request_id, p.state, p.reason) for p in answers] == [("r9", S.REPORTED, None)]
    assert table.stop("r9") == ([], True)                      # reported: nothing to answer


def test_reported_ids_are_remembered_up_to_the_bound() -> None:
    table = _table(Clock(), reported_memory=2)
    for i in range(3):
        _register(table, f"t{i}", f"r{i}")
        table.deliver(f"t{i}")
    table.report()
    assert table.stop("r0") == ([], False)                     # forgotten: answered again
    assert table.stop("r2") == ([], True)
