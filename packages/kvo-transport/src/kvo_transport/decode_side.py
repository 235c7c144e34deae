"""Decode side of the control plane: a ZMQ ROUTER that accepts prefill ranks and pulls layers.

One thread owns the socket and does everything in arrival order: handshakes, READY validation,
the pull through the transfer engine, the answer. Order matters: a prefill rank's READYs arrive
in the order it published them, so when its last layer for a request is done every earlier
layer is done too. A READY that fails a check, or whose pull still fails after the configured
retries, is answered READ_FAILED and its destination blocks are reported invalid, so nothing
partially written is ever taken as valid. No READY goes unanswered: one that does not decode is
answered READ_FAILED with the reason when its sequence number can be read; any other frame that
does not decode resets its sender's session (READ_FAILED asking for a handshake) if it has one,
else it is logged and dropped. A second connection that claims a connected prefill's routing id
is refused by ZMQ (ROUTER_HANDOVER off): it can neither take that session over nor cut it off.

After every successful data read the READY's fences are checked (kvo_transport.fence): the
prefill's epoch words are read through the same engine and must still hold the READY's epochs;
a moved word means the source was reused while it was read, and the layer fails like a failed
read. Only then is READ_DONE sent.

Destinations (kvo_transport.destinations): every data read is recorded in a ledger before it
starts and after it returns; a read into a revoked block is refused; a failed read quarantines
its destination (slices of a failed Mooncake batch may land after the call returned), and a
request that failed is only reported by ``pop_finished`` once its blocks settled. ``revoke``
never waits for a read; whoever hands blocks back asks ``settled`` first.

A READY may arrive before its request's destination is registered (the proxy posted prefill
and decode at once): it waits, in its connection's order, for up to ``destination_wait_s``
(kvo_transport.ready_parking), then is read or refused. A request decode computes itself
(``decline``) is answered READ_DONE with nothing read.

A prefill that gives a request up (SEND_ABORTED: its KV of it is wrong, or will not all come)
makes its pull fail at once: the request is failed in the ledger if decode has its destination,
and remembered (``aborted``) for the caller to fail it when it registers the destination later;
its READYs from then on are read as wanting nothing. An abort only ever fails a pull, so a
forged one (without a control secret) can cost a recompute, never wrong bytes.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import cast

import attrs
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvo_core.config import CONTROL_SECRET_ENV
from kvo_core.errors import KvoError
from kvo_core.tp import TPMapping
from kvo_transport.destinations import (
    DEFAULT_QUARANTINE_S,
    DestinationLedger,
    DestinationRevokedError,
    blocks,
)
from kvo_transport.engine import TransferEngine
from kvo_transport.errors import ProtocolError, TransferError
from kvo_transport.fence import FenceReader
from kvo_transport.frame_auth import (
    DecodeSessions,
    FrameRejectedError,
    Kind,
    Rejection,
    control_key,
    require_secret_beyond_loopback,
)
from kvo_transport.protocol import (
    MAX_FENCES_PER_BATCH,
    MAX_FRAME_BYTES,
    NO_SEQ,
    PROTOCOL_VERSION,
    FrameDecoder,
    HandshakeAnswer,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    SendAborted,
    clip_reason,
    encode,
    unreadable_ready,
)
from kvo_transport.read_plan import (
    DecodeLayout,
    LayerReadPlan,
    ReadRejected,
    RequestDestination,
    Resolver,
    check_handshake,
    intended_destination,
    plan_layer_read,
)
from kvo_transport.ready_parking import ReadyParking
from kvo_transport.receive_ledger import InvalidBlocks, ReceiveLedger

_EVENTS = int(zmq.EVENTS)  # plain ints: pyzmq's enum arithmetic costs microseconds per call
_POLLIN = int(zmq.POLLIN)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)

log = logging.getLogger("kvo.transport.decode")

InvalidCallback = Callable[[str, int, tuple[int, ...], tuple[int, ...], str], None]
"""(request id, layer index, main destination blocks, indexer destination blocks, reason)."""

_instances = itertools.count()
MAX_SESSIONS = 4096
"""Accepted prefill connections remembered at once (the oldest is forgotten first)."""
DEFAULT_DESTINATION_WAIT_S = 10.0
"""How long a READY may wait for its request's destination to be registered."""
PARKED_POLL_S = 0.001
"""While READYs wait for destinations, how often the receiver looks for them."""
MAX_REMEMBERED_ABORTS = 65536
"""Given-up request ids remembered at once (the oldest forgotten first)."""


