"""Decode's transfer engine, wrapped to count bytes and seconds per layer.

The counts are the demo's "per-layer transfer time". Revocation lives in the transport
(kvo_transport.destinations, owned by the DecodeReceiver): no lock is held across a read here,
so nothing waits behind a stalled transfer. The wrapper still carries the test-only fault
injection.
"""

from __future__ import annotations

import bisect
import ctypes
import json
import logging
import os
import threading
import time
from collections.abc import Sequence

import attrs

from kvo_transport.engine import TransferEngine
from kvo_transport.errors import TransferError
from kvo_vllm.remote_d2h.options import FaultInjection

logger = logging.getLogger(__name__)

CORRUPT_BYTE = 0x3F
"""Fills corrupted ranges: as float32 every element becomes ~0.75, far from real KV."""


@attrs.frozen
class LayerRegion:
    """Where one destination layer lives, to map a local address to (layer, block)."""

    index: int
    base: int
    block_bytes: int
    num_blocks: int

    @property
    def end(self) -> int:
        return self.base + self.block_bytes * self.num_blocks


@attrs.define
class LayerTransferStats:
    reads: int = 0
    bytes: int = 0
    seconds: float = 0.0


class GuardedEngine:
    """A TransferEngine for the decode receiver: per-layer stats, fault injection."""

    def __init__(self, engine: TransferEngine, layers: Sequence[LayerRegion],
                 faults: FaultInjection | None = None) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._layers = sorted(layers, key=lambda layer: layer.base)
        self._bases = [layer.base for layer in self._layers]
        self._faults = faults or FaultInjection()
        self._failures_left = self._faults.fail_reads
        self._control_stamp: tuple[int, int] | None = None
        self.per_layer: dict[int, LayerTransferStats] = {}
        self.injected_failures = 0
        self.corrupted_bytes = 0

    # -- the TransferEngine surface the receiver uses -------------------------------------

    @property
    def backend(self) -> str:
        return self._engine.backend

    @property
    def protocol(self) -> str:
        return self._engine.protocol

    @property
    def session_id(self) -> str:
        return self._engine.session_id

    def register(self, ptr: int, length: int) -> None:
        self._engine.register(ptr, length)

    def unregister(self, ptr: int) -> None:
        self._engine.unregister(ptr)

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        data = bool(local_addrs) and self._layer_of(local_addrs[0]) is not None
        with self._lock:  # the fault state only: the read itself runs outside any lock
            if self._faults.control_file is not None:
                self._reload_faults(self._faults.control_file)
            if self._failures_left > 0:
                self._failures_left -= 1
                self.injected_failures += 1
                raise TransferError("fault injection: this read was failed on purpose")
            stall = self._faults.stall_reads_s if data else 0.0
            corrupt = self._faults.corrupt_reads and data  # KV bytes, not a fence's words
        if stall > 0:
            time.sleep(stall)
        started = time.perf_counter()
        self._engine.read(peer, local_addrs, remote_addrs, lengths)
        elapsed = time.perf_counter() - started
        with self._lock:
            if corrupt:
                for address, length in zip(local_addrs, lengths, strict=True):
                    ctypes.memset(address, CORRUPT_BYTE, length)
                    self.corrupted_bytes += length
            self._account(local_addrs, lengths, elapsed)

    def _reload_faults(self, path: str) -> None:
        """Apply the control file's settings when it changed (lock held)."""
        try:
            stat = os.stat(path)
        except OSError:
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._control_stamp:
            return
        self._control_stamp = stamp
        try:
            with open(path) as source:
                faults = FaultInjection.from_value(json.load(source), allow_control_file=False)
        except (OSError, ValueError) as error:
            logger.error("kvo fault injection: ignoring control file %s: %s", path, error)
            return
        self._faults = FaultInjection(corrupt_reads=faults.corrupt_reads,
                                      fail_reads=faults.fail_reads, control_file=path,
                                      stall_reads_s=faults.stall_reads_s)
        self._failures_left = faults.fail_reads
        logger.warning("kvo fault injection now: corrupt_reads=%s fail_reads=%d",
                       faults.corrupt_reads, faults.fail_reads)

    def write(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
              lengths: Sequence[int]) -> None:
        raise TransferError("decode's guarded engine only reads")

    def close(self) -> None:
        self._engine.close()

    # -- where an address lives ---------------------------------------------------------------

    def _layer_of(self, address: int) -> LayerRegion | None:
        i = bisect.bisect_right(self._bases, address) - 1
        if i < 0 or address >= self._layers[i].end:
            return None
        return self._layers[i]

    def _account(self, addresses: Sequence[int], lengths: Sequence[int], seconds: float) -> None:
        layer = self._layer_of(addresses[0]) if addresses else None
        if layer is None:
            return  # not a layer's data (the fence words of a read land elsewhere)
        stats = self.per_layer.setdefault(layer.index, LayerTransferStats())
        stats.reads += 1
        stats.bytes += sum(lengths)
        stats.seconds += seconds
