"""Authenticated control frames: HMAC-SHA256 over every frame, per-session keys, no replay.

Why: a READY names memory a decode will pull from and write into; a forged or replayed one
could make a decode overwrite live KV, and a forged READ_DONE could make a prefill reuse a
buffer that is still being read. With a shared secret (``control_secret`` in the connector's
config, else the ``KVO_CONTROL_SECRET`` environment variable), every frame travels in an
envelope::

    magic "KVA1" | kind (1 byte) | session id (16 bytes) | sequence (8 bytes, big endian)
    | HMAC-SHA256 (32 bytes) | message (msgpack, protocol.py)

The MAC covers the header and the message. Keys: ``master = HMAC(secret, LABEL)``; the prefill's
HELLO (the MF_META handshake) is MACed with ``master`` and carries a fresh random 16-byte nonce
as its session id; the decode answers WELCOME, MACed with ``master`` over the header, the
prefill's nonce and the answer, and names a fresh random session id ``S`` of its own. Both sides
then derive ``session key = HMAC(master, "session" | nonce | S)`` and MAC every DATA frame with
it. Each direction numbers its DATA frames 1, 2, 3, ...; ZMQ delivers a connection's frames in
order, so a frame whose number is not above the last accepted one is a replay. A HELLO nonce
is accepted once (the decode remembers the last ``MAX_REMEMBERED_NONCES``); a replayed WELCOME
binds another nonce and fails its MAC. A decode that does not know a DATA frame's session (it
restarted) answers RESET, MACed with ``master`` over the session id it was given, and the
prefill handshakes again. Rejected frames are counted by kind (``AuthCounters``) and never
reach the message decoder.

Without a secret frames are plain messages (the wire format of protocol.py) and this module
only guards the deployment: loopback works, with one warning per process that the control
plane is unauthenticated; a non-loopback address is refused (``require_secret_beyond_loopback``).
Not covered: confidentiality (frames are not encrypted). A second connection that claims a
connected prefill's ZMQ routing id is refused by the decode's ROUTER (decode_side.py), so it can
neither take a session over nor cut it off.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Final

import attrs

from kvo_core.config import CONTROL_SECRET_ENV, MIN_CONTROL_SECRET_CHARS
from kvo_core.errors import ConfigError
from kvo_transport.errors import ProtocolError

log = logging.getLogger("kvo.transport.auth")

MAGIC: Final = b"KVA1"
LABEL: Final = b"kvo control plane v1"
_HEADER: Final = struct.Struct(">4sB16sQ")
MAC_BYTES: Final = 32
NONCE_BYTES: Final = 16
OVERHEAD: Final = _HEADER.size + MAC_BYTES
"""Bytes the envelope adds to a message."""
MAX_REMEMBERED_NONCES: Final = 1 << 16
MAX_SESSIONS: Final = 4096
_SEQ_LIMIT: Final = (1 << 64) - 1


class Kind(enum.IntEnum):
    HELLO = 1  # P -> D handshake, master key
    WELCOME = 2  # D -> P handshake answer, master key, bound to the HELLO's nonce
    TO_DECODE = 3  # P -> D data, session key
    TO_PREFILL = 4  # D -> P data, session key
    RESET = 5  # D -> P "no such session: handshake again", master key


class Rejection(enum.Enum):
    """Why a frame was refused; the counter names in ``AuthCounters``."""

    MISSING_MAC = "missing_mac"
    BAD_MAC = "bad_mac"
    REPLAY = "replay"
    WRONG_SESSION = "wrong_session"
    UNEXPECTED_MAC = "unexpected_mac"
    """An authenticated frame reached a side that has no secret: the two sides disagree."""


class FrameRejectedError(ProtocolError):
    """A control frame failed authentication; nothing in it was read."""

    def __init__(self, rejection: Rejection, detail: str, *, session: bytes = b"",
                 seq: int = 0) -> None:
        super().__init__(f"{rejection.value}: {detail}")
        self.rejection = rejection
        self.session = session
        self.seq = seq


@attrs.define
class AuthCounters:
    """Frames refused, by reason (thread-safe increments)."""

    missing_mac: int = 0
    bad_mac: int = 0
    replay: int = 0
    wrong_session: int = 0
    unexpected_mac: int = 0
    _lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False, eq=False)

    def count(self, rejection: Rejection) -> None:
        with self._lock:
            setattr(self, rejection.value, getattr(self, rejection.value) + 1)

    @property
    def total(self) -> int:
        return (self.missing_mac + self.bad_mac + self.replay + self.wrong_session
                + self.unexpected_mac)

    def as_dict(self) -> dict[str, int]:
        return {r.value: getattr(self, r.value) for r in Rejection}


# -- the secret and where it may be missing ------------------------------------------------------

@attrs.frozen(repr=False)
class ControlKey:
    """The master key derived from the shared secret (the secret itself is not kept)."""

    master: bytes
    mac: _Mac = attrs.field(init=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "mac", _Mac(self.master))

    @classmethod
    def from_secret(cls, secret: str | bytes) -> ControlKey:
        raw = secret.encode() if isinstance(secret, str) else secret
        if len(raw) < MIN_CONTROL_SECRET_CHARS:
            raise ConfigError(f"the control secret must have at least {MIN_CONTROL_SECRET_CHARS} "
                              f"characters, got {len(raw)}")
        return cls(hmac.digest(raw, LABEL, "sha256"))

    def __repr__(self) -> str:
        return "ControlKey(<hidden>)"


def control_key(secret: str | bytes | None = None,
                environ: Mapping[str, str] | None = None) -> ControlKey | None:
    """The key for ``secret``, else for ``$KVO_CONTROL_SECRET``, else None (unauthenticated).

    Precedence: an explicit (config) secret wins over the environment variable.
    """
    if secret is None:
        secret = (os.environ if environ is None else environ).get(CONTROL_SECRET_ENV) or None
        if secret is not None and len(secret.encode()) < MIN_CONTROL_SECRET_CHARS:
            raise ConfigError(f"{CONTROL_SECRET_ENV} must have at least "
                              f"{MIN_CONTROL_SECRET_CHARS} characters, got {len(secret)}")
    return None if secret is None else ControlKey.from_secret(secret)


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address (a name is resolved)."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host in ("", "*"):
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback
                                   for a in addresses)


def endpoint_host(endpoint: str) -> str:
    """The host of a ``tcp://HOST:PORT`` endpoint (brackets of IPv6 kept off)."""
    rest = endpoint.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")


