"""Test-only hostile peers for the soak: a second connection that claims a live prefill's
routing id on the decode's control socket (the takeover of issue 36, as
packages/kvo-transport/tests/test_control_availability.py does it).

The routing id of the prefill's live connection is read from the decode's log: the decode
logs it (``on connection b'...'``) when it accepts the prefill's handshake. The newcomer
connects with that id, sends a handshake frame sealed with a key that is not the deployment's
and waits briefly for an answer. A decode whose ROUTER refused the newcomer (kvo's does:
ROUTER_HANDOVER off) never reads its frames and never answers; one that let it take the id
over would answer it, and the original prefill's frames would go unread from then on.
Production code never imports this module.
"""

from __future__ import annotations

import ast
import re
import threading
import time
from pathlib import Path
from typing import Any

import attrs

ACCEPTED = re.compile(r"accepted MF_META from .*? on connection (b'(?:[^'\\]|\\.)*')")


def live_routing_id(decode_log: Path) -> bytes | None:
    """The routing id of the last prefill connection the decode accepted (None: none yet)."""
    try:
        text = decode_log.read_text(errors="replace")
    except OSError:
        return None
    found = ACCEPTED.findall(text)
    if not found:
        return None
    value = ast.literal_eval(found[-1])
    return value if isinstance(value, bytes) else None


@attrs.define
class TakeoverCounts:
    """How often a newcomer claimed the live routing id, and how often the decode answered it
    (must stay 0)."""

    attempts: int = 0
    answered: int = 0


def take_over(context: Any, endpoint: str, identity: bytes, frame: bytes,
              wait_ms: int = 300) -> bytes | None:
    """Connect with ``identity``, send ``frame``, leave; the answer it got, if any."""
    import zmq

    thief = context.socket(zmq.DEALER)
    thief.setsockopt(zmq.LINGER, 0)
    thief.setsockopt(zmq.ROUTING_ID, identity)
    thief.connect(endpoint)
    try:
        thief.send(frame)
        return bytes(thief.recv()) if thief.poll(wait_ms) else None
    finally:
        thief.close()


def keep_taking_over(endpoint: str, decode_log: Path, counts: TakeoverCounts,
                     stop: threading.Event, pause_s: float = 0.2) -> None:
    """Claim the live prefill connection's routing id again and again until ``stop``."""
    import zmq

    from kvo_transport.frame_auth import AuthCounters, ControlKey, PrefillChannel
    from kvo_transport.protocol import PROTOCOL_VERSION, ReadReadyBatch, encode

    hello = PrefillChannel(ControlKey.from_secret("a key that is not the soak's"),
                           AuthCounters()).seal_hello(
        encode(ReadReadyBatch(version=PROTOCOL_VERSION, seq=1, layer_index=0,
                              layer_name="model.layers.0.self_attn.attn", member=0, ratio=1)))
    context = zmq.Context()
    try:
        while not stop.is_set():
            identity = live_routing_id(decode_log)
            if identity is not None:
                counts.attempts += 1
                if take_over(context, endpoint, identity, hello) is not None:
                    counts.answered += 1
            stop.wait(pause_s)
    finally:
        context.destroy(linger=0)
        time.sleep(0.05)
