"""Which decode destination blocks may be written, and which may be handed back (pure ledger).

A decode destination block can be in three states that matter: written by a read in flight,
quarantined after a failed read (Mooncake's batch read returns at its first failed slice while
other slices of the batch may still land, up to hundreds of milliseconds later:
docs/benchmarks.md), or revoked (its request was given up: no later read may start into it). The
receiver thread asks ``begin_read`` before every data read and reports ``end_read`` after it;
anyone (vLLM's step thread) may ``revoke`` at any time without waiting for a read, and hands
blocks back only once ``settled`` says no read is in flight into them and no quarantine covers
them. Nothing here blocks: revocation never waits behind a stalled read, the hand-back is what
waits.

Blocks are named by (kind, id): ``"main"`` and ``"indexer"`` destinations are numbered apart.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable

import attrs

DEFAULT_QUARANTINE_S = 2.0
"""How long a failed read's destination stays untouchable. Late slices land hundreds of
milliseconds after the failed call, past 1 s on a loaded machine (docs/benchmarks.md); a time
bound is what Mooncake's synchronous batch read allows (it does not say when the rest of a
failed batch settled), so it is generous and configurable."""

Block = tuple[str, int]


def blocks(main: Iterable[int] = (), indexer: Iterable[int] = ()) -> frozenset[Block]:
    """(kind, id) names of main and indexer destination blocks (negative ids are holes)."""
    return frozenset(itertools.chain((("main", b) for b in main if b >= 0),
                                     (("indexer", b) for b in indexer if b >= 0)))


@attrs.frozen
class ReadTicket:
    """One read in flight and the blocks it may write."""

    number: int
    blocks: frozenset[Block]


class DestinationRevokedError(Exception):
    """A read would write a revoked block; the message names them."""


class DestinationLedger:
    """Thread-safe ledger of reads in flight, quarantines and revocations (module docstring)."""

    def __init__(self, quarantine_s: float = DEFAULT_QUARANTINE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not quarantine_s >= 0:
            raise ValueError(f"quarantine_s must be >= 0 seconds, got {quarantine_s!r}")
        self.quarantine_s = quarantine_s
        self._clock = clock
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._in_flight: dict[int, frozenset[Block]] = {}
        self._writers: dict[Block, int] = {}  # block -> reads in flight into it
        self._quarantine: dict[Block, float] = {}  # block -> untouchable until
        self._revoked: set[Block] = set()
        self.refused_reads = 0
        """Reads refused because they would have written a revoked block."""

    def begin_read(self, targets: frozenset[Block]) -> ReadTicket:
        """Record a read into ``targets``; DestinationRevokedError if one is revoked.

        A quarantined block may be read into again (the new read rewrites it; the quarantine
        still holds its hand-back).
        """
        with self._lock:
            hit = targets & self._revoked
            if hit:
                self.refused_reads += 1
                shown = sorted(hit)[:8]
                raise DestinationRevokedError(
                    f"read refused: it would write block(s) {shown} of a destination that was "
                    f"revoked (request given up or aborted)")
            ticket = ReadTicket(next(self._numbers), targets)
            self._in_flight[ticket.number] = targets
            for block in targets:
                self._writers[block] = self._writers.get(block, 0) + 1
            return ticket

    def end_read(self, ticket: ReadTicket, *, failed: bool) -> None:
        """The read returned; ``failed``: slices of it may still land (quarantine)."""
        now = self._clock()
        with self._lock:
            if self._in_flight.pop(ticket.number, None) is None:
                return
            for block in ticket.blocks:
                left = self._writers[block] - 1
                if left:
                    self._writers[block] = left
                else:
                    del self._writers[block]
                if failed:
                    until = now + self.quarantine_s
                    self._quarantine[block] = max(until, self._quarantine.get(block, until))

    def quarantine(self, targets: frozenset[Block]) -> None:
        """Hold ``targets`` back for the quarantine time (a failed read just wrote them)."""
        until = self._clock() + self.quarantine_s
        with self._lock:
            for block in targets:
                self._quarantine[block] = max(until, self._quarantine.get(block, until))

    def revoke(self, targets: Iterable[Block]) -> None:
        """No read may start into ``targets`` until ``restore``. Never waits."""
        with self._lock:
            self._revoked.update(targets)

    def restore(self, targets: Iterable[Block]) -> None:
        """``targets`` belong to a new destination: reads into them are allowed again."""
        with self._lock:
            self._revoked.difference_update(targets)

    def settled(self, targets: Iterable[Block]) -> bool:
        """True when no read is in flight into ``targets`` and no quarantine covers them:
        they may be handed back to their allocator."""
        now = self._clock()
        with self._lock:
            for block in targets:
                if block in self._writers:
                    return False
                until = self._quarantine.get(block)
                if until is not None:
                    if until > now:
                        return False
                    del self._quarantine[block]
            return True

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)