_warned_unauthenticated = False
_warn_lock = threading.Lock()


def require_secret_beyond_loopback(key: ControlKey | None, host: str, what: str) -> None:
    """Refuse ``what`` on a non-loopback ``host`` without a secret; warn once on loopback."""
    global _warned_unauthenticated
    if key is not None:
        return
    if not is_loopback(host):
        raise ConfigError(
            f"{what} on {host!r} is not a loopback address and no control secret is set: "
            f"anyone who reaches it could forge READY/DONE frames. Set the same secret on "
            f"every prefill, decode and proxy (kv_connector_extra_config 'control_secret' or "
            f"the {CONTROL_SECRET_ENV} environment variable, at least "
            f"{MIN_CONTROL_SECRET_CHARS} characters), or use 127.0.0.1")
    with _warn_lock:
        if _warned_unauthenticated:
            return
        _warned_unauthenticated = True
    log.warning("the kvo control plane is UNAUTHENTICATED (no control secret set; %s on %s). "
                "Fine on loopback; set %s to authenticate it", what, host, CONTROL_SECRET_ENV)


# -- envelope ------------------------------------------------------------------------------------

class _Mac:
    """HMAC-SHA256 under one key, keyed once (``hmac.new``) and copied per frame: the copy skips
    re-deriving the padded key, which is most of the cost for frames of a few hundred bytes."""

    __slots__ = ("_base",)

    def __init__(self, key: bytes) -> None:
        self._base = hmac.new(key, digestmod=hashlib.sha256)

    def digest(self, *parts: bytes | memoryview) -> bytes:
        mac = self._base.copy()
        for part in parts:
            mac.update(part)
        return mac.digest()


_KINDS: Final = {int(kind): kind for kind in Kind}


def _seal(mac: _Mac, kind: Kind, session: bytes, seq: int, payload: bytes,
          bound: bytes = b"") -> bytes:
    header = _HEADER.pack(MAGIC, kind, session, seq)
    return b"".join((header, mac.digest(header, bound, payload), payload))


@attrs.frozen
class _Opened:
    kind: Kind
    session: bytes
    seq: int
    mac: memoryview
    header: memoryview
    payload: memoryview


