"""Prefill's send accounting: one ``sends_failed`` per failed transfer, whatever its chunks."""

from __future__ import annotations

from kvo_core.config import RemoteD2HConfig
from kvo_vllm.remote_d2h.metadata import RemoteD2HMetadata, SendChunk
from kvo_vllm.remote_d2h.prefill_worker import PrefillSender


def chunk(transfer_id: str, start: int, last: bool) -> SendChunk:
    # No decode will answer: the sender has no engine yet, so the hand-off cannot start.
    return SendChunk(request_id=f"req-{transfer_id}", transfer_id=transfer_id,
                     decode_endpoints=("tcp://127.0.0.1:9",), start_block=start,
                     block_ids=(start, start + 1), last=last)


def test_a_failed_transfer_counts_once_however_many_chunks_follow() -> None:
    sender = PrefillSender(config=RemoteD2HConfig(kv_port=20100, handshake_timeout_s=1.0),
                           tp_rank=0, tp_size=1, instance_id="prefill-test")
    try:
        for step, start in enumerate((0, 2, 4)):  # chunked prefill: three chunks of "t1"
            sender.start_step(RemoteD2HMetadata(sends=(
                chunk("t1", start, last=step == 2), chunk(f"other{step}", 0, last=True))))
            assert sender.publish_layer("model.layers.0.self_attn.attn") == []
            sender.finished_sending(set())
        stats = sender.stats
        # t1 failed once; each of the three one-chunk transfers failed once.
        assert stats.handshake_failures == 4  # t1's first chunk, other0-2
        assert stats.sends_failed == 4 and stats.sends_done == 0
        assert sender.finished_sending({"req-t1", "req-other0"}) == {"req-t1", "req-other0"}
        assert stats.sends_failed == 4
    finally:
        sender.close()
