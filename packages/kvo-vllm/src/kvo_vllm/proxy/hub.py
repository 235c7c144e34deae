"""Where notifications from the engines meet the requests waiting for them.

Each proxied request registers its transfer id before the decode sees it. The decode ranks
POST ``DecodeReady`` once their destination blocks are registered (one per TP rank of the decode
DP rank that took the request); when all of that DP rank's TP ranks have answered, the request's
``ready`` future resolves with the endpoints the prefill must publish to. A prefill that cannot
hand the request off POSTs ``PrefillFailed``; that resolves the request's ``failed`` future with
the reason. A request whose prefill was posted at once (to endpoints the proxy already knew)
registers those endpoints: should the advertisement name others (another DP rank took the
request), ``failed`` resolves at once instead of the prefill's layers waiting for a reader that
never comes. Everything runs on the proxy's event loop.
"""

from __future__ import annotations

import asyncio
import time

import attrs

from kvo_vllm.remote_d2h.params import DecodeReady, PrefillFailed, TransferParamsError


@attrs.frozen
class DecodeTopology:
    """Where one request's KV goes: TP rank d's control endpoint (of the DP rank that took the
    request) at index d."""

    endpoints: tuple[str, ...]
    skip_blocks: int
    num_blocks: int
    dp_rank: int = 0
    dp_size: int = 1


@attrs.define
class _Waiting:
    ready: asyncio.Future[DecodeTopology]
    failed: asyncio.Future[str]
    sent_to: tuple[str, ...] | None = None
    """The endpoints the prefill was already told (a concurrent post), else None."""
    ranks: dict[int, DecodeReady] = attrs.Factory(dict)
    created: float = attrs.Factory(time.monotonic)


class NotifyHub:
    """Transfer id -> futures for the decode's readiness and a prefill failure."""

    def __init__(self) -> None:
        self._waiting: dict[str, _Waiting] = {}
        self.endpoints_seen: dict[tuple[int, int], str] = {}
        """(DP rank, TP rank) -> the control endpoint it last advertised."""
        self.decode_tp: int | None = None
        self.unknown_notifications = 0

    def expect(self, transfer_id: str, sent_to: tuple[str, ...] | None = None
               ) -> tuple[asyncio.Future[DecodeTopology], asyncio.Future[str]]:
        """Futures for the request's readiness and a failed hand-off. ``sent_to``: the
        endpoints its prefill is posted to before decode advertised (checked on arrival)."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting(ready=loop.create_future(), failed=loop.create_future(),
                           sent_to=sent_to)
        self._waiting[transfer_id] = waiting
        return waiting.ready, waiting.failed

    def forget(self, transfer_id: str) -> None:
        waiting = self._waiting.pop(transfer_id, None)
        if waiting is not None:
            for future in (waiting.ready, waiting.failed):
                if not future.done():
                    future.cancel()

    def deliver(self, note: DecodeReady | PrefillFailed) -> bool:
        """Apply one notification; False when no request waits for its transfer id."""
        waiting = self._waiting.get(note.transfer_id)
        if waiting is None:
            self.unknown_notifications += 1
            return False
        if isinstance(note, PrefillFailed):
            if not waiting.failed.done():
                waiting.failed.set_result(note.error)
            return True
        self.endpoints_seen[(note.dp_rank, note.d_rank)] = note.endpoint
        self.decode_tp = note.decode_tp
        if waiting.ready.done():
            return True
        other_dp = {n.dp_rank for n in waiting.ranks.values()} - {note.dp_rank}
        if other_dp:
            self._fail(waiting, TransferParamsError(
                f"transfer {note.transfer_id}: decode DP ranks {sorted(other_dp)} and "
                f"{note.dp_rank} both advertised a destination for it; one request is taken "
                f"by one DP rank"))
            return True
        waiting.ranks[note.d_rank] = note
        if len(waiting.ranks) == note.decode_tp:
            notes = [waiting.ranks[d] for d in range(note.decode_tp) if d in waiting.ranks]
            if len(notes) != note.decode_tp:
                self._fail(waiting, TransferParamsError(
                    f"transfer {note.transfer_id}: decode ranks disagree on the TP size"))
                return True
            skips = {n.skip_blocks for n in notes}
            if len(skips) != 1:
                self._fail(waiting, TransferParamsError(
                    f"transfer {note.transfer_id}: decode ranks report different cached "
                    f"prefixes {sorted(skips)}"))
                return True
            topology = DecodeTopology(
                endpoints=tuple(n.endpoint for n in notes), skip_blocks=skips.pop(),
                num_blocks=notes[0].num_blocks, dp_rank=note.dp_rank, dp_size=note.dp_size)
            waiting.ready.set_result(topology)
            if (waiting.sent_to is not None and topology.endpoints != waiting.sent_to
                    and not waiting.failed.done()):
                waiting.failed.set_result(
                    f"decode DP rank {topology.dp_rank} took the request and advertised "
                    f"{list(topology.endpoints)}, but the prefill was already sent to "
                    f"{list(waiting.sent_to)}")
        return True

    @staticmethod
    def _fail(waiting: _Waiting, error: TransferParamsError) -> None:
        """Readiness that cannot be trusted: the request fails (a posted prefill too)."""
        waiting.ready.set_exception(error)
        if not waiting.failed.done():
            waiting.failed.set_result(str(error))

    def __len__(self) -> int:
        return len(self._waiting)