def _parse(frame: bytes) -> _Opened:
    if not frame.startswith(MAGIC):
        raise FrameRejectedError(Rejection.MISSING_MAC, "frame carries no MAC envelope")
    if len(frame) < OVERHEAD:
        raise FrameRejectedError(Rejection.BAD_MAC, f"envelope of {len(frame)} bytes is "
                                                    f"shorter than its {OVERHEAD}-byte header")
    _, number, session, seq = _HEADER.unpack_from(frame)
    kind = _KINDS.get(number)
    if kind is None:
        raise FrameRejectedError(Rejection.BAD_MAC, f"unknown envelope kind {number}")
    view = memoryview(frame)
    return _Opened(kind, session, seq, view[_HEADER.size:OVERHEAD], view[:_HEADER.size],
                   view[OVERHEAD:])


def _verify(mac: _Mac, opened: _Opened, bound: bytes = b"") -> None:
    if not hmac.compare_digest(mac.digest(opened.header, bound, opened.payload), opened.mac):
        raise FrameRejectedError(Rejection.BAD_MAC, f"{opened.kind.name} frame's MAC does not "
                                 f"verify (forged, altered, or another secret)",
                                 session=opened.session, seq=opened.seq)


def _plain(frame: bytes) -> bytes:
    """What a side without a secret accepts: a plain message, never an envelope."""
    if frame.startswith(MAGIC):
        raise FrameRejectedError(Rejection.UNEXPECTED_MAC,
                                 f"authenticated frame but this side has no control secret "
                                 f"(set {CONTROL_SECRET_ENV} on both sides)")
    return frame


def _session_mac(master: bytes, nonce: bytes, session: bytes) -> _Mac:
    return _Mac(hmac.digest(master, b"session" + nonce + session, "sha256"))


def _next_seq(seq: int) -> int:
    if seq >= _SEQ_LIMIT:
        raise ProtocolError("control session exhausted its sequence numbers; reconnect")
    return seq + 1


# -- prefill side: one channel per DEALER connection ---------------------------------------------

class PrefillChannel:
    """Seal and open the frames of one prefill -> decode connection.

    Not thread-safe: the publisher calls ``seal*`` under the connection's send lock and
    ``open`` under its receive lock (the same lock), so sequence numbers follow the wire order.
    """

    def __init__(self, key: ControlKey | None, counters: AuthCounters) -> None:
        self._key = key
        self.counters = counters
        self._nonce = b""
        self._session = b""
        self._session_mac: _Mac | None = None
        self._sent = 0
        self._received = 0

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def seal_hello(self, payload: bytes) -> bytes:
        """The handshake (MF_META) frame; starts a new session."""
        if self._key is None:
            return payload
        self._nonce = os.urandom(NONCE_BYTES)
        self._session = b""
        self._session_mac = None
        self._sent = self._received = 0
        return _seal(self._key.mac, Kind.HELLO, self._nonce, 0, payload)

    def seal(self, payload: bytes) -> bytes:
        if self._key is None:
            return payload
        if self._session_mac is None:
            raise ProtocolError("no authenticated session yet: the handshake must finish first")
        self._sent = _next_seq(self._sent)
        return _seal(self._session_mac, Kind.TO_DECODE, self._session, self._sent, payload)

    def open(self, frame: bytes) -> tuple[Kind, bytes | memoryview]:
        """The message of an answer frame, or FrameRejectedError (counted)."""
        try:
            return self._open(frame)
        except FrameRejectedError as exc:
            self.counters.count(exc.rejection)
            raise

    def _open(self, frame: bytes) -> tuple[Kind, bytes | memoryview]:
        if self._key is None:
            return Kind.TO_PREFILL, _plain(frame)
        opened = _parse(frame)
        master = self._key.mac
        if opened.kind is Kind.WELCOME:
            if not self._nonce or self._session:
                raise FrameRejectedError(Rejection.REPLAY, "WELCOME without a HELLO waiting "
                                         "for it", session=opened.session)
            _verify(master, opened, bound=self._nonce)
            self._session = opened.session
            self._session_mac = _session_mac(self._key.master, self._nonce, opened.session)
            return opened.kind, opened.payload
        if not self._session or opened.session != self._session:
            raise FrameRejectedError(Rejection.WRONG_SESSION,
                                     f"{opened.kind.name} frame names session "
                                     f"{opened.session.hex()}, this connection's is "
                                     f"{self._session.hex() or 'not set up'}",
                                     session=opened.session, seq=opened.seq)
        if opened.kind is Kind.RESET:
            _verify(master, opened)
            return opened.kind, opened.payload
        if opened.kind is not Kind.TO_PREFILL:
            raise FrameRejectedError(Rejection.BAD_MAC, f"{opened.kind.name} frame sent to a "
                                     f"prefill", session=opened.session, seq=opened.seq)
        assert self._session_mac is not None  # set with self._session
        _verify(self._session_mac, opened)
        if opened.seq <= self._received:
            raise FrameRejectedError(Rejection.REPLAY, f"sequence {opened.seq} is not above "
                                     f"the last accepted {self._received}",
                                     session=opened.session, seq=opened.seq)
        self._received = opened.seq
        return opened.kind, opened.payload


