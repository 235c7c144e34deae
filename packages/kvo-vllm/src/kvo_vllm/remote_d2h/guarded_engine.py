"""Decode's transfer engine, wrapped to count bytes and seconds per layer, bytes per part.

The counts are the demo's "per-layer transfer time" and "bytes pulled per part" (main KV
``kv``, indexer ``idx``: kvo_core.buffer_regions' part names). Revocation lives in the transport
(kvo_transport.destinations, owned by the DecodeReceiver): no lock is held across a read here,
so nothing waits behind a stalled transfer. A ``DecodePuller`` built with an ``engine_wrapper``
reads through it between this and the real engine: the tests' fault injection, plugged in from
outside (kvo_tools.pd.sites); no config names one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import attrs

from kvo_core.buffer_regions import MAIN_PART
from kvo_transport.address_spans import AddressSpans
from kvo_transport.engine import DelegatingEngine, TransferEngine
from kvo_transport.errors import TransferError


@attrs.frozen
class LayerRegion:
    """Where one destination cache lives, to map a local address to (layer, part, block)."""

    index: int
    base: int
    block_bytes: int
    num_blocks: int
    part: str = MAIN_PART

    @property
    def end(self) -> int:
        return self.base + self.block_bytes * self.num_blocks


EngineWrapper = Callable[[TransferEngine, Sequence[LayerRegion]], TransferEngine]
"""(decode's engine, its layer regions) -> the engine the receiver reads through."""


@attrs.define
class LayerTransferStats:
    reads: int = 0
    bytes: int = 0
    seconds: float = 0.0


@attrs.define
class PartTransferStats:
    bytes: int = 0
    descriptors: int = 0


class GuardedEngine(DelegatingEngine):
    """A TransferEngine for the decode receiver that counts each layer's reads."""

    def __init__(self, engine: TransferEngine, layers: Sequence[LayerRegion]) -> None:
        super().__init__(engine)
        self._lock = threading.Lock()
        self._layers = AddressSpans((layer.base, layer.end, layer) for layer in layers)
        self.per_layer: dict[int, LayerTransferStats] = {}
        self.per_part: dict[str, PartTransferStats] = {}

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        started = time.perf_counter()
        self._engine.read(peer, local_addrs, remote_addrs, lengths)
        elapsed = time.perf_counter() - started
        with self._lock:
            self._account(local_addrs, lengths, elapsed)

    def write(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        raise TransferError("decode's guarded engine only reads")

    def _account(self, addresses: Sequence[int], lengths: Sequence[int], seconds: float) -> None:
        layer = self._layers.find(addresses[0]) if addresses else None
        if layer is None:
            return  # not a layer's data (the fence words of a read land elsewhere)
        stats = self.per_layer.setdefault(layer.index, LayerTransferStats())
        stats.reads += 1
        stats.bytes += sum(lengths)
        stats.seconds += seconds
        for address, length in zip(addresses, lengths, strict=True):
            region = self._layers.find(address)
            if region is not None:
                part = self.per_part.setdefault(region.part, PartTransferStats())
                part.bytes += length
                part.descriptors += 1