class ControlSocketError(KvoError, OSError):
    """The decode control socket cannot be bound (port in use, bad address...)."""


@attrs.define
class _Session:
    """One accepted prefill connection."""

    meta: MfMeta
    label: str
    part: str
    """This contributor's part name in the per-request completion tracker."""
    contributor_parts: frozenset[str]


class DecodeReceiver:
    """Serve READ_READY_BATCH messages of the prefill ranks that feed this decode rank.

    ``layout`` is the decode's registered destination memory per layer; ``resolve`` maps a
    request id to its destination blocks. ``pop_finished`` tells which requests reached a
    terminal state on this rank: every contributor delivered every layer (finished) or some
    part failed (failed, with the first reason). Bind ``port=0`` for an ephemeral port.
    ``control_secret`` (else ``$KVO_CONTROL_SECRET``) authenticates every frame (frame_auth);
    without one, binding a non-loopback ``host`` is refused (ConfigError).
    """

    def __init__(self, *, engine: TransferEngine, layout: DecodeLayout, resolve: Resolver,
                 decode_tp: int = 1, d_rank: int = 0, host: str = "127.0.0.1", port: int = 0,
                 read_retries: int = 2, retry_backoff_s: float = 0.05,
                 max_frame_bytes: int = MAX_FRAME_BYTES,
                 on_invalid: InvalidCallback | None = None,
                 control_secret: str | None = None,
                 quarantine_s: float = DEFAULT_QUARANTINE_S,
                 destination_wait_s: float = DEFAULT_DESTINATION_WAIT_S) -> None:
        if not isinstance(read_retries, int) or read_retries < 0:
            raise ValueError(f"read_retries must be an integer >= 0, got {read_retries!r}")
        if not retry_backoff_s >= 0:
            raise ValueError(f"retry_backoff_s must be >= 0 seconds, got {retry_backoff_s!r}")
        TPMapping(decode_tp, decode_tp).contributors(d_rank)  # range-checks d_rank
        key = control_key(control_secret)
        require_secret_beyond_loopback(key, host, f"decode rank {d_rank} control socket")
        self._auth = DecodeSessions(key)
        self.auth_rejections = self._auth.counters
        """Frames refused by authentication, by reason (also counted in rejected_frames)."""
        self._engine = engine
        self._layout = layout
        self._resolve = resolve
        self._decode_tp = decode_tp
        self._d_rank = d_rank
        self._read_retries = read_retries
        self._retry_backoff_s = retry_backoff_s
        self._on_invalid = on_invalid
        self._parking = ReadyParking(destination_wait_s)
        self._decoder = FrameDecoder(max_frame_bytes)
        self._backend = engine.backend
        self._transfer_protocol = engine.protocol
        self.destinations = DestinationLedger(quarantine_s)
        self._fence_reader = FenceReader(engine, MAX_FENCES_PER_BATCH)
        self._retired_readers: list[FenceReader] = []
        """Fence scratch a failed fence read may still land in: kept mapped until close."""
        self.stale_reads = 0
        """Reads whose fence showed the source reused meanwhile (refused, for tests/metrics)."""

        self._lock = threading.Lock()
        self._sessions: dict[bytes, _Session] = {}
        self._requests = ReceiveLedger()
        self._aborted: OrderedDict[str, str] = OrderedDict()
        """Request id -> reason, for requests a prefill gave up or whose READY this rank
        refused before their destination was registered (bounded; under _lock)."""
        self.aborted_requests = 0
        """Requests a prefill told this rank it gave up (SEND_ABORTED; for tests/metrics)."""
        self.rejected_frames = 0
        """Frames dropped because they did not decode (for tests and metrics)."""

        self._context = zmq.Context()
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A connection that claims a routing id already connected is refused (never read), so
        # no second connection can take a live session over; a prefill whose own connection
        # is refused that way misses a deadline and reconnects with a new id (prefill_side).
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        try:
            if port == 0:
                port = self._router.bind_to_random_port(f"tcp://{host}")
            else:
                self._router.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._router.close()
            self._context.term()
            self._fence_reader.close()
            raise ControlSocketError(f"cannot bind the decode control socket on "
                                     f"{host}:{port}: {exc}") from exc
        self.endpoint = f"tcp://{host}:{port}"
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.closed_connections = 0
        """Peer connections ZMQ closed (peers that left, or frames over the limit)."""
        wake = f"inproc://kvo-decode-wake-{next(_instances)}"
        self._wake_in = self._context.socket(zmq.PAIR)
        self._wake_in.bind(wake)
        self._wake_out = self._context.socket(zmq.PAIR)
        self._wake_out.connect(wake)
        self._thread = threading.Thread(target=self._serve, name=f"kvo-decode-{port}",
                                        daemon=True)
        self._started = False
        self._closed = False

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> DecodeReceiver:
        if not self._started:
            self._started = True
            self._thread.start()
            log.info("decode rank %d/%d serving control endpoint %s (backend %s/%s, %d layers)",
                     self._d_rank, self._decode_tp, self.endpoint, self._backend,
                     self._transfer_protocol, len(self._layout.layers))
        return self

    def close(self) -> None:
        """Stop serving; the socket and its thread are gone when this returns."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            self._wake_out.send(b"stop")
            self._thread.join()
        self._router.disable_monitor()
        for socket in (self._wake_out, self._wake_in, self._monitor, self._router):
            socket.close(linger=0)
        self._context.term()
        for reader in (self._fence_reader, *self._retired_readers):
            reader.close()

    def __enter__(self) -> DecodeReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- request state for the caller ---------------------------------------------------------

    def pop_finished(self) -> tuple[set[str], dict[str, str]]:
        """Requests that reached a terminal state since the last call: (ok ids, failed -> why)."""
        # A failed one waits until no late slice of a failed read can still land in it.
        return self._requests.pop_finished(
            lambda invalid: self.destinations.settled(blocks(invalid.main, invalid.indexer)))

    def wait_finished(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until a request reached a terminal state (not popped yet);
        whether one did. For a caller with nothing to do but poll ``pop_finished``."""
        return self._requests.wait_finished(timeout_s)

    def revoke(self, main: Iterable[int], indexer: Iterable[int] = ()) -> None:
        """No read may start into these destination blocks until ``restore``; never waits
        for a read in flight (ask ``settled`` before handing the blocks back)."""
        self.destinations.revoke(blocks(main, indexer))

    def restore(self, main: Iterable[int], indexer: Iterable[int] = ()) -> None:
        """The blocks belong to a new destination: reads into them are allowed again."""
        self.destinations.restore(blocks(main, indexer))

    def settled(self, main: Iterable[int], indexer: Iterable[int] = ()) -> bool:
        """True when no read is writing these blocks and no failed read's quarantine holds
        them: they may go back to their allocator."""
        return self.destinations.settled(blocks(main, indexer))

    def invalid_blocks(self, request_id: str) -> InvalidBlocks:
        return self._requests.invalid(request_id)

    def fail_request(self, request_id: str, reason: str) -> None:
        """Give up on a request's missing parts (e.g. the caller's own deadline expired)."""
        self._requests.fail_pending(request_id, reason)

    def aborted(self, request_id: str) -> str | None:
        """Why ``request_id`` cannot arrive whole on this rank, or None: a prefill gave it up
        (SEND_ABORTED), or this rank refused one of its READYs before its destination was
        registered. Whoever registers a destination asks this after registering it: what
        came first fails it then. Any thread."""
        with self._lock:
            return self._aborted.get(request_id)

    def decline(self, request_id: str) -> None:
        """Decode computes ``request_id`` itself: its READYs (waiting or still to come) are
        answered READ_DONE with nothing read, so prefill frees its buffers at once. Any
        thread."""
        self._parking.decline(request_id)

    @property
    def parked_readies(self) -> int:
        """READYs that had to wait for their destination (for tests and metrics)."""
        return self._parking.parked

    @property
    def waiting_readies(self) -> int:
        """READYs waiting now for their destination to be registered (any thread: a count)."""
        return len(self._parking)

    @property
    def expired_readies(self) -> int:
        """READYs whose destination never appeared within ``destination_wait_s``."""
        return self._parking.expired

    def forget(self, request_id: str) -> None:
        """Drop what is remembered about a request (its blocks were released).

        Its missing parts are closed and it is not reported by ``pop_finished``. The resolver
        must stop returning its blocks too: a late READY then fails instead of writing.
        """
        self._requests.forget(request_id)

    # -- the serving thread -------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            wait_s = self._parking.next_check_s(time.monotonic(), PARKED_POLL_S)
            events = dict(poller.poll(None if wait_s is None else math.ceil(wait_s * 1e3)))
            if self._wake_in in events:
                return
            if self._monitor in events:
                self._on_monitor_events()
            while cast(int, self._router.getsockopt(_EVENTS)) & _POLLIN:
                parts = self._router.recv_multipart(zmq.NOBLOCK)
                try:
                    self._on_frames(parts)
                except Exception:  # a bug must not take the rank's control plane down
                    log.exception("decode %s: unexpected error handling a frame", self.endpoint)
            if len(self._parking):
                try:
                    self._read_parked()
                except Exception:
                    log.exception("decode %s: unexpected error reading a waiting READY",
                                  self.endpoint)

    def _read_parked(self) -> None:
        for identity, batch, waited in self._parking.due(time.monotonic(), self._resolve):
            if log.isEnabledFor(logging.DEBUG):
                log.debug("decode %s: READY layer %d seq %d (requests %s) waited %.1f ms for "
                          "its destination", self.endpoint, batch.layer_index, batch.seq,
                          _ids(batch), waited * 1e3)
            if waited >= self._parking.wait_s:
                log.warning("decode %s: READY layer %d seq %d (requests %s) waited %.1f s and "
                            "decode registered no destination for it", self.endpoint,
                            batch.layer_index, batch.seq, _ids(batch), waited)
            self._read_layer(identity, batch)

    def _on_monitor_events(self) -> None:
        """Log connections ZMQ closed: a peer that went away, or one whose frame broke the size
        limit (ZMQ drops such a frame by closing the connection, and says nothing else)."""
        while cast(int, self._monitor.getsockopt(_EVENTS)) & _POLLIN:
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            self.closed_connections += 1
            peer = event.get("endpoint", b"?")
            log.info("decode %s: a control connection (%s) was closed: its prefill stopped or "
                     "died, or sent a frame over this rank's %d-byte limit", self.endpoint,
                     peer.decode(errors="replace") if isinstance(peer, bytes) else peer,
                     self._decoder.max_frame_bytes)

    def _on_frames(self, parts: list[bytes]) -> None:
        identity = parts[0]
        if len(parts) != 2:
            self.rejected_frames += 1
            log.warning("decode %s: dropping a %d-part message from peer %r (expected 1 frame)",
                        self.endpoint, len(parts) - 1, _peer_name(identity))
            return
        try:
            kind, frame = self._auth.open(identity, parts[1])
        except FrameRejectedError as exc:
            self._on_rejected(identity, parts[1], exc)
            return
        try:
            message = self._decoder.decode(frame)
        except ProtocolError as exc:
            self.rejected_frames += 1
            self._on_undecodable(identity, kind, frame, exc)
            return
        # With a secret, a handshake travels only in a HELLO and a READY only in its session.
        handshake = kind is Kind.HELLO or not self._auth.authenticated
        ready = kind is Kind.TO_DECODE
        if isinstance(message, MfMeta) and handshake:
            self._on_handshake(identity, message)
        elif isinstance(message, ReadReadyBatch) and ready:
            self._on_ready(identity, message)
        elif isinstance(message, SendAborted) and ready:
            self._on_abort(identity, message)
        else:
            self.rejected_frames += 1
            log.warning("decode %s: dropping %s from peer %r: not a prefill -> decode message "
                        "(or in the wrong envelope)", self.endpoint, type(message).__name__,
                        _peer_name(identity))

    def _on_undecodable(self, identity: bytes, kind: Kind, frame: bytes | memoryview,
                        error: ProtocolError) -> None:
        """Answer a frame that does not decode, so its sender never waits for a deadline: a
        READY whose sequence number can be read gets READ_FAILED with the reason (the requests
        it names fail here, nothing was read); anything else in an accepted session resets the
        session (the prefill handshakes again); anything else is logged and dropped."""
        peer = _peer_name(identity)
        with self._lock:
            session = self._sessions.get(identity)
        ready = unreadable_ready(frame) if kind is Kind.TO_DECODE else None
        if ready is not None:
            reason = f"malformed READY: {error}"
            log.warning("decode %s: READ_FAILED for a malformed READY (layer %d seq %d, requests "
                        "%s) from %s: %s", self.endpoint, ready.layer_index, ready.seq,
                        _preview(ready.request_ids),
                        session.label if session is not None else f"peer {peer!r}", error)
            if session is not None:
                for request_id in ready.request_ids:
                    if self._parking.destination(request_id, self._resolve) is not None:
                        self._expect(session, request_id)
                        self._requests.layer_failed(request_id, session.part,
                                                    f"layer {ready.layer_index}: {reason}")
            self._reply(identity, ReadFailed(version=PROTOCOL_VERSION, seq=ready.seq,
                                             layer_index=ready.layer_index,
                                             reason=clip_reason(reason)))
            return
        if session is None or kind is not Kind.TO_DECODE:
            log.warning("decode %s: dropping a frame from peer %r that does not decode (%s "
                        "envelope, no accepted session to reset): %s", self.endpoint, peer,
                        kind.name, error)
            return
        reason = f"a frame in this control session does not decode: {error}"
        log.warning("decode %s: resetting the control session of %s (it must handshake again): "
                    "%s", self.endpoint, session.label, reason)
        self._reply(identity, ReadFailed(version=PROTOCOL_VERSION, seq=NO_SEQ, layer_index=0,
                                         reason=clip_reason(reason), needs_handshake=True))
        self._forget_session(identity)

    def _forget_session(self, identity: bytes) -> None:
        """Drop an accepted session: its READYs from now on are refused until a handshake."""
        with self._lock:
            self._sessions.pop(identity, None)
        self._auth.forget(identity)
        for waiting in self._parking.drop(identity):  # refused in order, as unknown now
            self._read_layer(identity, waiting)

    def _on_rejected(self, identity: bytes, frame: bytes, error: FrameRejectedError) -> None:
        """Count and log a frame that failed authentication; nothing in it is acted on, except
        two answers that leak nothing: RESET to a session this rank does not know (the prefill
        handshakes again) and a plain refusal of a plain handshake (names the missing secret)."""
        self.rejected_frames += 1
        log.warning("decode %s: refused a control frame from peer %r (%d refused so far: %s): "
                    "%s", self.endpoint, _peer_name(identity), self.auth_rejections.total,
                    self.auth_rejections.as_dict(), error)
        if error.rejection is Rejection.WRONG_SESSION and error.session:
            self._send(identity, self._auth.seal_reset(error.session, error.seq), "RESET")
        elif error.rejection is Rejection.MISSING_MAC and _is_handshake(frame):
            reason = (f"this decode authenticates its control plane: set the same control "
                      f"secret on the prefill (kv_connector_extra_config 'control_secret' or "
                      f"{CONTROL_SECRET_ENV})")
            self._send(identity, encode(HandshakeAnswer(version=PROTOCOL_VERSION,
                                                        accepted=False, reason=reason)),
                       "HANDSHAKE_ANSWER")

    def _reply(self, identity: bytes, message: HandshakeAnswer | ReadDone | ReadFailed) -> None:
        payload = encode(message)
        frame: bytes | None
        if isinstance(message, HandshakeAnswer):
            frame = self._auth.seal_welcome(identity, payload, accepted=message.accepted)
        else:
            frame = self._auth.seal(identity, payload)
        if frame is None:
            log.warning("decode %s: no control session with peer %r any more; %s not sent",
                        self.endpoint, _peer_name(identity), type(message).__name__)
            return
        self._send(identity, frame, type(message).__name__)

    def _send(self, identity: bytes, frame: bytes, what: str) -> None:
        try:
            self._router.send(identity, _SNDMORE_NOBLOCK)
            self._router.send(frame, _NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("decode %s: cannot answer peer %r (%s): %s", self.endpoint,
                        _peer_name(identity), what, exc)

    # -- handshake ------------------------------------------------------------------------------

    def _on_handshake(self, identity: bytes, meta: MfMeta) -> None:
        for waiting in self._parking.drop(identity):  # the old session's READYs, in order
            self._read_layer(identity, waiting)
        label = (f"{meta.instance_id} rank {meta.p_rank}/{meta.p_tp_size} "
                 f"(engine {meta.engine_session_id})")
        reason = check_handshake(meta, self._layout, backend=self._backend,
                                 transfer_protocol=self._transfer_protocol,
                                 decode_tp=self._decode_tp, d_rank=self._d_rank)
        if reason is not None:
            log.warning("decode %s: rejected MF_META from %s: %s", self.endpoint, label, reason)
            with self._lock:
                self._sessions.pop(identity, None)
            self._reply(identity, HandshakeAnswer(version=PROTOCOL_VERSION, accepted=False,
                                                  reason=clip_reason(reason)))
            return
        mapping = TPMapping(meta.p_tp_size, self._decode_tp)
        contributors = frozenset(_part(meta.instance_id, p)
                                 for p in mapping.contributors(self._d_rank))
        session = _Session(meta=meta, label=label, part=_part(meta.instance_id, meta.p_rank),
                           contributor_parts=contributors)
        with self._lock:
            self._sessions.pop(identity, None)
            self._sessions[identity] = session
            while len(self._sessions) > MAX_SESSIONS:  # prefill ranks that came and went
                stale = next(iter(self._sessions))
                log.info("decode %s: forgetting the oldest session %r", self.endpoint,
                         self._sessions.pop(stale).label)
        log.info("decode %s: accepted MF_META from %s on connection %r, member %d of %d, %d "
                 "layers", self.endpoint, label, identity, meta.member, meta.ratio,
                 len(meta.layers))
        self._reply(identity, HandshakeAnswer(version=PROTOCOL_VERSION, accepted=True,
                                              decode_session_id=self._engine.session_id,
                                              max_frame_bytes=self._decoder.max_frame_bytes))

    # -- READY -> pull -> DONE / FAILED ----------------------------------------------------------

    def _on_ready(self, identity: bytes, batch: ReadReadyBatch) -> None:
        with self._lock:
            known = identity in self._sessions
        # A READY outside a session is refused at once (the prefill handshakes again): parked,
        # it would wait for a destination only to be refused, up to destination_wait_s later.
        if not known or not self._parking.offer(identity, batch, time.monotonic(),
                                                self._resolve):
            self._read_layer(identity, batch)

    def _on_abort(self, identity: bytes, message: SendAborted) -> None:
        with self._lock:
            session = self._sessions.get(identity)
        if session is None:
            self.rejected_frames += 1
            log.warning("decode %s: dropping SEND_ABORTED from peer %r: no accepted handshake "
                        "on this connection", self.endpoint, _peer_name(identity))
            return
        reason = f"prefill {session.label} gave the request up: {message.reason}"
        log.warning("decode %s: prefill %s gave up request(s) %s: %s", self.endpoint,
                    session.label, _preview(message.request_ids), message.reason)
        for request_id in message.request_ids:
            self._remember_lost(request_id, reason)
            with self._lock:
                self.aborted_requests += 1
            self._parking.decline(request_id)  # its READYs, waiting or to come, read nothing
            if self._resolve(request_id) is not None:
                self._expect(session, request_id)
                self._requests.layer_failed(request_id, session.part, reason)

    def _remember_lost(self, request_id: str, reason: str) -> None:
        """``request_id`` can never arrive whole on this rank: whoever registers its
        destination later fails it (``aborted``). Remembered before the resolver is asked."""
        with self._lock:
            self._aborted[request_id] = reason
            self._aborted.move_to_end(request_id)
            while len(self._aborted) > MAX_REMEMBERED_ABORTS:
                self._aborted.popitem(last=False)

    def _read_layer(self, identity: bytes, batch: ReadReadyBatch) -> None:
        started = time.perf_counter()
        with self._lock:
            session = self._sessions.get(identity)
        if session is None:
            reason = "no accepted MF_META handshake on this connection; handshake again"
            log.warning("decode %s: READY layer %d seq %d from unknown peer %r: %s",
                        self.endpoint, batch.layer_index, batch.seq, _peer_name(identity), reason)
            self._reply(identity, ReadFailed(version=PROTOCOL_VERSION, seq=batch.seq,
                                             layer_index=batch.layer_index, reason=reason,
                                             needs_handshake=True))
            return
        targets: dict[str, RequestDestination | None] = {}
        try:
            for request in batch.requests:
                targets[request.request_id] = self._parking.destination(request.request_id,
                                                                        self._resolve)
            lost = self._lost_reason(targets)
            if lost is not None:
                raise ReadRejected(lost)
            plan = self._plan(session, batch, targets)
        except ReadRejected as exc:
            self._fail_layer(identity, session, batch, targets, str(exc), started)
            return
        except Exception as exc:
            log.exception("decode %s: planning layer %d seq %d from %s failed", self.endpoint,
                          batch.layer_index, batch.seq, session.label)
            self._fail_layer(identity, session, batch, targets,
                             f"internal error on decode: {exc!r}", started)
            return
        written = frozenset().union(*(blocks(main, indexer)
                                      for main, indexer in plan.destinations.values()))
        try:
            ticket = self.destinations.begin_read(written)
        except DestinationRevokedError as exc:
            self._fail_layer(identity, session, batch, targets, str(exc), started)
            return
        slices_pending = True
        try:
            error, slices_pending = self._pull(session, batch, plan)
        finally:
            self.destinations.end_read(ticket, failed=slices_pending)
        if error is None and plan.lengths:
            error = self._check_fences(session, batch)
        if error is not None:
            self._fail_layer(identity, session, batch, targets, error, started)
            return
        self._record_success(session, batch)
        self._reply(identity, ReadDone(version=PROTOCOL_VERSION, seq=batch.seq,
                                       layer_index=batch.layer_index,
                                       bytes_read=plan.total_bytes))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decode %s: layer %d (%s) seq %d from %s: %d requests %s, %d bytes in %d "
                      "descriptors, %.0f us", self.endpoint, batch.layer_index, batch.layer_name,
                      batch.seq, session.label, len(batch.requests), _ids(batch), plan.total_bytes,
                      len(plan.lengths), (time.perf_counter() - started) * 1e6)

    def _lost_reason(self, targets: dict[str, RequestDestination | None]) -> str | None:
        """Why a request of this READY that has a destination can never arrive whole (its
        prefill gave it up, or an earlier READY of it was refused before it was registered),
        or None. Such a request fails here instead of completing from its later chunks."""
        with self._lock:
            for request_id, target in targets.items():
                reason = self._aborted.get(request_id) if target is not None else None
                if reason is not None:
                    return f"request {request_id!r} cannot arrive whole: {reason}"
        return None

    def _plan(self, session: _Session, batch: ReadReadyBatch,
              targets: dict[str, RequestDestination | None]) -> LayerReadPlan:
        meta = session.meta
        if (batch.member, batch.ratio) != (meta.member, meta.ratio):
            raise ReadRejected(f"READY says member {batch.member} of {batch.ratio}, the "
                               f"handshake said member {meta.member} of {meta.ratio}")
        if batch.layer_index >= len(meta.layers):
            raise ReadRejected(f"layer {batch.layer_index} is out of range: the session has "
                               f"{len(meta.layers)} layers")
        outside = [f.word for f in batch.fences if f.word >= meta.fence_words]
        if outside:
            raise ReadRejected(f"fence word(s) {_preview(outside)} are outside the prefill's "
                               f"{meta.fence_words} epoch words")
        return plan_layer_read(meta.layers[batch.layer_index],
                               self._layout.layers[batch.layer_index], batch, targets.get,
                               self._layout.main_share)

    def _pull(self, session: _Session, batch: ReadReadyBatch, plan: LayerReadPlan
              ) -> tuple[str | None, bool]:
        """Read the plan, retrying a failed read: (the reason on final failure, else None;
        whether slices of a failed attempt may still land).

        A retry first waits out the quarantine: a slice of the failed attempt landing after
        the retry rewrote the destination (and its fence was checked) would go unnoticed.
        """
        if not plan.lengths:
            return None, False
        peer = session.meta.engine_session_id
        attempts = self._read_retries + 1
        last: BaseException | None = None
        for attempt in range(attempts):
            try:
                self._engine.read(peer, plan.local_addrs, plan.remote_addrs, plan.lengths)
                if attempt:
                    log.info("decode %s: layer %d seq %d from %s succeeded on attempt %d",
                             self.endpoint, batch.layer_index, batch.seq, session.label,
                             attempt + 1)
                return None, False
            except TransferError as exc:
                log.warning("decode %s: layer %d seq %d from %s: read of %d bytes in %d "
                            "descriptors failed (attempt %d of %d): %s", self.endpoint,
                            batch.layer_index, batch.seq, session.label, plan.total_bytes,
                            len(plan.lengths), attempt + 1, attempts, exc)
                last = exc
                if attempt + 1 < attempts:
                    time.sleep(max(self._retry_backoff_s * (2 ** attempt),
                                   self.destinations.quarantine_s))
            except Exception as exc:  # an engine bug is not worth retrying
                log.exception("decode %s: layer %d seq %d: engine read raised", self.endpoint,
                              batch.layer_index, batch.seq)
                return f"read from {peer} raised {exc!r}", True
        return (f"read of {plan.total_bytes} bytes in {len(plan.lengths)} descriptors from "
                f"{peer} failed after {attempts} attempt(s): {last}"), True

    def _check_fences(self, session: _Session, batch: ReadReadyBatch) -> str | None:
        """After the data read: the reason to refuse it if the source may have been reused."""
        meta = session.meta
        try:
            stale = self._fence_reader.stale(meta.engine_session_id, meta.fence_addr,
                                             batch.fences)
        except TransferError as exc:
            # Its slices may still land in the scratch words: never compare in them again.
            self._retired_readers.append(self._fence_reader)
            self._fence_reader = FenceReader(self._engine, MAX_FENCES_PER_BATCH)
            return f"fence: the epoch words could not be read after the data read: {exc}"
        if stale is not None:
            self.stale_reads += 1
        return stale

    def _fail_layer(self, identity: bytes, session: _Session, batch: ReadReadyBatch,
                    targets: dict[str, RequestDestination | None], reason: str,
                    started: float) -> None:
        log.warning("decode %s: READ_FAILED layer %d (%s) seq %d from %s, requests %s after "
                    "%.0f us: %s", self.endpoint, batch.layer_index, batch.layer_name, batch.seq,
                    session.label, _ids(batch), (time.perf_counter() - started) * 1e6, reason)
        layers = self._layout.layers
        dest = layers[batch.layer_index] if batch.layer_index < len(layers) else None
        for request in batch.requests:
            target = targets.get(request.request_id)
            if target is None:
                # No destination (yet): nothing to invalidate, but this layer's blocks of the
                # request will never be read here. Should the request register later (the
                # READY waited past destination_wait_s), it must fail, not complete from its
                # later chunks with these blocks unwritten; and if it registered just now,
                # fail it now.
                lost = (f"a READY for it (layer {batch.layer_index}, seq {batch.seq}, from "
                        f"{session.label}) was refused before its destination was "
                        f"registered: {reason}")
                self._remember_lost(request.request_id, lost)
                if self._resolve(request.request_id) is None:
                    continue
                self._expect(session, request.request_id)
                self._requests.layer_failed(request.request_id, session.part, lost)
                continue
            self._expect(session, request.request_id)
            self._requests.layer_failed(request.request_id, session.part,
                                        f"layer {batch.layer_index}: {reason}")
            if dest is None:
                continue
            main, indexer = intended_destination(dest, request, target)
            self._invalidate(request.request_id, batch.layer_index, main, indexer, reason)
        self._reply(identity, ReadFailed(version=PROTOCOL_VERSION, seq=batch.seq,
                                         layer_index=batch.layer_index,
                                         reason=clip_reason(reason)))

    def _invalidate(self, request_id: str, layer_index: int, main: tuple[int, ...],
                    indexer: tuple[int, ...], reason: str) -> None:
        self._requests.invalidate(request_id, main, indexer)
        if self._on_invalid is not None:
            try:
                self._on_invalid(request_id, layer_index, main, indexer, reason)
            except Exception:
                log.exception("decode %s: on_invalid callback failed for request %r",
                              self.endpoint, request_id)

    # -- per-request completion -----------------------------------------------------------------

    def _expect(self, session: _Session, request_id: str) -> None:
        started_from = self._requests.expect(request_id, session.meta.instance_id,
                                             session.contributor_parts)
        if started_from is not None:
            log.warning("decode %s: request %r arrives from prefill %s but started from "
                        "prefill instance %r", self.endpoint, request_id, session.label,
                        started_from)

    def _record_success(self, session: _Session, batch: ReadReadyBatch) -> None:
        last = set(batch.last_layer_request_ids)
        for request in batch.requests:
            self._expect(session, request.request_id)
            self._requests.layer_done(request.request_id, session.part, batch.layer_index,
                                      len(session.meta.layers), request.request_id in last,
                                      session.label)


def decode_control_endpoint(host: str, kv_port: int, dp_rank: int, tp_rank: int,
                            decode_tp_size: int) -> str:
    """The ZMQ endpoint of decode rank (dp_rank, tp_rank) (port from kvo_core.tp)."""
    from kvo_core.tp import control_port

    return f"tcp://{host}:{control_port(kv_port, dp_rank, tp_rank, decode_tp_size)}"


def _is_handshake(frame: bytes) -> bool:
    try:
        return isinstance(FrameDecoder().decode(frame), MfMeta)
    except ProtocolError:
        return False


def _part(instance_id: str, p_rank: int) -> str:
    return f"{instance_id}/p{p_rank}"


def _peer_name(identity: bytes) -> str:
    return identity.decode("utf-8", "backslashreplace")[:80]


def _ids(batch: ReadReadyBatch) -> str:
    return _preview([r.request_id for r in batch.requests])


def _preview(values: Iterable[object], limit: int = 6) -> str:
    items = list(values)
    shown = ", ".join(map(str, items[:limit]))
    return f"[{shown}{f', ... ({len(items)} in all)' if len(items) > limit else ''}]"
