"""The worker -> scheduler report that keeps vLLM stepping until a staged put is counted."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvo_vllm.layerwise.put_progress import PendingPutsTracker, StagedPutsPending


class OtherMeta(KVConnectorWorkerMetadata):
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return self


def test_ranks_aggregate_to_pending_when_any_rank_is() -> None:
    idle, busy = StagedPutsPending(pending=False), StagedPutsPending(pending=True)
    assert idle.aggregate(busy) == busy and busy.aggregate(idle) == busy
    assert idle.aggregate(StagedPutsPending(pending=False)) == idle
    assert busy.aggregate(OtherMeta()) is busy


def test_the_tracker_follows_the_last_report_and_ignores_other_kinds() -> None:
    tracker = PendingPutsTracker()
    assert not tracker.pending
    tracker.update(StagedPutsPending(pending=True))
    tracker.update(None)  # a step whose output carried no report changes nothing
    tracker.update(OtherMeta())
    assert tracker.pending
    tracker.update(StagedPutsPending(pending=False))
    assert not tracker.pending