# -- decode side: one table of sessions keyed by the ROUTER's peer identity ----------------------

@attrs.define
class _DecodeSession:
    nonce: bytes
    session: bytes
    mac: _Mac
    sent: int = 0
    received: int = 0


class DecodeSessions:
    """Open and seal the frames of every prefill connection of one decode ROUTER socket.

    Used by the receiver's one serving thread only (no locking).
    """

    def __init__(self, key: ControlKey | None) -> None:
        self._key = key
        self.counters = AuthCounters()
        self._sessions: OrderedDict[bytes, _DecodeSession] = OrderedDict()
        self._pending: dict[bytes, bytes] = {}  # identity -> HELLO nonce awaiting our answer
        self._seen_nonces: OrderedDict[bytes, None] = OrderedDict()

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def open(self, identity: bytes, frame: bytes) -> tuple[Kind, bytes | memoryview]:
        """The message of a frame from ``identity``, or FrameRejectedError (counted)."""
        try:
            return self._open(identity, frame)
        except FrameRejectedError as exc:
            self.counters.count(exc.rejection)
            raise

    def _open(self, identity: bytes, frame: bytes) -> tuple[Kind, bytes | memoryview]:
        if self._key is None:
            return Kind.TO_DECODE, _plain(frame)
        opened = _parse(frame)
        if opened.kind is Kind.HELLO:
            _verify(self._key.mac, opened)
            if opened.session in self._seen_nonces:
                raise FrameRejectedError(Rejection.REPLAY, "HELLO nonce already used",
                                         session=opened.session)
            self._seen_nonces[opened.session] = None
            while len(self._seen_nonces) > MAX_REMEMBERED_NONCES:
                self._seen_nonces.popitem(last=False)
            self._pending[identity] = opened.session
            return opened.kind, opened.payload
        if opened.kind is not Kind.TO_DECODE:
            raise FrameRejectedError(Rejection.BAD_MAC, f"{opened.kind.name} frame sent to a "
                                     f"decode", session=opened.session, seq=opened.seq)
        state = self._sessions.get(identity)
        if state is None or opened.session != state.session:
            held = "none" if state is None else state.session.hex()
            raise FrameRejectedError(Rejection.WRONG_SESSION,
                                     f"frame names session {opened.session.hex()}; this "
                                     f"peer's session is {held}",
                                     session=opened.session, seq=opened.seq)
        _verify(state.mac, opened)
        if opened.seq <= state.received:
            raise FrameRejectedError(Rejection.REPLAY, f"sequence {opened.seq} is not above "
                                     f"the last accepted {state.received}",
                                     session=opened.session, seq=opened.seq)
        state.received = opened.seq
        self._sessions.move_to_end(identity)
        return opened.kind, opened.payload

    def seal_welcome(self, identity: bytes, payload: bytes, *, accepted: bool) -> bytes:
        """The handshake answer to ``identity``'s HELLO; an accepted one starts its session."""
        if self._key is None:
            return payload
        nonce = self._pending.pop(identity, b"")
        session = os.urandom(NONCE_BYTES)
        if accepted and nonce:
            self._sessions.pop(identity, None)
            self._sessions[identity] = _DecodeSession(
                nonce=nonce, session=session,
                mac=_session_mac(self._key.master, nonce, session))
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        else:
            self._sessions.pop(identity, None)
        return _seal(self._key.mac, Kind.WELCOME, session, 0, payload, bound=nonce)

    def seal(self, identity: bytes, payload: bytes) -> bytes | None:
        """A DATA frame to ``identity``; None when it has no session (nothing to send)."""
        if self._key is None:
            return payload
        state = self._sessions.get(identity)
        if state is None:
            return None
        state.sent = _next_seq(state.sent)
        return _seal(state.mac, Kind.TO_PREFILL, state.session, state.sent, payload)

    def seal_reset(self, session: bytes, seq: int) -> bytes:
        """Tell a peer that ``session`` is unknown here (so it handshakes again)."""
        if self._key is None:
            raise ProtocolError("RESET is only sent on an authenticated control plane")
        return _seal(self._key.mac, Kind.RESET, session, seq, b"")

    def forget(self, identity: bytes) -> None:
        self._sessions.pop(identity, None)
        self._pending.pop(identity, None)
