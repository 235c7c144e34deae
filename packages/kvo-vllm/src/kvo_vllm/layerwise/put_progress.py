"""Keeps vLLM stepping until a step's staged store put is counted in ``/metrics``.

With save staging (``staging``) a step's blocks reach the store in one batched put that ends
after the step, so its bytes enter the worker's counters only then. vLLM reads a worker's
counters at the end of each step, and an engine with no request left stops stepping: without
help the last step's saved bytes would reach ``/metrics`` only with the next request, or never
on an idle server. So each step's output says whether a staged put was still running when the
worker read its counters (:class:`StagedPutsPending`, vLLM's worker -> scheduler metadata, ORed
over the tensor-parallel ranks), and the scheduler side answers vLLM's ``has_pending_push_work``
with it: the engine runs empty steps (no forward) until a step's counters include the put.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata


@dataclass(frozen=True)
class StagedPutsPending(KVConnectorWorkerMetadata):
    """A worker's answer for one step: a staged put was still running after its counters were
    read. A module-level class so that vLLM's multiprocess executor ships it by name."""

    pending: bool

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, StagedPutsPending):
            return StagedPutsPending(pending=self.pending or other.pending)
        return self


class PendingPutsTracker:
    """Scheduler side: the last report of the workers (False until one arrives)."""

    def __init__(self) -> None:
        self.pending = False

    def update(self, meta: KVConnectorWorkerMetadata | None) -> None:
        """Take a step's aggregated worker metadata; other connectors' kinds are ignored."""
        if isinstance(meta, StagedPutsPending):
            self.pending = meta.pending
