"""READYs that arrive before decode has registered their request's destination.

When the proxy posts a request to prefill and decode at once (it knows the decode's control
endpoints from an earlier request), prefill may publish a layer before decode's scheduler has
allocated and registered the request's blocks. Such a READY is kept here instead of being
refused, and read once the destination appears, for at most ``wait_s``; after that it is
handed back to be refused as an unknown request always was.

Order: a prefill connection's READYs are read in the order it published them (the receiver
relies on it: when a request's last layer is read, every earlier one was). So once one READY
of a connection waits here, every later READY of that connection waits behind it.

Safety: waiting changes nothing about what is accepted. The read that follows is fenced like
any other (the prefill's epoch words must still hold the READY's epochs after the data read),
so a READY whose buffer prefill reused while it waited fails; it never yields stale bytes.

A request decode will not pull (it computes the prompt itself: ``decline``) is not waited for;
nor is one that had a destination and no longer has one (released). Pure bookkeeping: the
receiver's thread owns it; only ``decline`` may be called from another thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable

import attrs

from kvo_transport.protocol import ReadReadyBatch
from kvo_transport.read_plan import RequestDestination

MAX_PARKED = 4096
"""READYs kept at once on one decode rank; beyond it a READY is refused at once."""
REMEMBERED_IDS = 65536
"""Request ids remembered as registered once, or declined (the oldest forgotten first)."""


@attrs.define
class _Parked:
    batch: ReadReadyBatch
    since: float


class ReadyParking:
    """READYs waiting for their destination, per prefill connection, in arrival order."""

    def __init__(self, wait_s: float, max_parked: int = MAX_PARKED,
                 remembered: int = REMEMBERED_IDS) -> None:
        if not wait_s >= 0:
            raise ValueError(f"wait_s must be >= 0 seconds, got {wait_s!r}")
        self.wait_s = wait_s
        self._max_parked = max_parked
        self._remembered = remembered
        self._queues: dict[bytes, deque[_Parked]] = {}
        self._count = 0
        self._registered: OrderedDict[str, None] = OrderedDict()
        self._declined: OrderedDict[str, None] = OrderedDict()
        self._declined_lock = threading.Lock()
        self.parked = 0
        """READYs that waited here (for tests and metrics)."""
        self.expired = 0
        """READYs whose destination did not appear within ``wait_s`` (then refused)."""

    def __len__(self) -> int:
        return self._count

    def decline(self, request_id: str) -> None:
        """Decode computes ``request_id`` itself: its READYs are read as wanting nothing."""
        with self._declined_lock:
            _remember(self._declined, request_id, self._remembered)

    def destination(self, request_id: str, resolve: Callable[[str], RequestDestination | None]
                    ) -> RequestDestination | None:
        """``resolve``'s answer, or the empty destination of a declined request."""
        target = resolve(request_id)
        if target is not None:
            _remember(self._registered, request_id, self._remembered)
            return target
        with self._declined_lock:
            declined = request_id in self._declined
        return RequestDestination.nothing() if declined else None

    def _waiting_for_destination(self, batch: ReadReadyBatch,
                                 resolve: Callable[[str], RequestDestination | None]) -> bool:
        """Some request of ``batch`` has no destination yet and may still get one."""
        return any(self.destination(r.request_id, resolve) is None
                   and r.request_id not in self._registered for r in batch.requests)

    def offer(self, identity: bytes, batch: ReadReadyBatch, now: float,
              resolve: Callable[[str], RequestDestination | None]) -> bool:
        """Keep ``batch`` (True) or let the caller read it now (False): it is kept when its
        connection already has READYs waiting, or when it waits for a destination itself."""
        queue = self._queues.get(identity)
        if queue is None and not self._waiting_for_destination(batch, resolve):
            return False
        if self._count >= self._max_parked:
            return False  # read now: an unknown request is refused there
        if queue is None:
            queue = self._queues[identity] = deque()
        queue.append(_Parked(batch=batch, since=now))
        self._count += 1
        self.parked += 1
        return True

    def due(self, now: float, resolve: Callable[[str], RequestDestination | None]
            ) -> list[tuple[bytes, ReadReadyBatch, float]]:
        """(connection, READY, seconds waited) to read now, each connection's in order: those
        whose destinations appeared, or that waited ``wait_s`` (to be refused)."""
        ready: list[tuple[bytes, ReadReadyBatch, float]] = []
        for identity in list(self._queues):
            queue = self._queues[identity]
            while queue:
                head = queue[0]
                waited = now - head.since
                if self._waiting_for_destination(head.batch, resolve):
                    if waited < self.wait_s:
                        break
                    self.expired += 1
                queue.popleft()
                self._count -= 1
                ready.append((identity, head.batch, waited))
            if not queue:
                del self._queues[identity]
        return ready

    def drop(self, identity: bytes) -> list[ReadReadyBatch]:
        """Forget a connection's waiting READYs (its session was replaced); returns them."""
        queue = self._queues.pop(identity, None)
        if queue is None:
            return []
        self._count -= len(queue)
        return [p.batch for p in queue]

    def next_check_s(self, now: float, poll_s: float) -> float | None:
        """How long the receiver may sleep before calling ``due`` again (None: nothing waits).
        A destination appears without telling the receiver, so waiting READYs are looked at
        every ``poll_s`` until the first of them expires."""
        if not self._queues:
            return None
        oldest = min(q[0].since for q in self._queues.values())
        return max(0.0, min(poll_s, oldest + self.wait_s - now))


def _remember(ids: OrderedDict[str, None], request_id: str, limit: int) -> None:
    ids[request_id] = None
    ids.move_to_end(request_id)
    while len(ids) > limit:
        ids.popitem(last=False)
