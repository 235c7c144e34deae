"""The destination ledger's rules: revocation never waits, hand-back waits for reads and slices."""

from __future__ import annotations

import threading

import pytest

from kvo_transport.destinations import DestinationLedger, DestinationRevokedError, blocks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_blocks_name_main_and_indexer_apart_and_skip_holes() -> None:
    assert blocks((1, -1, 2), (1,)) == {("main", 1), ("main", 2), ("indexer", 1)}


def test_a_read_in_flight_holds_the_hand_back_but_not_the_revocation() -> None:
    ledger = DestinationLedger(quarantine_s=1.0, clock=Clock())
    ticket = ledger.begin_read(blocks((3, 4)))
    ledger.revoke(blocks((3, 4)))  # returns at once: nothing waits for the read
    assert not ledger.settled(blocks((3,)))
    assert ledger.settled(blocks((5,)))
    ledger.end_read(ticket, failed=False)
    assert ledger.settled(blocks((3, 4)))
    with pytest.raises(DestinationRevokedError, match=r"\('main', 3\)"):
        ledger.begin_read(blocks((3,)))
    ledger.restore(blocks((3, 4)))
    ledger.end_read(ledger.begin_read(blocks((3,))), failed=False)


def test_a_failed_read_quarantines_its_blocks_for_the_quarantine_time() -> None:
    clock = Clock()
    ledger = DestinationLedger(quarantine_s=0.5, clock=clock)
    ledger.end_read(ledger.begin_read(blocks((7,), (7,))), failed=True)
    assert not ledger.settled(blocks((7,)))
    assert not ledger.settled(blocks((), (7,)))
    clock.now += 0.49
    assert not ledger.settled(blocks((7,)))
    clock.now += 0.02
    assert ledger.settled(blocks((7,), (7,)))
    # A second failure later extends it; an earlier one never shortens it.
    ledger.quarantine(blocks((8,)))
    clock.now += 0.3
    ledger.quarantine(blocks((8,)))
    clock.now += 0.3
    assert not ledger.settled(blocks((8,)))


def test_overlapping_reads_all_count() -> None:
    ledger = DestinationLedger(quarantine_s=0.0, clock=Clock())
    first = ledger.begin_read(blocks((1, 2)))
    second = ledger.begin_read(blocks((2, 3)))
    ledger.end_read(first, failed=False)
    assert ledger.settled(blocks((1,))) and not ledger.settled(blocks((2,)))
    ledger.end_read(second, failed=False)
    ledger.end_read(second, failed=False)  # a repeated report changes nothing
    assert ledger.settled(blocks((1, 2, 3))) and ledger.in_flight() == 0


def test_revoking_while_another_thread_is_inside_a_read_returns_at_once() -> None:
    """The read stays stalled until the revoke has returned: a revoke that waited behind the
    read would still be running when the generous join gives up (not a timing check: the read
    cannot end before ``release`` is set)."""
    ledger = DestinationLedger()
    ticket = ledger.begin_read(blocks((1,)))
    inside = threading.Event()
    release = threading.Event()

    def stalled_read() -> None:
        inside.set()
        release.wait(60)  # the engine call, stalled until the test releases it
        ledger.end_read(ticket, failed=False)

    reader = threading.Thread(target=stalled_read)
    reader.start()
    assert inside.wait(30)
    revoker = threading.Thread(target=ledger.revoke, args=(blocks((1,)),))
    revoker.start()
    revoker.join(20)
    returned = not revoker.is_alive()
    settled_while_reading = ledger.settled(blocks((1,)))
    release.set()
    reader.join(30)
    revoker.join(30)
    assert returned  # it did not wait for the stalled read
    assert not settled_while_reading  # the read may still write block 1: not handed back
    assert ledger.settled(blocks((1,)))


def test_quarantine_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="quarantine_s must be >= 0"):
        DestinationLedger(quarantine_s=-1)
