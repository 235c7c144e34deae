"""Test-only timeline of a decode's pulls, plugged into a decode's ``DecodePuller``.

``kvo_tools.bench._pd_timeline`` starts a decode with
``kvo_tools.pd.sites.timed_decode_env(out_file)`` in its environment, and this module appends
one JSON line per event to ``out_file``, stamped with ``time.monotonic()`` (CLOCK_MONOTONIC: one
clock for every process of the host, so the proxy's and the client's stamps line up with these):
``register`` (the step that made a request's blocks the destination and sent DecodeReady),
``read`` (start and end of each engine read into the KV layers), ``reported`` (the step that
told vLLM a request's pull is over), ``step`` and ``collected`` (each worker step's start, idle
or not, and the end of its ``collect``).
Production code never imports this module.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvo_transport.address_spans import AddressSpans
from kvo_transport.engine import DelegatingEngine, TransferEngine

_LOCK = threading.Lock()
_OUT: str | None = None


def _emit(event: dict[str, Any]) -> None:
    if _OUT is None:
        return
    with _LOCK, open(_OUT, "a") as out:
        out.write(json.dumps(event) + "\n")


class TimingEngine(DelegatingEngine):
    """Delegates to decode's engine and records when each read into the layers ran."""

    def __init__(self, engine: TransferEngine, layers: Sequence[Any]) -> None:
        super().__init__(engine)
        self._layers = AddressSpans((layer.base, layer.end, int(layer.index)) for layer in layers)

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
             lengths: Sequence[int]) -> None:
        start = time.monotonic()
        self._engine.read(peer, local_addrs, remote_addrs, lengths)
        layer = self._layers.find(local_addrs[0]) if local_addrs else None  # None: a fence word
        _emit({"event": "read", "start": start, "end": time.monotonic(), "layer": layer,
               "bytes": int(sum(lengths))})


def _install_hooks() -> None:
    from kvo_vllm.remote_d2h.decode_worker import DecodePuller

    if getattr(DecodePuller._register, "kvo_timing", False):
        return
    register, collect = DecodePuller._register, DecodePuller.collect
    start_step = DecodePuller.start_step

    def _start_step(self: DecodePuller, metadata: Any) -> None:
        _emit({"event": "step", "t": time.monotonic(), "idle": bool(metadata.idle)})
        start_step(self, metadata)

    def _register(self: DecodePuller, target: Any) -> None:
        _emit({"event": "register", "t": time.monotonic(), "request": target.request_id,
               "transfer": target.transfer_id})
        register(self, target)

    def _collect(self: DecodePuller) -> tuple[set[str], set[int]]:
        done, invalid = collect(self)
        _emit({"event": "collected", "t": time.monotonic(), "count": len(done)})
        if done:
            _emit({"event": "reported", "t": time.monotonic(), "requests": sorted(done)})
        return done, invalid

    _register.kvo_timing = True  # type: ignore[attr-defined]
    DecodePuller._register = _register  # type: ignore[method-assign]
    DecodePuller.collect = _collect  # type: ignore[method-assign]
    DecodePuller.start_step = _start_step  # type: ignore[method-assign]


def wrap(engine: TransferEngine, layers: Sequence[Any], *, out_file: str) -> TimingEngine:
    """The engine wrapper factory (also hooks the puller's register and report)."""
    global _OUT
    _OUT = out_file
    _install_hooks()
    return TimingEngine(engine, layers)
