"""Test-only fault injection on decode's data path, plugged into a decode's ``DecodePuller``.

A decode vLLM server started by the end-to-end tests or the soak with
``kvo_tools.pd.sites.faulty_decode_env(control_file)`` in its environment reads through ``wrap``
(``kvo_tools.pd.engine_site`` patches it in; ``{tp_rank}`` in the path names one file per TP
rank). The control file holds
``{"corrupt_reads": bool, "corrupt_part": "kv" | "idx" | null, "fail_reads": int,
"stall_reads_s": seconds, "drop_acks": int}`` and is re-read whenever it changes, so a test can
switch faults on and off in a running server: corrupt every pulled byte range after it arrived
(only those that land in one part's caches, main KV ``kv`` or indexer ``idx``, when
``corrupt_part`` names it), fail the next N engine reads, stall every read (a decode that is slow
or stops answering), or drop the next N READ_DONE answers on their way to the prefill (a lost
acknowledgement: the decode read and accepted the layer, the prefill never hears of it).
Only reads into the KV layers are touched, never the fence words a read checks afterwards.
The dropped answers are the one fault outside the engine: ``wrap`` wraps the decode process's
``DecodeReceiver._reply`` (the frame is never sent). Production code never imports this module.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvo_transport.address_spans import AddressSpans
from kvo_transport.engine import DelegatingEngine, TransferEngine
from kvo_transport.errors import TransferError

logger = logging.getLogger(__name__)

CORRUPT_BYTE = 0x3F
"""Fills corrupted ranges: as float32 every element becomes ~0.75, far from real KV."""


@attrs.frozen
class Faults:
    corrupt_reads: bool = False
    corrupt_part: str | None = None
    fail_reads: int = 0
    stall_reads_s: float = 0.0
    drop_acks: int = 0

    @classmethod
    def from_value(cls, value: Any) -> Faults:
        if not isinstance(value, Mapping):
            raise ValueError(f"faults must be a mapping, got {value!r}")
        unknown = sorted(set(value) - {"corrupt_reads", "corrupt_part", "fail_reads",
                                       "stall_reads_s", "drop_acks"})
        if unknown:
            raise ValueError(f"unknown fault key(s) {unknown}")
        corrupt, fail = value.get("corrupt_reads", False), value.get("fail_reads", 0)
        stall = value.get("stall_reads_s", 0.0)
        part = value.get("corrupt_part")
        drop = value.get("drop_acks", 0)
        if not isinstance(drop, int) or isinstance(drop, bool) or drop < 0:
            raise ValueError(f"drop_acks must be an integer >= 0, got {drop!r}")
        if part not in (None, "kv", "idx"):
            raise ValueError(f"corrupt_part must be 'kv', 'idx' or null, got {part!r}")
        if not isinstance(corrupt, bool):
            raise ValueError(f"corrupt_reads must be true or false, got {corrupt!r}")
        if not isinstance(fail, int) or isinstance(fail, bool) or fail < 0:
            raise ValueError(f"fail_reads must be an integer >= 0, got {fail!r}")
        if not isinstance(stall, int | float) or isinstance(stall, bool) or not 0 <= stall <= 600:
            raise ValueError(f"stall_reads_s must be seconds in [0, 600], got {stall!r}")
        return cls(corrupt_reads=corrupt, corrupt_part=part, fail_reads=fail,
                   stall_reads_s=float(stall), drop_acks=drop)


class FaultyEngine(DelegatingEngine):
    """Delegates to decode's engine, applying the control file's faults to layer reads."""

    def __init__(self, engine: TransferEngine, layers: Sequence[Any], control_file: str) -> None:
        super().__init__(engine)
        self._parts: AddressSpans[str] = AddressSpans(
            (layer.base, layer.end, str(getattr(layer, "part", "kv"))) for layer in layers)
        self._control_file = control_file
        self._stamp: tuple[int, int] | None = None
        self._faults = Faults()
        self._failures_left = 0
        self._acks_to_drop = 0
        self.dropped_acks = 0
        self._lock = threading.Lock()
        self.injected_failures = 0
        self.corrupted_bytes = 0

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"injected_failures": self.injected_failures,
                    "corrupted_bytes": self.corrupted_bytes, "dropped_acks": self.dropped_acks}

    def take_ack_drop(self) -> bool:
        """Whether the READ_DONE about to be sent is to be lost (counts it)."""
        with self._lock:
            self._reload()
            if self._acks_to_drop <= 0:
                return False
            self._acks_to_drop -= 1
            self.dropped_acks += 1
            return True

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        data = bool(local_addrs) and self._in_layers(local_addrs[0])
        with self._lock:
            self._reload()
            if data and self._failures_left > 0:
                self._failures_left -= 1
                self.injected_failures += 1
                raise TransferError("fault injection: this read was failed on purpose")
            stall = self._faults.stall_reads_s if data else 0.0
            corrupt = self._faults.corrupt_reads and data
            part = self._faults.corrupt_part
        if stall > 0:
            time.sleep(stall)
        self._engine.read(peer, local_addrs, remote_addrs, lengths)
        if corrupt:
            damaged = 0
            for address, length in zip(local_addrs, lengths, strict=True):
                if part is None or self._part_of(address) == part:
                    ctypes.memset(address, CORRUPT_BYTE, length)
                    damaged += length
            with self._lock:
                self.corrupted_bytes += damaged

    def _in_layers(self, address: int) -> bool:
        return self._part_of(address) is not None

    def _part_of(self, address: int) -> str | None:
        return self._parts.find(address)

    def _reload(self) -> None:
        """Apply the control file when it changed (lock held)."""
        try:
            stat = os.stat(self._control_file)
        except OSError:
            return
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            with open(self._control_file) as source:
                faults = Faults.from_value(json.load(source))
        except (OSError, ValueError) as error:
            logger.error("kvo fault injection: ignoring %s: %s", self._control_file, error)
            return
        self._faults = faults
        self._failures_left = faults.fail_reads
        self._acks_to_drop = faults.drop_acks
        logger.warning("kvo fault injection now: %s", faults)


_ACTIVE: FaultyEngine | None = None
"""The faulty engine of this decode process (the one the answer dropper asks)."""


def drop_this_answer(message: object) -> bool:
    """True when ``message`` is a READ_DONE the control file says to lose."""
    from kvo_transport.protocol import ReadDone

    engine = _ACTIVE
    if not isinstance(message, ReadDone) or engine is None or not engine.take_ack_drop():
        return False
    logger.warning("kvo fault injection: READ_DONE seq %d (layer %d) dropped on its way",
                   message.seq, message.layer_index)
    return True


def _install_answer_dropper() -> None:
    """Wrap DecodeReceiver._reply once per process: a dropped READ_DONE is never sent."""
    from kvo_transport.decode_side import DecodeReceiver

    original = DecodeReceiver._reply
    if getattr(original, "kvo_fault_injection", False):
        return

    def _reply(self: DecodeReceiver, identity: bytes, message: Any) -> None:
        if drop_this_answer(message):
            return
        original(self, identity, message)

    _reply.kvo_fault_injection = True  # type: ignore[attr-defined]
    DecodeReceiver._reply = _reply  # type: ignore[method-assign]


def wrap(engine: TransferEngine, layers: Sequence[Any], *, control_file: str) -> FaultyEngine:
    """The engine wrapper factory (also installs the READ_DONE dropper). In a decode with
    TP > 1, ``{tp_rank}`` in ``control_file`` becomes this worker's TP rank: one control file
    per rank, so a test can fault one rank's pulls."""
    global _ACTIVE
    if "{tp_rank}" in control_file:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        control_file = control_file.replace("{tp_rank}", str(get_tensor_model_parallel_rank()))
    _ACTIVE = FaultyEngine(engine, layers, control_file)
    _install_answer_dropper()
    return _ACTIVE
