"""The prefill <-> decode control plane in one import: both sides and the wire protocol.

``PrefillPublisher`` (prefill_side) handshakes with decode ranks, publishes READY per layer and
drives kvo_core's slot gates; ``DecodeReceiver`` (decode_side) validates READYs, pulls through
the TransferEngine and answers. ``read_plan`` holds the decode-side layout and checks.
"""

from __future__ import annotations

from kvo_transport.decode_side import (
    ControlSocketError,
    DecodeReceiver,
    InvalidCallback,
    decode_control_endpoint,
)
from kvo_transport.prefill_side import (
    HandshakeRejectedError,
    PrefillPublisher,
    PublishedLayer,
    PublisherClosedError,
)
from kvo_transport.protocol import LayerMeta, ReadyRequest, TensorGroup
from kvo_transport.read_plan import (
    DecodeLayout,
    DestinationGroup,
    DestinationLayer,
    RequestDestination,
    Resolver,
)
from kvo_transport.receive_ledger import InvalidBlocks

__all__ = [
    "ControlSocketError",
    "DecodeLayout",
    "DecodeReceiver",
    "DestinationGroup",
    "DestinationLayer",
    "HandshakeRejectedError",
    "InvalidBlocks",
    "InvalidCallback",
    "LayerMeta",
    "PrefillPublisher",
    "PublishedLayer",
    "PublisherClosedError",
    "ReadyRequest",
    "RequestDestination",
    "Resolver",
    "TensorGroup",
    "decode_control_endpoint",
]
