"""Prefill side of the control plane: handshake, publish each layer, collect the answers.

The caller's thread sends READYs itself (no hand-off on the latency path); one I/O thread
receives every answer. ZMQ sockets are not thread-safe, so each socket is used only under its
connection's lock, and the I/O thread sleeps on the sockets' notification file descriptors
(``zmq.FD``, in an epoll set) rather than in zmq_poll, which would touch the sockets without the
lock. The I/O thread turns READ_DONE / READ_FAILED into ``SlotGates`` reports (the physical
buffer may be reused once every reader answered) and into ``RequestCompletionTracker`` reports
(the request's sends are over). Every published layer has a deadline: a READ_DONE that never
comes (lost, or the decode died) fails the slot with LayerDeadlineError instead of hanging the
prefill forever.

A session that stops working is rebuilt, never left half-dead: when a READY misses its deadline,
or the decode says it no longer knows the session (RESET, or READ_FAILED asking for a
handshake), everything in flight there fails, the connection is closed and a new one (with a
new ZMQ routing id) handshakes at once. So after any single fault a prefill-decode pair is
usable again within one layer deadline plus one handshake; a decode that stays silent costs a
caller that publishes to it a handshake timeout, then a clear error (HandshakeTimeoutError).

Fences (kvo_transport.fence): every READY carries the epoch of each word guarding its source:
the slot's word (advanced by the slot gates when a round fails, before the slot can be reused;
the publisher attaches its words to the gates it is given) and each request's lease word
(advanced when a READY of the request fails, and by ``release`` when the request's blocks go
back to their allocator). The decode checks the words after its read and refuses a changed one.

The publisher is also a ``kvo_core.gates.GatePump``: a thread waiting on a slot gate may handle
the answers itself (``pump``). While it does, the sockets are taken out of the I/O thread's
epoll set, so only one thread wakes per answer; that removes the I/O thread -> waiter hand-off
(two thread wake-ups) from the READY -> DONE round trip.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import attrs
import zmq

from kvo_core.errors import ConfigError
from kvo_core.gates import RequestCompletionTracker, SlotGates, SlotKey
from kvo_core.tp import TPMapping
from kvo_transport.engine import TransferEngine
from kvo_transport.errors import HandshakeTimeoutError, LayerDeadlineError, ProtocolError
from kvo_transport.fence import FenceWords
from kvo_transport.frame_auth import (
    OVERHEAD,
    AuthCounters,
    FrameRejectedError,
    Kind,
    PrefillChannel,
    control_key,
    endpoint_host,
    require_secret_beyond_loopback,
)
from kvo_transport.protocol import (
    MAX_BLOCK_IDS_PER_REQUEST,
    MAX_FRAME_BYTES,
    MAX_ID_CHARS,
    MAX_REQUESTS_PER_BATCH,
    PROTOCOL_VERSION,
    Fence,
    FrameDecoder,
    HandshakeAnswer,
    LayerMeta,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadyRequest,
    SendAborted,
    clip_reason,
    encode,
)
from kvo_transport.ready_ledger import Outcome, PendingReady, ReadyLedger

log = logging.getLogger("kvo.transport.prefill")
RENEWAL_WAIT_S = 5.0
"""The least time one caller waits for a renewed session's handshake (a layer deadline when
longer): a decode that is only busy answers within it, a silent one costs the prefill that once."""

_EVENTS = int(zmq.EVENTS)  # plain ints: pyzmq's enum arithmetic costs microseconds per call
_POLLIN = int(zmq.POLLIN)
_FD = int(zmq.FD)

_instances = itertools.count()


class HandshakeRejectedError(ProtocolError):
    """The decode rank refused the MF_META handshake; the message carries its reason."""


class PublisherClosedError(ProtocolError):
    """The publisher was closed; nothing more can be published."""


@attrs.frozen
class PublishedLayer:
    """What one ``publish_layer`` call sent: per decode endpoint, the batch seq and gate part."""

    layer_index: int
    slot_key: SlotKey
    seqs: dict[str, int]
    parts: dict[str, str]


@attrs.define(eq=False)
class _Connection:
    """A DEALER socket and the lock that every use of it holds."""

    endpoint: str
    socket: zmq.Socket[bytes]
    fd: int
    number: int
    """Tells this connection from earlier and later ones to the same endpoint."""
    channel: PrefillChannel
    """Seals and opens this connection's frames (frame_auth); used under ``lock``."""
    lock: threading.Lock = attrs.Factory(threading.Lock)
    closed: bool = False


@attrs.define(eq=False)
class _Peer:
    endpoint: str
    connection: _Connection
    answered: threading.Event = attrs.Factory(threading.Event)
    answer: HandshakeAnswer | None = None
    renewed_because: str | None = None
    """Why the session before this one was torn down; None for a first handshake."""
    renewal_waited: bool = False
    """A caller already waited its bounded time for this renewed handshake, in vain."""
    pending_aborts: list[tuple[tuple[str, ...], str]] = attrs.Factory(list)
    """SEND_ABORTEDs (request ids, reason) to send once this handshake is accepted."""


