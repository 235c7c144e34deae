"""READYs that arrive before their destination wait for it, in order
(kvo_transport.ready_parking)."""

from __future__ import annotations

import pytest

from kvo_transport.protocol import PROTOCOL_VERSION, Fence, ReadReadyBatch, ReadyRequest
from kvo_transport.read_plan import NOTHING_WANTED, RequestDestination
from kvo_transport.ready_parking import ReadyParking


def ready(seq: int, *request_ids: str) -> ReadReadyBatch:
    requests = tuple(ReadyRequest(request_id=r, main_start_block=0, num_blocks=1,
                                  main_block_ids=(0,), indexer_start_block=0,
                                  indexer_block_ids=()) for r in request_ids)
    return ReadReadyBatch(version=PROTOCOL_VERSION, seq=seq, layer_index=seq,
                          layer_name=f"layers.{seq}", member=0, ratio=1, requests=requests,
                          fences=(Fence(word=0, epoch=1),))


class Table:
    """A resolver whose destinations appear and disappear as the test says."""

    def __init__(self) -> None:
        self.known: dict[str, RequestDestination] = {}

    def __call__(self, request_id: str) -> RequestDestination | None:
        return self.known.get(request_id)


def seqs(due: list[tuple[bytes, ReadReadyBatch, float]]) -> list[tuple[bytes, int]]:
    return [(identity, batch.seq) for identity, batch, _ in due]


def test_a_ready_with_its_destination_is_read_at_once() -> None:
    table, parking = Table(), ReadyParking(wait_s=1.0)
    table.known["a"] = RequestDestination((5,))
    assert not parking.offer(b"p", ready(0, "a"), 0.0, table)
    assert len(parking) == 0 and parking.next_check_s(0.0, 0.001) is None


def test_a_connection_keeps_its_order_behind_a_waiting_ready() -> None:
    table, parking = Table(), ReadyParking(wait_s=1.0)
    table.known["b"] = RequestDestination((6,))
    assert parking.offer(b"p", ready(0, "a"), 0.0, table)       # "a" not registered yet
    assert parking.offer(b"p", ready(1, "b"), 0.1, table)       # behind it, though "b" is known
    assert not parking.offer(b"q", ready(7, "b"), 0.1, table)   # another connection: no wait
    assert parking.due(0.2, table) == []
    assert parking.next_check_s(0.2, 0.001) == pytest.approx(0.001)
    table.known["a"] = RequestDestination((5,))
    assert seqs(parking.due(0.3, table)) == [(b"p", 0), (b"p", 1)]
    assert len(parking) == 0 and parking.parked == 2 and parking.expired == 0


def test_a_ready_whose_destination_never_comes_is_handed_back_after_wait_s() -> None:
    table, parking = Table(), ReadyParking(wait_s=0.5)
    parking.offer(b"p", ready(0, "a"), 10.0, table)
    assert parking.next_check_s(10.4, 1.0) == pytest.approx(0.1)
    assert parking.due(10.4, table) == []
    due = parking.due(10.5, table)
    assert seqs(due) == [(b"p", 0)] and due[0][2] == pytest.approx(0.5)
    assert parking.expired == 1
    assert parking.destination("a", table) is None   # refused by the caller, as before


def test_a_released_request_is_not_waited_for() -> None:
    table, parking = Table(), ReadyParking(wait_s=1.0)
    table.known["a"] = RequestDestination((5,))
    assert not parking.offer(b"p", ready(0, "a"), 0.0, table)
    del table.known["a"]   # decode released it: a late READY is refused at once
    assert not parking.offer(b"p", ready(1, "a"), 0.1, table)


def test_a_declined_request_wants_nothing_and_frees_waiting_readies() -> None:
    table, parking = Table(), ReadyParking(wait_s=1.0)
    assert parking.offer(b"p", ready(0, "a"), 0.0, table)
    parking.decline("a")
    assert seqs(parking.due(0.01, table)) == [(b"p", 0)]
    target = parking.destination("a", table)
    assert target is not None and target.first_block == NOTHING_WANTED
    assert not parking.offer(b"p", ready(1, "a"), 0.02, table)


def test_dropping_a_connection_returns_its_readies_in_order() -> None:
    table, parking = Table(), ReadyParking(wait_s=1.0)
    parking.offer(b"p", ready(0, "a"), 0.0, table)
    parking.offer(b"p", ready(1, "a"), 0.0, table)
    assert [b.seq for b in parking.drop(b"p")] == [0, 1]
    assert len(parking) == 0 and parking.drop(b"p") == []


def test_the_waiting_room_is_bounded() -> None:
    table, parking = Table(), ReadyParking(wait_s=1.0, max_parked=2)
    assert parking.offer(b"p", ready(0, "a"), 0.0, table)
    assert parking.offer(b"q", ready(1, "b"), 0.0, table)
    assert not parking.offer(b"r", ready(2, "c"), 0.0, table)  # full: read (refused) now
    with pytest.raises(ValueError, match="wait_s must be >= 0"):
        ReadyParking(wait_s=-1.0)
