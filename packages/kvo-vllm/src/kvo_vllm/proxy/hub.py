"""Where notifications from the engines meet the requests waiting for them.

Each proxied request registers its transfer id before the decode sees it. The decode ranks
POST ``DecodeReady`` once their destination blocks are registered (one per decode TP rank);
when all ranks have answered, the request's ``ready`` future resolves with the endpoints the
prefill must publish to. A prefill that cannot hand the request off POSTs ``PrefillFailed``;
that resolves the request's ``failed`` future with the reason. Everything runs on the proxy's
event loop.
"""

from __future__ import annotations

import asyncio
import time

import attrs

from kvo_vllm.remote_d2h.params import DecodeReady, PrefillFailed, TransferParamsError


@attrs.frozen
class DecodeTopology:
    """Where one request's KV goes: decode rank d's control endpoint at index d."""

    endpoints: tuple[str, ...]
    skip_blocks: int
    num_blocks: int


@attrs.define
class _Waiting:
    ready: asyncio.Future[DecodeTopology]
    failed: asyncio.Future[str]
    ranks: dict[int, DecodeReady] = attrs.Factory(dict)
    created: float = attrs.Factory(time.monotonic)


class NotifyHub:
    """Transfer id -> futures for the decode's readiness and a prefill failure."""

    def __init__(self) -> None:
        self._waiting: dict[str, _Waiting] = {}
        self.endpoints_seen: dict[int, str] = {}
        self.decode_tp: int | None = None
        self.unknown_notifications = 0

    def expect(self, transfer_id: str) -> tuple[asyncio.Future[DecodeTopology],
                                                asyncio.Future[str]]:
        loop = asyncio.get_running_loop()
        waiting = _Waiting(ready=loop.create_future(), failed=loop.create_future())
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
        self.endpoints_seen[note.d_rank] = note.endpoint
        self.decode_tp = note.decode_tp
        waiting.ranks[note.d_rank] = note
        if len(waiting.ranks) == note.decode_tp and not waiting.ready.done():
            notes = [waiting.ranks[d] for d in range(note.decode_tp) if d in waiting.ranks]
            if len(notes) != note.decode_tp:
                waiting.ready.set_exception(TransferParamsError(
                    f"transfer {note.transfer_id}: decode ranks disagree on the TP size"))
                return True
            skips = {n.skip_blocks for n in notes}
            if len(skips) != 1:
                waiting.ready.set_exception(TransferParamsError(
                    f"transfer {note.transfer_id}: decode ranks report different cached "
                    f"prefixes {sorted(skips)}"))
                return True
            waiting.ready.set_result(DecodeTopology(
                endpoints=tuple(n.endpoint for n in notes), skip_blocks=skips.pop(),
                num_blocks=notes[0].num_blocks))
        return True

    def __len__(self) -> int:
        return len(self._waiting)
