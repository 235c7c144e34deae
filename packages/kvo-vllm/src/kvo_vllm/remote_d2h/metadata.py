"""What RemoteD2H's scheduler half tells its worker half each step.

Plain frozen dataclasses of tuples, strings and ints: vLLM may pickle connector metadata to
send it to worker processes, and nothing here may hold scheduler objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

IDLE_WAIT_S = 0.005
"""On an ``idle`` step (no tokens scheduled) while transfers are in flight, how long a worker
waits for one to finish before answering vLLM (it returns as soon as one does). vLLM steps such
an engine again after a 1 ms sleep and each empty step costs about as much CPU time as that:
without the wait a decode waiting for pulls, or a prefill waiting for its READYs to be read,
loops as fast as it can (on a small host that starved the other engine of CPU time; see
docs/benchmarks.md and docs/troubleshooting.md). A new request reaching such an engine waits at
most this long longer to be scheduled."""


@dataclass(frozen=True)
class SendChunk:
    """Prefill: after each layer of this step, publish these blocks of ``transfer_id``.

    The chunk is the request's logical blocks ``[start_block, start_block + len(block_ids))``;
    ``last`` marks the step that completes the prompt (its last layer ends the request's sends).
    """

    request_id: str
    transfer_id: str
    decode_endpoints: tuple[str, ...]
    start_block: int
    block_ids: tuple[int, ...]
    last: bool
    notify_url: str | None = None


@dataclass(frozen=True)
class RecvTarget:
    """Decode: the blocks that receive transfer ``transfer_id`` (one per logical block).

    Logical blocks below ``skip_blocks`` are decode's own prefix-cache hit: they are not
    written (their entries are -1, so a READY naming them is refused).
    """

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    skip_blocks: int
    notify_url: str | None = None


@dataclass(frozen=True)
class RemoteD2HMetadata(KVConnectorMetadata):
    """One engine step's work for the worker half."""

    sends: tuple[SendChunk, ...] = ()
    """Prefill: chunks to publish layer by layer during this step's forward."""
    abandoned_sends: tuple[str, ...] = ()
    """Prefill: request ids that finished before their last chunk was published."""
    recvs: tuple[RecvTarget, ...] = ()
    """Decode: new destinations to register and advertise."""
    revoked_recvs: tuple[str, ...] = ()
    """Decode: request ids whose pull must stop (aborted); each is answered once as received."""
    declined_recvs: tuple[str, ...] = ()
    """Decode: transfer ids decode computes itself (nothing to pull, or aborted before its
    blocks were allocated): READYs for them are answered with nothing read."""
    preempted_sends: tuple[str, ...] = ()
    """Prefill: transfer ids whose request vLLM preempted (its blocks were freed without the
    connector): their epoch words advance before this step's forward may overwrite them."""
    idle: bool = False
    """The step schedules no tokens: a decode whose requests all wait for their pulls may
    sleep briefly for one to finish instead of letting vLLM step again at once."""

    @property
    def has_sends(self) -> bool:
        return bool(self.sends or self.preempted_sends)
