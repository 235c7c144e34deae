"""HMAC-SHA256 signatures on the engines' POSTs to the proxy's notify endpoint.

A forged ``DecodeReady`` could send a request's KV to another endpoint, a forged
``PrefillFailed`` abort it; so, with a control secret set, each notification carries
``X-Kvo-Auth: v1 <sender>.<seq>.<mac>``: a random sender id per Notifier, a sequence number
that grows by one per POST, and HMAC-SHA256 (key derived from the secret as in
kvo_transport.frame_auth) over the sender, the sequence and the exact body bytes. The proxy
accepts a sender's numbers only upward (a replay is refused) and remembers the last
``MAX_SENDERS`` senders. A proxy that restarts forgets them; a notification replayed to it
names a transfer id it never issued and is ignored.
"""

from __future__ import annotations

import hmac
import re
from collections import OrderedDict
from typing import Final

from kvo_transport.frame_auth import AuthCounters, ControlKey, FrameRejectedError, Rejection

HEADER: Final = "X-Kvo-Auth"
MAX_SENDERS: Final = 4096
_VALUE = re.compile(r"^v1 ([0-9a-f]{16})\.([0-9]{1,20})\.([0-9a-f]{64})$")


def _mac(key: ControlKey, sender: str, seq: int, body: bytes) -> str:
    message = b"notify\x00" + sender.encode() + b"\x00" + str(seq).encode() + b"\x00" + body
    return hmac.digest(key.master, message, "sha256").hex()


def sign(key: ControlKey, sender: str, seq: int, body: bytes) -> str:
    """The header value for one POST of ``body``."""
    return f"v1 {sender}.{seq}.{_mac(key, sender, seq, body)}"


class NotifyVerifier:
    """The proxy's check of each notification (one event loop: no locking)."""

    def __init__(self, key: ControlKey | None) -> None:
        self._key = key
        self.counters = AuthCounters()
        self._last: OrderedDict[str, int] = OrderedDict()

    def verify(self, header: str | None, body: bytes) -> None:
        """Raise FrameRejectedError (counted) unless ``body`` may be acted on."""
        try:
            self._verify(header, body)
        except FrameRejectedError as exc:
            self.counters.count(exc.rejection)
            raise

    def _verify(self, header: str | None, body: bytes) -> None:
        if self._key is None:
            if header is not None:
                raise FrameRejectedError(Rejection.UNEXPECTED_MAC,
                                         "signed notification but this proxy has no control "
                                         "secret (set KVO_CONTROL_SECRET for the proxy too)")
            return
        if header is None:
            raise FrameRejectedError(Rejection.MISSING_MAC, f"no {HEADER} header")
        match = _VALUE.match(header)
        if match is None:
            raise FrameRejectedError(Rejection.BAD_MAC, f"malformed {HEADER} header")
        sender, seq, mac = match.group(1), int(match.group(2)), match.group(3)
        if not hmac.compare_digest(_mac(self._key, sender, seq, body), mac):
            raise FrameRejectedError(Rejection.BAD_MAC, "signature does not verify (forged, "
                                     "altered, or another secret)")
        last = self._last.get(sender, -1)
        if seq <= last:
            raise FrameRejectedError(Rejection.REPLAY, f"sequence {seq} of sender {sender} is "
                                     f"not above the last accepted {last}")
        self._last[sender] = seq
        self._last.move_to_end(sender)
        while len(self._last) > MAX_SENDERS:
            self._last.popitem(last=False)