class PrefillPublisher:
    """One prefill rank's side of the control plane (see the module docstring).

    ``layers`` describe this rank's exposed buffers (MF_META); ``gates`` is the slot-gate
    table the layer pipeline waits on (``fences`` is attached to it), or None when nothing
    reuses the buffers (no slot is reported; requests' lease words still guard their blocks);
    ``fences`` are this rank's epoch words, registered with its engine; ``tracker``
    (optional) receives per-request completion under the part name ``request_part``
    (expected automatically unless ``auto_expect`` is False, in which case the caller expects
    it together with its own parts).
    ``control_secret`` (else ``$KVO_CONTROL_SECRET``) authenticates every frame (frame_auth);
    without one, only loopback decode endpoints are accepted.
    """

    def __init__(self, *, engine_session_id: str, backend: str, transfer_protocol: str,
                 instance_id: str, prefill_tp: int, p_rank: int, decode_tp: int,
                 layers: Sequence[LayerMeta], gates: SlotGates | None, fences: FenceWords,
                 tracker: RequestCompletionTracker | None = None,
                 handshake_timeout_s: float = 100.0, layer_deadline_s: float = 60.0,
                 max_frame_bytes: int = MAX_FRAME_BYTES, request_part: str = "remote-read",
                 auto_expect: bool = True, control_secret: str | None = None) -> None:
        for name, value in (("handshake_timeout_s", handshake_timeout_s),
                            ("layer_deadline_s", layer_deadline_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        self.mapping = TPMapping(prefill_tp, decode_tp)
        self.p_rank = p_rank
        self.member = self.mapping.member(p_rank)
        self.layers = tuple(layers)
        self.meta = MfMeta(version=PROTOCOL_VERSION, instance_id=instance_id,
                           engine_session_id=engine_session_id, backend=backend,
                           transfer_protocol=transfer_protocol, p_tp_size=prefill_tp,
                           p_rank=p_rank, member=self.member, ratio=self.mapping.ratio,
                           d_rank=self.mapping.decode_rank(p_rank), layers=self.layers,
                           fence_addr=fences.address, fence_words=fences.capacity)
        self._meta_frame = encode(self.meta)
        try:  # what the decode would refuse is refused here, naming the problem
            FrameDecoder().decode(self._meta_frame)
        except ProtocolError as exc:
            raise ConfigError(f"this rank's MF_META is not valid: {exc}") from None
        self.handshake_timeout_s = handshake_timeout_s
        self.layer_deadline_s = layer_deadline_s
        self._max_frame_bytes = max_frame_bytes
        self._decoder = FrameDecoder(max_frame_bytes)
        self._gates = gates
        self.fences = fences
        self._own_fences = False
        if gates is not None:  # a slot round that fails advances the slot's word
            gates.attach_fence(fences)
        self._tracker = tracker
        self._request_part = request_part
        self._auto_expect = auto_expect
        self._label = f"{instance_id} rank {p_rank}/{prefill_tp}"
        self._control_key = control_key(control_secret)
        self.auth_rejections = AuthCounters()
        """Answer frames refused by authentication, by reason."""

        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._ledger = ReadyLedger()  # READYs in flight, deadlines, requests' sends (lock)
        self._io_sleep_until = 0.0  # when the I/O thread looks at the deadlines next
        self._seqs = itertools.count()  # one counter for all peers: keys stay unique on reconnect
        self._connection_numbers = itertools.count(1)
        self.renewed_sessions = 0
        """Sessions torn down and handshaken again on a new connection (for tests/metrics)."""
        self._closed = False

        self._context = zmq.Context()
        self._new_connections: list[_Connection] = []
        self._dropped_connections: list[_Connection] = []
        self._live: dict[int, _Connection] = {}  # fd -> connection, owned by the I/O thread
        self._epoll = select.epoll()
        self._wake_read, self._wake_write = _nonblocking_pipe()
        self._epoll.register(self._wake_read, select.EPOLLIN)
        self._pump_lock = threading.Lock()
        self._interrupt_read, self._interrupt_write = _nonblocking_pipe()
        self._thread = threading.Thread(target=self._io_loop, name=f"kvo-prefill-{p_rank}",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def for_engine(cls, engine: TransferEngine, **kwargs: object) -> PrefillPublisher:
        """A publisher whose session id, backend and protocol come from ``engine``; without
        ``fences`` it makes (and closes) its own, registered with ``engine``."""
        own = "fences" not in kwargs
        if own:
            kwargs["fences"] = FenceWords(engine=engine)
        try:
            publisher = cls(engine_session_id=engine.session_id, backend=engine.backend,
                            transfer_protocol=engine.protocol, **kwargs)  # type: ignore[arg-type]
        except BaseException:
            if own:
                kwargs["fences"].close()  # type: ignore[attr-defined]
            raise
        publisher._own_fences = own
        return publisher

    # -- handshake ------------------------------------------------------------------------------

    def connect(self, endpoint: str, timeout_s: float | None = None) -> None:
        """Handshake with the decode rank at ``endpoint`` (no-op when already accepted).

        Raises HandshakeTimeoutError naming the endpoint when no answer comes within
        ``timeout_s`` (default: the publisher's handshake timeout), HandshakeRejectedError
        with the decode's reason when it refuses.
        """
        self._connect(endpoint, timeout_s)

    def _connect(self, endpoint: str, timeout_s: float | None = None) -> _Peer:
        timeout = self.handshake_timeout_s if timeout_s is None else timeout_s
        with self._lock:
            self._check_open()
            peer = self._peers.get(endpoint)
            if peer is not None and peer.answer is not None and peer.answer.accepted:
                return peer  # the common case: already shaken hands
            fresh = peer is None
            renewing = peer is not None and peer.renewed_because is not None
            if renewing:
                # A renewed session's handshake is already on its way. A live decode answers it
                # within a layer deadline (or RENEWAL_WAIT_S, for a busy one); a silent one must
                # not stall the prefill's steps for a handshake timeout per request: one caller
                # waits that long, later ones fail at once until the decode answers.
                assert peer is not None
                timeout = 0.0 if peer.renewal_waited else min(
                    timeout, max(self.layer_deadline_s, RENEWAL_WAIT_S))
            if peer is None:
                require_secret_beyond_loopback(
                    self._control_key, endpoint_host(endpoint),
                    f"prefill {self._label} connecting to decode control endpoint {endpoint}")
                peer = _Peer(endpoint=endpoint, connection=self._open(endpoint))
                self._peers[endpoint] = peer
                self._new_connections.append(peer.connection)
        if fresh:
            log.info("prefill %s: handshake with %s (%d layers, engine %s)", self._label,
                     endpoint, len(self.layers), self.meta.engine_session_id)
            self._wake()
            self._send(peer.connection, self._meta_frame, hello=True)
        if not peer.answered.wait(timeout):
            if renewing:  # keep the pending handshake: the decode may still answer it
                peer.renewal_waited = True
                raise HandshakeTimeoutError(
                    f"decode control endpoint {endpoint} has not answered prefill "
                    f"{self._label}'s new handshake within {timeout:g} s (its previous session "
                    f"ended: {peer.renewed_because}); requests to it fail until it answers")
            self._drop_peer(peer)
            raise HandshakeTimeoutError(
                f"decode control endpoint {endpoint} did not answer the MF_META handshake of "
                f"prefill {self._label} within {timeout:g} s (is the decode rank running and "
                f"listening on that port, with the same control secret?)")
        answer = peer.answer
        if answer is None:  # dropped by a concurrent caller or by close()
            raise HandshakeRejectedError(f"handshake with {endpoint} was abandoned")
        if not answer.accepted:
            self._drop_peer(peer)
            raise HandshakeRejectedError(
                f"decode at {endpoint} rejected the handshake of prefill {self._label}: "
                f"{answer.reason}")
        return peer

    def is_connected(self, endpoint: str) -> bool:
        with self._lock:
            peer = self._peers.get(endpoint)
            return peer is not None and peer.answer is not None and peer.answer.accepted

    def _open(self, endpoint: str) -> _Connection:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        # A readable id: the decode's logs name the prefill rank; kept across reconnects.
        socket.setsockopt(zmq.ROUTING_ID,
                          f"{self._label}/{os.urandom(4).hex()}".encode()[:255])
        socket.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
        socket.connect(endpoint)
        return _Connection(endpoint=endpoint, socket=socket, fd=cast(int, socket.getsockopt(_FD)),
                           number=next(self._connection_numbers),
                           channel=PrefillChannel(self._control_key, self.auth_rejections))

    def _drop_peer(self, peer: _Peer) -> None:
        with self._lock:
            if self._peers.get(peer.endpoint) is not peer:
                return
            del self._peers[peer.endpoint]
            self._dropped_connections.append(peer.connection)
        peer.answered.set()
        self._wake()

    # -- publishing -------------------------------------------------------------------------------

    def ready_request(self, request_id: str, start_block: int, main_block_ids: Sequence[int],
                      indexer_block_ids: Sequence[int] = ()) -> ReadyRequest:
        """This rank's share of a request's chunk ``[start_block, start_block + n)``.

        ``main_block_ids`` / ``indexer_block_ids`` are the chunk's source blocks on this rank
        (the indexer list is empty for layers without an indexer, else one id per block).
        Member 0 sends the main blocks; each member sends its indexer slice.
        """
        count = len(main_block_ids)
        if indexer_block_ids and len(indexer_block_ids) != count:
            raise ValueError(f"request {request_id!r}: {len(indexer_block_ids)} indexer block "
                             f"ids for a chunk of {count} blocks")
        begin, end = self.mapping.indexer_range(self.p_rank, start_block, count)
        indexer = tuple(indexer_block_ids[begin - start_block:end - start_block]
                        if indexer_block_ids else ())
        return ReadyRequest(
            request_id=request_id, main_start_block=start_block, num_blocks=count,
            main_block_ids=tuple(main_block_ids) if self.member == 0 else (),
            indexer_start_block=begin, indexer_block_ids=indexer)

    def publish_layer(self, layer_index: int, slot_key: SlotKey,
                      requests_by_endpoint: Mapping[str, Sequence[ReadyRequest]],
                      last_layer_request_ids: Iterable[str] = (),
                      extra_parts: Iterable[str] = (),
                      deadline_s: float | None = None,
                      slot_part: str | None = None) -> PublishedLayer:
        """Tell each decode endpoint that layer ``layer_index`` may be read now.

        The reads are one part per endpoint of the slot's gate. With ``slot_part`` (a part the
        slot's owner announced or closed, kvo_core.gates ``join``) they are joined into that
        part and the round is the owner's; without it the publisher closes the slot's round
        with them (plus ``extra_parts``, e.g. the store save, which the caller reports itself).
        Sends one READ_READY_BATCH per endpoint and returns at once; the I/O thread reports each
        answer to the gate. Endpoints not yet connected are connected first (blocking up to the
        handshake timeout).
        """
        if not 0 <= layer_index < len(self.layers):
            raise ValueError(f"layer_index {layer_index} is out of range: this rank exposes "
                             f"{len(self.layers)} layers")
        layer = self.layers[layer_index]
        last = frozenset(last_layer_request_ids)
        if last:
            known = {r.request_id for batch in requests_by_endpoint.values() for r in batch}
            if not last <= known:
                raise ValueError(f"last_layer_request_ids {sorted(last - known)} are not "
                                 f"published in this layer")
        for requests in requests_by_endpoint.values():
            _check_requests(requests)
        extra_parts = tuple(extra_parts)
        if slot_part is not None and extra_parts:
            raise ValueError(f"extra_parts {list(extra_parts)} belong to the round's owner: "
                             f"with slot_part {slot_part!r} the publisher closes no round")
        deadline_s = self.layer_deadline_s if deadline_s is None else deadline_s
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 seconds, got {deadline_s!r}")
        peers = {endpoint: self._connect(endpoint) for endpoint in requests_by_endpoint}
        frames: list[tuple[_Peer, int, bytes, tuple[str, ...], tuple[int, ...]]] = []
        slot_word = self.fences.slot_word(slot_key)
        with self._lock:
            self._check_open()
            for endpoint, requests in requests_by_endpoint.items():
                peer = peers[endpoint]
                seq = next(self._seqs)
                ids = tuple(r.request_id for r in requests)
                leases = tuple(self.fences.lease(i) for i in dict.fromkeys(ids))
                fences = tuple(Fence(word=w, epoch=self.fences.epoch(w))
                               for w in (slot_word, *leases))
                batch = ReadReadyBatch(
                    version=PROTOCOL_VERSION, seq=seq, layer_index=layer_index,
                    layer_name=layer.name, member=self.member, ratio=self.mapping.ratio,
                    requests=tuple(requests),
                    last_layer_request_ids=tuple(i for i in ids if i in last), fences=fences)
                frame = encode(batch)
                limit = self._frame_limit(peer)
                size = len(frame) + (OVERHEAD if self._control_key is not None else 0)
                if size > limit:
                    raise ProtocolError(
                        f"READY for layer {layer_index} to {endpoint} is {size} bytes, "
                        f"over the frame limit of {limit} (this rank: "
                        f"{self._max_frame_bytes}, the decode: {_decode_limit(peer)}); "
                        f"publish fewer requests per batch")
                frames.append((peer, seq, frame, ids, leases))
        parts = {peer.endpoint: _part_name(peer.endpoint, seq) for peer, seq, *_ in frames}
        if self._gates is None:
            pass
        elif slot_part is not None:
            self._gates.join(slot_key, slot_part, parts.values())
        else:
            self._gates.close(slot_key, [*parts.values(), *extra_parts])
        now = time.monotonic()
        with self._lock:
            for peer, seq, _, ids, leases in frames:
                new = self._ledger.add(PendingReady(
                    endpoint=peer.endpoint, seq=seq, layer_index=layer_index,
                    layer_name=layer.name, slot_key=slot_key, part=parts[peer.endpoint],
                    request_ids=ids, sent_at=now, deadline=now + deadline_s,
                    lease_words=leases, connection=peer.connection.number), last)
                if now + deadline_s < self._io_sleep_until:
                    self._wake()  # the I/O thread sleeps past this deadline: tell it
                    self._io_sleep_until = now
                if self._tracker is not None and self._auto_expect:
                    for request_id in new:
                        self._tracker.expect(request_id, (self._request_part,))
        for peer, seq, frame, ids, _ in frames:
            self._send(peer.connection, frame)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("prefill %s: READY layer %d (%s) seq %d -> %s, requests %s",
                          self._label, layer_index, layer.name, seq, peer.endpoint, list(ids))
        return PublishedLayer(layer_index=layer_index, slot_key=slot_key,
                              seqs={peer.endpoint: seq for peer, seq, *_ in frames},
                              parts=parts)

    def abort(self, endpoint: str, request_ids: Iterable[str], reason: str) -> bool:
        """Tell the decode rank at ``endpoint`` that these requests were given up, so it fails
        their pulls at once (SEND_ABORTED) rather than waiting for layers that will not come.

        Best effort and never blocking: while a handshake to ``endpoint`` is pending (a renewed
        session) the frame waits for its acceptance; without a session (nothing was published
        there, it went away, or the handshake was rejected) nothing is sent and False is
        returned; the decode's own deadline then still ends the pull. Answers to READYs already
        sent are unaffected.
        """
        ids = tuple(dict.fromkeys(request_ids))
        if not ids:
            return False
        with self._lock:
            if self._closed:
                return False
            peer = self._peers.get(endpoint)
            if peer is not None and peer.answer is None:
                peer.pending_aborts.append((ids, reason))
                return True
            if peer is None or peer.answer is None or not peer.answer.accepted:
                return False
        reason = clip_reason(reason)
        # Frames stay under both sides' limit (ZMQ cuts the connection over the decode's):
        # an id takes at most 4 bytes per character plus its msgpack header.
        room = (self._frame_limit(peer) - OVERHEAD - len(reason.encode()) - 64)
        per_frame = max(1, min(MAX_REQUESTS_PER_BATCH, room // (4 * MAX_ID_CHARS + 3)))
        for start in range(0, len(ids), per_frame):
            self._send(peer.connection, encode(SendAborted(
                version=PROTOCOL_VERSION, request_ids=ids[start:start + per_frame],
                reason=reason)))
        log.info("prefill %s: told %s that request(s) %s were given up: %s", self._label,
                 endpoint, list(ids[:6]), reason)
        return True

    def reads_in_flight(self) -> int:
        """READYs sent and not answered yet (nor failed)."""
        with self._lock:
            return self._ledger.in_flight()

    def _frame_limit(self, peer: _Peer) -> int:
        """The smaller of both sides' frame limits (ZMQ cuts the connection over the decode's)."""
        return min(self._max_frame_bytes, _decode_limit(peer))

    def forget(self, request_id: str) -> None:
        """Stop tracking a request (e.g. it was aborted before its last layer); its blocks
        may be reused from now on (``release``)."""
        with self._lock:
            self._ledger.forget(request_id)
        self.release(request_id)

    def release(self, request_id: str) -> None:
        """The request's source blocks go back to their allocator: a read still running
        against them fails its fence. Call it before they can be overwritten."""
        self.fences.release(request_id)

    # -- close ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the I/O thread; every READY still waiting fails its slot (never a hang)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        self._wake()
        self._thread.join()
        for peer in peers:
            peer.answered.set()
        with self._lock:
            pending = self._ledger.drain()
        for item in pending:
            self._finish(item, PublisherClosedError(
                f"publisher of {self._label} closed before {item.endpoint} answered layer "
                f"{item.layer_index} seq {item.seq}"))
        if self._own_fences:
            self.fences.close()
        with self._pump_lock:  # a pump still running in another thread ends first
            for fd in (self._wake_read, self._wake_write, self._interrupt_read,
                       self._interrupt_write):
                os.close(fd)
            self._epoll.close()
        self._context.term()

    def __enter__(self) -> PrefillPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise PublisherClosedError(f"publisher of {self._label} is closed")

    def _wake(self) -> None:
        _poke(self._wake_write)

    def interrupt(self) -> None:
        """Make a ``pump`` running in another thread return now (GatePump)."""
        _poke(self._interrupt_write)

    def _send(self, connection: _Connection, message: bytes, hello: bool = False) -> None:
        """Seal and send from the caller's thread; wake the I/O thread if an answer waits."""
        with connection.lock:
            if connection.closed:
                log.warning("prefill %s: connection to %s is closed; the READY's deadline "
                            "will fail it", self._label, connection.endpoint)
                return
            channel = connection.channel
            frame = channel.seal_hello(message) if hello else channel.seal(message)
            try:
                connection.socket.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # queue full: the deadline reports it
                log.warning("prefill %s: cannot queue a frame to %s: %s", self._label,
                            connection.endpoint, exc)
            # Any socket call may consume the FD's edge: look for input ourselves.
            waiting = bool(cast(int, connection.socket.getsockopt(_EVENTS)) & _POLLIN)
        if waiting:
            self._wake()

    # -- the I/O thread -------------------------------------------------------------------------

    def _io_loop(self) -> None:
        try:
            while True:
                events = self._epoll.poll(self._poll_timeout_s())
                woken = any(fd == self._wake_read for fd, _ in events)
                if woken:
                    _drain_pipe(self._wake_read)
                    if self._update_connections():
                        return
                    ready = list(self._live.values())  # woken by _send: look at every one
                else:
                    ready = [c for fd, _ in events if (c := self._live.get(fd)) is not None]
                for connection in ready:
                    self._drain(connection)
                self._expire_deadlines()
        finally:
            with self._pump_lock:
                for connection in self._live.values():
                    self._close_connection(connection)
                self._live.clear()

    def _update_connections(self) -> bool:
        """Take up new connections and close dropped ones; True once the publisher closed."""
        with self._lock:
            closed = self._closed
            new, self._new_connections = self._new_connections, []
            dropped, self._dropped_connections = self._dropped_connections, []
        if not (new or dropped):
            return closed
        with self._pump_lock:  # a pump works on a snapshot of _live: change it in between
            for connection in new:
                self._live[connection.fd] = connection
                self._epoll.register(connection.fd, select.EPOLLIN)
            for connection in dropped:
                if self._live.pop(connection.fd, None) is connection:
                    self._epoll.unregister(connection.fd)
                self._close_connection(connection)
        return closed

    def pump(self, timeout_s: float) -> bool:
        """Handle arrived answers in the calling thread, waiting up to ``timeout_s`` (GatePump).

        True when an answer was handled. Only one thread pumps at a time; a second caller
        returns False at once. While pumping, the I/O thread does not watch the sockets.
        """
        if not self._pump_lock.acquire(blocking=False):
            return False
        try:
            if self._closed:
                return False
            connections = list(self._live.values())
            for connection in connections:
                self._epoll.unregister(connection.fd)
            try:
                handled = self._pump_connections(connections, timeout_s)
            finally:
                for connection in connections:
                    # Level-triggered: an answer that came in meanwhile wakes the I/O thread.
                    self._epoll.register(connection.fd, select.EPOLLIN)
            self._expire_deadlines()
            return handled
        finally:
            self._pump_lock.release()

    def _pump_connections(self, connections: list[_Connection], timeout_s: float) -> bool:
        handled = sum(self._drain(c) for c in connections)
        if handled or timeout_s <= 0:
            return handled > 0
        poller = select.poll()  # not select(): a vLLM process easily has fds past 1024
        for fd in (*(c.fd for c in connections), self._interrupt_read):
            poller.register(fd, select.POLLIN)
        if any(fd == self._interrupt_read for fd, _ in poller.poll(timeout_s * 1000)):
            _drain_pipe(self._interrupt_read)
        return sum(self._drain(c) for c in connections) > 0

    def _close_connection(self, connection: _Connection) -> None:
        with connection.lock:
            if not connection.closed:
                connection.closed = True
                connection.socket.close(linger=0)

    def _drain(self, connection: _Connection) -> int:
        """Receive and handle every waiting answer of one connection; how many there were.

        Frames are authenticated under the connection's lock (sequence numbers in wire order);
        a refused one is logged and dropped unread.
        """
        frames: list[tuple[Kind, bytes | memoryview]] = []
        received = 0
        with connection.lock:
            if connection.closed:
                return 0
            socket = connection.socket
            while cast(int, socket.getsockopt(_EVENTS)) & _POLLIN:
                received += 1
                try:
                    frames.append(connection.channel.open(socket.recv(zmq.NOBLOCK)))
                except FrameRejectedError as exc:
                    log.warning("prefill %s: refused a frame from %s: %s", self._label,
                                connection.endpoint, exc)
        for kind, frame in frames:
            try:
                if kind is Kind.RESET:
                    self._renew(connection.endpoint, connection.number,
                                "the decode does not know this connection's session (it "
                                "restarted?)")
                else:
                    self._on_answer(connection, frame)
            except Exception:
                log.exception("prefill %s: error handling an answer from %s", self._label,
                              connection.endpoint)
        return received

    def _poll_timeout_s(self) -> float:
        """Until the next deadline of a READY still in flight (answered ones are dropped).

        With none in flight, one default deadline: a READY published meanwhile with the default
        deadline then needs no wake-up (it expires after this thread's next look).
        """
        with self._lock:
            deadline = self._ledger.next_deadline()
            now = time.monotonic()
            timeout = (max(0.0, deadline - now) if deadline is not None
                       else self.layer_deadline_s)
            self._io_sleep_until = now + timeout
            return timeout

    def _renew(self, endpoint: str, number: int, why: str,
               failed: Iterable[PendingReady] = ()) -> None:
        """Tear down the session on connection ``number`` to ``endpoint`` and handshake again on
        a new connection, now; everything in flight there fails with ``why``.

        The requests of those READYs and of ``failed`` (the READYs that ended the session) get
        no more layers from this prefill: the decode is told so (SEND_ABORTED) on the new
        session as soon as its handshake is accepted, so it fails their pulls at once rather
        than waiting its own deadline for layers that will not come.

        Nothing happens when that connection is no longer the endpoint's (already renewed,
        dropped, or the publisher closed): a stale report never breaks a newer session.
        """
        with self._lock:
            peer = self._peers.get(endpoint)
            if self._closed or peer is None or peer.connection.number != number:
                return
            fresh = _Peer(endpoint=endpoint, connection=self._open(endpoint),
                          renewed_because=why)
            self._peers[endpoint] = fresh
            self._dropped_connections.append(peer.connection)
            self._new_connections.append(fresh.connection)
            self.renewed_sessions += 1
            lost = self._ledger.drop_endpoint(endpoint)
            given_up = tuple(dict.fromkeys(
                request_id for item in (*failed, *lost) for request_id in item.request_ids))
            if given_up:
                fresh.pending_aborts.append((given_up, clip_reason(
                    f"prefill {self._label}'s control session ended ({why}); the request's "
                    f"READYs in flight there failed")))
        log.warning("prefill %s: %s: %s; failing %d READY(s) in flight there, closing the "
                    "connection and handshaking again on a new one", self._label, endpoint, why,
                    len(lost))
        self._wake()
        self._send(fresh.connection, self._meta_frame, hello=True)
        for item in lost:
            self._finish(item, f"decode {endpoint}: {why}; layer {item.layer_index} seq "
                               f"{item.seq} was in flight on that session")

    def _on_answer(self, connection: _Connection, frame: bytes | memoryview) -> None:
        endpoint = connection.endpoint
        try:
            message = self._decoder.decode(frame)
        except ProtocolError as exc:
            log.warning("prefill %s: dropping frame from %s: %s", self._label, endpoint, exc)
            return
        if isinstance(message, HandshakeAnswer):
            with self._lock:
                peer = self._peers.get(endpoint)
            if peer is None or peer.connection is not connection:
                return  # the answer to a connection this publisher gave up
            with self._lock:
                peer.answer = message
                aborts, peer.pending_aborts = peer.pending_aborts, []
            peer.answered.set()
            if message.accepted:
                log.info("prefill %s: handshake accepted by %s (decode engine %s)", self._label,
                         endpoint, message.decode_session_id)
                for ids, reason in aborts:
                    self.abort(endpoint, ids, reason)
            else:
                log.warning("prefill %s: handshake rejected by %s: %s", self._label, endpoint,
                            message.reason)
            return
        if not isinstance(message, ReadDone | ReadFailed):
            log.warning("prefill %s: dropping %s from %s: not a decode -> prefill answer",
                        self._label, type(message).__name__, endpoint)
            return
        with self._lock:
            item = self._ledger.answer(endpoint, message.seq)
        if isinstance(message, ReadFailed) and message.needs_handshake:
            if item is not None:
                self._finish(item, f"decode {endpoint} failed to read layer {item.layer_index} "
                                   f"({item.layer_name}): {message.reason}")
            self._renew(endpoint, connection.number,
                        f"the decode reset the control session: {message.reason}",
                        failed=() if item is None else (item,))
            return
        if item is None:
            log.warning("prefill %s: %s for layer %d seq %d from %s matches nothing in flight "
                        "(late after its deadline, or duplicated)", self._label,
                        type(message).__name__, message.layer_index, message.seq, endpoint)
            return
        elapsed_us = (time.monotonic() - item.sent_at) * 1e6
        if isinstance(message, ReadDone):
            if log.isEnabledFor(logging.DEBUG):
                log.debug("prefill %s: READ_DONE layer %d seq %d from %s: %d bytes, %.0f us",
                          self._label, item.layer_index, item.seq, endpoint, message.bytes_read,
                          elapsed_us)
            self._finish(item, None)
        else:
            log.warning("prefill %s: READ_FAILED layer %d (%s) seq %d from %s after %.0f us, "
                        "requests %s: %s", self._label, item.layer_index, item.layer_name,
                        item.seq, endpoint, elapsed_us, list(item.request_ids), message.reason)
            self._finish(item, f"decode {endpoint} failed to read layer {item.layer_index} "
                               f"({item.layer_name}): {message.reason}")

    def _expire_deadlines(self) -> None:
        """Fail every READY past its deadline, and with it everything else in flight to the
        same decode: it answers in order, so nothing sent there since can be answered either
        (a dead decode then costs one deadline, not one per layer in flight)."""
        with self._lock:
            expired, behind = self._ledger.expire(time.monotonic())
        late = {item.endpoint: item for item in expired}
        for item in late.values():  # that connection may be dead for good: start a new one
            self._renew(item.endpoint, item.connection,
                        f"no answer to layer {item.layer_index} seq {item.seq} within its "
                        f"deadline",
                        failed=[e for e in (*expired, *behind) if e.endpoint == item.endpoint])
        for item in expired:
            error = LayerDeadlineError(
                f"no READ_DONE/READ_FAILED from {item.endpoint} for layer {item.layer_index} "
                f"({item.layer_name}) seq {item.seq} within "
                f"{item.deadline - item.sent_at:g} s; requests {list(item.request_ids)}")
            log.error("prefill %s: %s", self._label, error)
            self._finish(item, error)
        for item in behind:
            first = late[item.endpoint]
            error = LayerDeadlineError(
                f"{item.endpoint} did not answer layer {first.layer_index} seq {first.seq} "
                f"within its deadline; layer {item.layer_index} ({item.layer_name}) seq "
                f"{item.seq}, queued behind it, is failed too; requests "
                f"{list(item.request_ids)}")
            self._finish(item, error)
        if behind:
            log.error("prefill %s: failed %d more READY(s) queued to %s behind the missed "
                      "deadline", self._label, len(behind), ", ".join(sorted(late)))

    def _finish(self, item: PendingReady, error: Outcome) -> None:
        """Report one READY's outcome to the slot gate and to its requests.

        A READY that ends without READ_DONE may still be read: its requests' words advance
        first, so whoever frees their blocks on this report frees them fenced.
        """
        if error is not None:  # lease_words follow the READY's request ids, first seen first
            self.fences.advance_leases(zip(dict.fromkeys(item.request_ids), item.lease_words,
                                           strict=False))
        if self._gates is None:
            pass
        elif error is None:
            self._gates.mark_done(item.slot_key, item.part)
        else:
            self._gates.mark_failed(item.slot_key, item.part, error)
        with self._lock:
            reports = self._ledger.settle(item, error)
        for request_id, _ in reports:
            self.fences.release(request_id)  # nothing of it is read any more
        if self._tracker is None:
            return
        for request_id, failure in reports:
            if failure is None:
                self._tracker.mark_done(request_id, self._request_part)
            else:
                self._tracker.mark_failed(request_id, self._request_part, failure)


def _check_requests(requests: Sequence[ReadyRequest]) -> None:
    """The limits the decode enforces, checked here so a bad batch fails at the caller."""
    if len(requests) > MAX_REQUESTS_PER_BATCH:
        raise ValueError(f"{len(requests)} requests in one READY; at most "
                         f"{MAX_REQUESTS_PER_BATCH} are allowed (split the batch)")
    for request in requests:
        if not 0 < len(request.request_id) <= MAX_ID_CHARS:
            raise ValueError(f"request id {request.request_id[:40]!r}... must have 1 to "
                             f"{MAX_ID_CHARS} characters")
        for what, ids in (("main", request.main_block_ids),
                          ("indexer", request.indexer_block_ids)):
            if len(ids) > MAX_BLOCK_IDS_PER_REQUEST:
                raise ValueError(f"request {request.request_id!r}: {len(ids)} {what} block ids; "
                                 f"at most {MAX_BLOCK_IDS_PER_REQUEST} are allowed")
            if ids and min(ids) < 0:
                raise ValueError(f"request {request.request_id!r}: negative {what} block id "
                                 f"{min(ids)}")
        if min(request.main_start_block, request.num_blocks, request.indexer_start_block) < 0:
            raise ValueError(f"request {request.request_id!r}: start blocks and block counts "
                             f"must be >= 0")


def _decode_limit(peer: _Peer) -> int:
    return peer.answer.max_frame_bytes if peer.answer is not None else MAX_FRAME_BYTES


def _nonblocking_pipe() -> tuple[int, int]:
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    return read, write


def _poke(fd: int) -> None:
    try:
        os.write(fd, b"!")
    except (BlockingIOError, OSError):
        pass  # full (the reader is awake anyway) or already closed


def _drain_pipe(fd: int) -> None:
    try:
        while len(os.read(fd, 4096)) == 4096:
            pass
    except (BlockingIOError, OSError):
        pass


def _part_name(endpoint: str, seq: int) -> str:
    """Unique per READY, so a late answer can never match a newer round of the slot."""
    return f"read:{endpoint}#{seq}"
