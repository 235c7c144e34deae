"""What each step of a decode pull's state machine means for the decode receiver.

kvo_transport.pull_lifecycle is the machine; ``DecodePulls`` drives it against the rank's
``DecodeReceiver``, and is the one owner of every request's pull on the decode rank:
registering a destination restores its blocks in the destination ledger and fails the pull at
once when the request was lost before (``DecodeReceiver.aborted``); a pull that fails, passes
its deadline or is stopped is revoked (no read may start into its blocks; never waits for a
read in flight) and forgotten by the receive ledger, a failed one with the blocks its reads
named; a returning pull is returned once no read can write its blocks (``settled``). A pull
received or returned is announced to ``on_written`` (its blocks were written, or may have
been), then reported once. The engine's worker registers, stops and collects, and maps what
``collect`` reports onto its engine's finished requests and invalid blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import attrs

from kvo_transport.decode_side import DecodeReceiver
from kvo_transport.pull_lifecycle import DeadlinePolicy, PullTable, RequestPull
from kvo_transport.read_plan import RequestDestination

log = logging.getLogger("kvo.transport.decode")


@attrs.define
class PullCounts:
    """Pulls since start-up, by what became of them (the decode's stats file and metrics)."""

    registered: int = 0
    received: int = 0
    failed: int = 0
    deadline_failures: int = 0
    revoked: int = 0
    invalid_blocks_reported: int = 0


class DecodePulls:
    """Every request's pull on one decode rank, from registration to its one report.

    The receiver is attached once it exists (``attach``); until then nothing is revoked or
    looked up in it. Registration, stops and collection come from one thread (the engine's
    step); the receiver's thread calls ``resolve`` and ``on_invalid``.
    """

    def __init__(self, deadlines: DeadlinePolicy) -> None:
        self.table = PullTable(deadlines)
        self.counts = PullCounts()
        self._on_written: Callable[[tuple[int, ...]], None] | None = None
        self._receiver: DecodeReceiver | None = None
        self._indexer = False

    def attach(self, receiver: DecodeReceiver, *, indexer: bool,
               on_written: Callable[[tuple[int, ...]], None] | None = None) -> None:
        """Serve through ``receiver``; ``indexer``: the layers have an indexer cache (its
        blocks are the main ones: one block table); ``on_written``: told the blocks of each
        pull received or returned (step thread, before the pull is reported)."""
        self._receiver, self._indexer, self._on_written = receiver, indexer, on_written

    # -- the receiver's thread ------------------------------------------------------------

    def resolve(self, transfer_id: str) -> RequestDestination | None:
        """The receiver's resolver: a live pull's destination, or None."""
        return self.table.resolve(transfer_id)

    def on_invalid(self, transfer_id: str, layer: int, main: tuple[int, ...],
                   indexer: tuple[int, ...], reason: str) -> None:
        """A layer of the pull failed: no later READY may write its destination."""
        pull = self.table.pull(transfer_id)
        if pull is not None and self._receiver is not None:
            self._receiver.revoke(*self._blocks(pull.destination))

    # -- the engine's step ----------------------------------------------------------------

    def register(self, transfer_id: str, request_id: str,
                 destination: RequestDestination) -> bool:
        """A request's destination is known: whether its pull goes ahead (False: the prefill
        gave it up, or this rank refused a READY of it, before: it failed at once)."""
        if self._receiver is not None:
            self._receiver.restore(*self._blocks(destination))
        self.table.register(transfer_id, request_id, destination)
        self.counts.registered += 1
        lost = None if self._receiver is None else self._receiver.aborted(transfer_id)
        if lost is None:
            return True
        self._fail(transfer_id, lost)
        return False

    def stop(self, request_id: str, reason: str) -> None:
        """The engine aborted ``request_id``: stop its pulls; it is answered once."""
        stopped, reported = self.table.stop(request_id)
        if not stopped:
            # Never registered: it is answered once all the same, unless it is already on its
            # way back. Already reported: vLLM has that answer in an output it had not
            # processed when it aborted the request, and frees the request when it does; a
            # second answer for a request vLLM no longer knows would fail its scheduler's
            # ``assert req_id in self.requests``.
            if reported:
                log.debug("kvo remote_d2h: abort of %s after its pull was reported: nothing "
                          "to stop", request_id)
            return
        for pull in stopped:
            self._stop_reads(pull)
        self.counts.revoked += 1
        self._return_settled()
        log.info("kvo remote_d2h: pull of request %s stopped: %s", request_id, reason)

    def collect(self, wait_s: float = 0.0) -> list[RequestPull]:
        """Pulls received or returned since the last call (each once; with ``wait_s``, after
        waiting that long at most for one to end)."""
        receiver = self._receiver
        if receiver is None:
            return []
        if wait_s > 0:
            receiver.wait_finished(wait_s)
        finished, failed = receiver.pop_finished()
        for transfer_id in finished:
            pull = self.table.deliver(transfer_id)
            if pull is not None:  # else stopped or expired earlier; already answered
                self._written(pull)
                self.counts.received += 1
        for transfer_id, reason in failed.items():
            self._fail(transfer_id, reason)
        for pull in self.table.expire():
            self._stop_reads(pull)
            self.counts.deadline_failures += 1
            _log_failed(pull)
        self._return_settled()
        return self.table.report()

    def _fail(self, transfer_id: str, reason: str) -> None:
        pull = self.table.fail(transfer_id, reason)
        if pull is None:
            return  # stopped or expired earlier; already answered
        if self._receiver is not None:
            self._receiver.revoke(*self._blocks(pull.destination))
            found = self._receiver.invalid_blocks(transfer_id)
            self._receiver.forget(transfer_id)
            pull.name_invalid(set(found.main) | set(found.indexer))  # one block table
        _log_failed(pull)
        self._return_settled()

    def _stop_reads(self, pull: RequestPull) -> None:
        """No read may start into the pull's blocks; the receiver forgets the request."""
        if self._receiver is not None:
            self._receiver.revoke(*self._blocks(pull.destination))
            self._receiver.forget(pull.transfer_id)

    def _return_settled(self) -> None:
        """Returning pulls whose blocks no read can write any more are returned (never
        waits): a failed one with its invalid blocks."""
        receiver = self._receiver
        returned = self.table.settle(
            lambda pull: receiver is None or receiver.settled(*self._blocks(pull.destination)))
        for pull in returned:  # settled: no late slice can land after this
            self._written(pull)
            if pull.reason is not None:
                self.counts.failed += 1
                self.counts.invalid_blocks_reported += len(pull.invalid)

    def _written(self, pull: RequestPull) -> None:
        if self._on_written is not None:
            self._on_written(pull.destination.main_block_ids)

    def _blocks(self, destination: RequestDestination
                ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(main, indexer) blocks of a destination (one block table for both parts)."""
        main = destination.main_block_ids
        return main, main if self._indexer else ()


def _log_failed(pull: RequestPull) -> None:
    log.warning("kvo remote_d2h: pull of request %s (transfer %s) failed, %d block(s) go to "
                "vLLM's load-failure path once no read can write them: %s", pull.request_id,
                pull.transfer_id, len(pull.invalid), pull.reason)


def invalid_blocks(pulls: Iterable[RequestPull]) -> set[int]:
    """The blocks the engine must not use among reported ``pulls``: the failed ones'."""
    return {block for pull in pulls if pull.reason is not None for block in pull.invalid}
