"""The publisher's bookkeeping rules, without sockets (kvo_transport.ready_ledger)."""

from __future__ import annotations

from kvo_transport.ready_ledger import PendingReady, ReadyLedger


def ready(endpoint: str, seq: int, layer: int, requests: tuple[str, ...],
          deadline: float) -> PendingReady:
    return PendingReady(endpoint=endpoint, seq=seq, layer_index=layer, layer_name=f"l{layer}",
                        slot_key=(layer + 1,), part=f"read:{endpoint}#{seq}",
                        request_ids=requests, sent_at=0.0, deadline=deadline)


def test_an_answer_matches_only_a_ready_in_flight() -> None:
    ledger = ReadyLedger()
    assert ledger.add(ready("a", 1, 0, ("r",), 5.0), frozenset()) == ["r"]
    assert ledger.add(ready("a", 2, 1, ("r",), 5.0), frozenset({"r"})) == []  # known already
    item = ledger.answer("a", 1)
    assert item is not None and item.layer_index == 0
    assert ledger.answer("a", 1) is None  # repeated
    assert ledger.answer("b", 2) is None  # another endpoint's seq
    assert ledger.in_flight() == 1


def test_the_first_missed_deadline_fails_what_is_queued_behind_it_there() -> None:
    ledger = ReadyLedger()
    ledger.add(ready("a", 1, 0, ("r",), 1.0), frozenset())
    ledger.add(ready("a", 2, 1, ("r",), 9.0), frozenset())
    ledger.add(ready("b", 3, 0, ("s",), 9.0), frozenset())
    assert ledger.next_deadline() == 1.0
    assert ledger.expire(0.5) == ([], [])
    expired, behind = ledger.expire(1.0)
    assert [i.seq for i in expired] == [1] and [i.seq for i in behind] == [2]
    assert ledger.next_deadline() == 9.0  # "a" seq 2's entry is gone with it
    assert ledger.in_flight() == 1


def test_answered_readies_leave_the_deadline_heap() -> None:
    ledger = ReadyLedger()
    ledger.add(ready("a", 1, 0, ("r",), 1.0), frozenset())
    ledger.add(ready("a", 2, 1, ("r",), 2.0), frozenset())
    ledger.answer("a", 1)
    assert ledger.next_deadline() == 2.0
    assert ledger.expire(1.5) == ([], [])


def test_a_failure_is_reported_once_nothing_is_in_flight_a_success_after_the_last_layer() -> None:
    ledger = ReadyLedger()
    first, second = ready("a", 1, 0, ("r", "s"), 9.0), ready("a", 2, 1, ("r", "s"), 9.0)
    ledger.add(first, frozenset())
    ledger.add(second, frozenset({"s"}))
    assert ledger.settle(first, None) == []  # r: one in flight; s: not its last yet
    assert ledger.settle(second, "lost") == [("r", "lost"), ("s", "lost")]
    third = ready("a", 3, 2, ("r",), 9.0)  # a later layer of the failed request
    assert ledger.add(third, frozenset({"r"})) == []  # still counted, not tracked afresh
    assert ledger.settle(third, None) == []  # never reported twice
    done = ready("a", 4, 0, ("t",), 9.0)
    ledger.add(done, frozenset({"t"}))
    assert ledger.settle(done, None) == [("t", None)]


def test_forgotten_and_dropped() -> None:
    ledger = ReadyLedger()
    item = ready("a", 1, 0, ("r",), 9.0)
    ledger.add(item, frozenset())
    ledger.add(ready("b", 2, 0, ("q",), 9.0), frozenset())
    ledger.forget("r")
    assert ledger.settle(item, "x") == []
    assert [i.seq for i in ledger.drop_endpoint("a")] == [1]
    assert [i.seq for i in ledger.drain()] == [2] and ledger.in_flight() == 0
