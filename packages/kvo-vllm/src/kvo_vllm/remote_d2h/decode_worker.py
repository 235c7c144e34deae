"""Decode half of RemoteD2H's worker: pull each layer into decode's own KV-cache blocks.

The KV cache itself is the destination (dense models): each layer tensor is registered with the
transfer engine and described to kvo_transport's DecodeReceiver, which validates every READY
and reads through the engine. A DSA model's layer has two parts: its main KV lands in vLLM's
MLA cache, or, with kvo's offload backend, in the rows of the host pool that the request's
vLLM blocks address (``pool_destination``); its indexer keys land in vLLM's device indexer
cache. The handshake checks both parts (a bf16 vs C8 indexer is named as such), and a READY
moves both or fails the layer. Per request:

1. the scheduler's metadata names the request's blocks; they become the destination of its
   transfer id and decode advertises them to the proxy (``DecodeReady``);
2. the prefill publishes READYs layer by layer; the receiver pulls and answers;
3. once every layer arrived, the request is reported received; vLLM schedules it;
4. a failed pull (refused READY, failed read, stale read caught by the fence, the prefill
   gave the request up (SEND_ABORTED), lost prefill past the deadline) revokes the
   destination in the transport (no read may start into it; revoking never waits for a read
   in flight), then reports the request received with its
   invalid blocks once the destination settled (no read in flight into it, a failed read's
   quarantine over), so vLLM's load-failure path recomputes them (or fails the request):
   never garbage tokens, and vLLM's step thread never waits on a stalled transfer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import attrs
import torch

from kvo_core.buffer_regions import INDEXER_PART, MAIN_PART
from kvo_core.config import RemoteD2HConfig
from kvo_core.errors import ConfigError
from kvo_core.tp import MainShare, control_port
from kvo_transport.control import (
    DecodeLayout,
    DecodeReceiver,
    DestinationGroup,
    DestinationLayer,
    RequestDestination,
)
from kvo_transport.decode_pulls import DecodePulls, invalid_blocks
from kvo_transport.engine import TransferEngine
from kvo_transport.frame_auth import control_key
from kvo_transport.pull_lifecycle import DeadlinePolicy
from kvo_transport.samehost_engine import SameHostEngine
from kvo_vllm.remote_d2h.fused_pool_split import RowSplittingEngine, StagingArena
from kvo_vllm.remote_d2h.guarded_engine import EngineWrapper, GuardedEngine, LayerRegion
from kvo_vllm.remote_d2h.kv_caches import (
    KVLayout,
    block_bytes,
    describe_kv_caches,
    merged_regions,
    transfer_engine_for,
)
from kvo_vllm.remote_d2h.metadata import IDLE_WAIT_S, RecvTarget, RemoteD2HMetadata
from kvo_vllm.remote_d2h.notify import Notifier
from kvo_vllm.remote_d2h.params import DecodeReady
from kvo_vllm.remote_d2h.pool_destination import PoolDestination, device_kv_bytes
from kvo_vllm.remote_d2h.step_watchdog import StepWatchdog

logger = logging.getLogger(__name__)


PoolFinder = Callable[[Mapping[str, torch.Tensor], KVLayout], "PoolDestination | None"]
"""(vLLM's caches, their layout) -> the host pool main KV lands in, or None (vLLM's cache)."""


class DecodePuller:
    """Owns the decode rank's engine, receiver and destinations (one per worker).

    Each request's pull is owned by the transport's ``DecodePulls`` (kvo_transport.
    decode_pulls: one state machine per pull, registered -> reading -> received, or returning
    -> returned, then reported); this worker registers and stops pulls as vLLM's scheduler
    says, and maps what it reports onto vLLM's finished requests and invalid blocks.
    """

    def __init__(self, *, config: RemoteD2HConfig, tp_rank: int, tp_size: int, dp_rank: int,
                 dp_size: int = 1, device_index: int | None = None,
                 engine_wrapper: EngineWrapper | None = None) -> None:
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device_index = tp_rank if device_index is None else device_index
        """This worker's accelerator on its node (MemFabric's default device)."""
        self.port = control_port(config.kv_port, dp_rank, tp_rank, tp_size)
        self._engine_wrapper = engine_wrapper
        self._pulls = DecodePulls(DeadlinePolicy(
            first_ready_s=config.handshake_timeout_s + config.layer_deadline_s,
            next_ready_s=config.layer_deadline_s))
        self._notifier = Notifier("kvo-decode-notify", control_key(config.control_secret))
        self._engine: GuardedEngine | None = None
        self._raw: TransferEngine | None = None
        self._receiver: DecodeReceiver | None = None
        self._watchdog: StepWatchdog | None = None
        self._registered: list[int] = []
        self._pool: PoolDestination | None = None
        self._device_kv: dict[str, int] = {}
        self._idle = False

    @property
    def endpoint(self) -> str:
        if self._receiver is None:
            raise RuntimeError("register_kv_caches has not run yet")
        return self._receiver.endpoint

    @property
    def engine(self) -> GuardedEngine:
        if self._engine is None:
            raise RuntimeError("register_kv_caches has not run yet")
        return self._engine

    # -- set-up -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor],
                           find_pool: PoolFinder | None = None,
                           indexer_label: Callable[[int], str] | None = None) -> None:
        """Describe and register the destinations: each layer's main KV (vLLM's cache, or the
        DSA offload backend's host pool when ``find_pool`` finds one) and indexer cache."""
        layout = describe_kv_caches(kv_caches)
        pool = None if find_pool is None else find_pool(kv_caches, layout)
        refuse_untested_dsa_decode_tp(layout.has_indexer, self.tp_size)
        refuse_untested_fused_decode_tp(pool, self.tp_size)
        self._pool = pool
        self._device_kv = device_kv_bytes(layout, pool)
        config = self.config
        tensors = [t for layer in layout.layers for _, t in layer.tensors()]
        raw = transfer_engine_for(config, tensors, role="Decode",
                                  device_index=self.device_index)
        regions = []
        dest_layers = []
        spans = layout.spans() if pool is None else [
            (int(t.data_ptr()), int(t.data_ptr()) + t.shape[0] * block_bytes(t))
            for layer in layout.layers if (t := layer.indexer) is not None]
        if pool is not None:
            spans.append((pool.region[0], pool.region[0] + pool.region[1]))
        for layer in layout.layers:
            num_blocks = layer.main.shape[0]
            if pool is None:
                main_base, main_bytes = layer.main.data_ptr(), layout.main_block_bytes
            else:
                main_base, main_bytes = pool.bases[layer.name], pool.block_bytes
            regions.append(LayerRegion(index=layer.index, base=main_base, block_bytes=main_bytes,
                                       num_blocks=num_blocks, part=MAIN_PART))
            indexer = None
            if layer.indexer is not None:
                indexer_bytes = block_bytes(layer.indexer)
                regions.append(LayerRegion(index=layer.index, base=layer.indexer.data_ptr(),
                                           block_bytes=indexer_bytes, num_blocks=num_blocks,
                                           part=INDEXER_PART))
                indexer = DestinationGroup(base_addrs=(layer.indexer.data_ptr(),),
                                           block_bytes=(indexer_bytes,), num_blocks=num_blocks,
                                           label=indexer_label)
            dest_layers.append(DestinationLayer(
                name=layer.name, indexer=indexer,
                main=DestinationGroup(base_addrs=(main_base,), block_bytes=(main_bytes,),
                                      num_blocks=num_blocks)))
        for start, end in merged_regions(spans):
            raw.register(start, end - start)
            self._registered.append(start)
        self._raw = raw
        arena = None if pool is None or not pool.fused_layers else StagingArena(
            pool.fused_layers[0].row_bytes)
        if arena is not None:   # the fused pool: whole blocks land here first, then split
            raw.register(*arena.region)
            self._registered.append(arena.region[0])
        wrapped = raw if self._engine_wrapper is None else self._engine_wrapper(
            raw, _wrapper_regions(regions, arena))
        if pool is not None and arena is not None:
            wrapped = RowSplittingEngine(wrapped, pool.fused_layers, arena)
        self._engine = GuardedEngine(wrapped, regions)
        share = main_share(pool, self.tp_rank, self.tp_size)
        self._receiver = DecodeReceiver(
            engine=self._engine, layout=DecodeLayout(dest_layers, main_share=share),
            resolve=self._pulls.resolve,
            decode_tp=self.tp_size, d_rank=self.tp_rank, host=config.local_hostname,
            port=self.port, read_retries=config.read_retries,
            retry_backoff_s=config.retry_backoff_s, on_invalid=self._pulls.on_invalid,
            control_secret=config.control_secret,
            destination_wait_s=config.destination_wait_s).start()
        self._pulls.attach(self._receiver, indexer=layout.has_indexer,
                           on_written=self._note_pulled)
        self._watchdog = StepWatchdog(
            name=f"decode DP rank {self.dp_rank} TP rank {self.tp_rank}/{self.tp_size}",
            threshold_s=max(1.0, config.layer_deadline_s / 2),
            waiting=self._waiting_for_the_step).start()
        logger.info("kvo remote_d2h decode rank %d/%d: %d layers of %d blocks (%s%s), control "
                    "endpoint %s, engine %s", self.tp_rank, self.tp_size, len(layout.layers),
                    layout.layers[0].main.shape[0],
                    ("main KV into the host pool" if pool is None or share.sharers == 1 else
                     f"main KV into the host pool shared by {share.sharers} TP ranks (this "
                     f"rank pulls part {share.rank} of each chunk)")
                    if pool is not None else "main KV",
                    " + indexer" if layout.has_indexer else "", self._receiver.endpoint,
                    raw.session_id)

    def _waiting_for_the_step(self) -> int:
        """Registered pulls plus READYs parked until the step registers their destination."""
        receiver = self._receiver
        return self._pulls.table.live + (0 if receiver is None else receiver.waiting_readies)

    # -- per step -----------------------------------------------------------------------

    def start_step(self, metadata: RemoteD2HMetadata) -> None:
        if self._watchdog is not None:
            self._watchdog.stepped()
        self._idle = metadata.idle
        for target in metadata.recvs:
            self._register(target)
        for request_id in metadata.revoked_recvs:
            self._pulls.stop(request_id, "aborted by vLLM")
        if self._receiver is not None:
            for transfer_id in metadata.declined_recvs:
                self._receiver.decline(transfer_id)

    def _register(self, target: RecvTarget) -> None:
        destination = RequestDestination(main_block_ids=target.block_ids,
                                         first_block=target.skip_blocks)
        if not self._pulls.register(target.transfer_id, target.request_id, destination):
            return  # the prefill gave it up before its blocks were registered
        ready = DecodeReady(transfer_id=target.transfer_id, d_rank=self.tp_rank,
                            decode_tp=self.tp_size, endpoint=self.endpoint,
                            skip_blocks=target.skip_blocks, num_blocks=len(target.block_ids),
                            dp_rank=self.dp_rank, dp_size=self.dp_size)
        self._notifier.post(target.notify_url, ready.to_json())

    # -- results ------------------------------------------------------------------------

    def collect(self) -> tuple[set[str], set[int]]:
        """(request ids received or given up since the last call, their invalid blocks)."""
        if self._receiver is None:
            return set(), set()
        if self._watchdog is not None:
            self._watchdog.stepped()
        wait_s = 0.0
        if self._idle and self._pulls.table.live:
            # Nothing to compute this step: sleep until a pull ends (or briefly) rather than
            # have vLLM step again at once (IDLE_WAIT_S). Never longer: a new request may wait.
            self._idle = False
            wait_s = IDLE_WAIT_S
        reported = self._pulls.collect(wait_s)
        return {pull.request_id for pull in reported}, invalid_blocks(reported)

    def _note_pulled(self, block_ids: tuple[int, ...]) -> None:
        """Tell the host pool's owner which blocks a pull wrote (step thread: before vLLM may
        schedule the request, and never while a forward reads the residency state)."""
        if self._pool is not None:
            self._pool.note_pulled(block_ids)

    def snapshot(self) -> dict[str, object]:
        """JSON-friendly counters for the stats file."""
        engine = self._engine
        per_layer = {} if engine is None else {
            str(index): attrs.asdict(stats) for index, stats in sorted(engine.per_layer.items())}
        per_part = {} if engine is None else {
            part: attrs.asdict(stats) for part, stats in sorted(engine.per_part.items())}
        return {"role": "decode", "endpoint": None if self._receiver is None else self.endpoint,
                "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                **attrs.asdict(self._pulls.counts), "per_layer": per_layer, "per_part": per_part,
                "main_into_host_pool": self._pool is not None,
                "device_kv": dict(self._device_kv),
                "refused_reads": (0 if self._receiver is None
                                  else self._receiver.destinations.refused_reads),
                "engine_wrapper": _wrapper_snapshot(engine),
                "same_host_bytes": self._raw.direct_bytes
                if isinstance(self._raw, SameHostEngine) else 0,
                "in_flight": self._pulls.table.live,
                "returning": self._pulls.table.returning,
                "stale_reads": 0 if self._receiver is None else self._receiver.stale_reads,
                "aborted_by_prefill": (0 if self._receiver is None
                                       else self._receiver.aborted_requests),
                "step_stalls": 0 if self._watchdog is None else self._watchdog.stalls}

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        self._notifier.close()
        if self._engine is not None:
            self._engine.close()


TESTED_DSA_DECODE_TP = 2
"""The largest decode TP a DSA P/D hand-off is tested at (offload: ranks share the host pool;
resident: each rank pulls into its own MLA cache)."""


def refuse_untested_dsa_decode_tp(has_indexer: bool, tp_size: int) -> None:
    """ConfigError for a DSA decode at a TP no test here runs (above ``TESTED_DSA_DECODE_TP``)."""
    if has_indexer and tp_size > TESTED_DSA_DECODE_TP:
        raise ConfigError(
            f"RemoteD2H receives a DSA model (main KV + indexer caches) on a decode with TP "
            f"{tp_size}; tested up to decode TP {TESTED_DSA_DECODE_TP} (offload and resident "
            f"mode): run the decode at TP 1 or 2")


def refuse_untested_fused_decode_tp(pool: PoolDestination | None, tp_size: int) -> None:
    """ConfigError for a P/D pull into a fused decode's pool (``kernel_backend="fused"``) at
    decode TP > 1: the TP ranks would split their shares of the shared pool on arrival, which
    no test here runs."""
    if pool is not None and pool.fused_layers and tp_size > 1:
        raise ConfigError(
            f"RemoteD2H into a DSA decode with kernel_backend 'fused' at decode TP {tp_size} "
            f"is not tested (fused P/D is tested at decode TP 1): run the fused decode at TP "
            f"1, or use kernel_backend 'auto' at TP {tp_size}")


def _wrapper_regions(regions: list[LayerRegion], arena: StagingArena | None
                     ) -> list[LayerRegion]:
    """The regions an operator's engine wrapper sees: with the fused pool, its reads of main KV
    land in the staging arena (one region of the main part), not in the pool's layers."""
    if arena is None:
        return regions
    base, size = arena.region
    staging = LayerRegion(index=-1, base=base, block_bytes=size, num_blocks=1, part=MAIN_PART)
    return [region for region in regions if region.part != MAIN_PART] + [staging]


def main_share(pool: PoolDestination | None, tp_rank: int, tp_size: int) -> MainShare:
    """Which part of each chunk's main KV this rank pulls (:class:`kvo_core.tp.MainShare`).

    Into the DP rank's shared host pool the TP ranks pull disjoint parts, so the prompt's
    replicated main KV is written once per DP rank and the traffic is spread over the ranks'
    engines (vllm-ascend's choice too); rank 0 pulling everything would write it once as well
    but put every main byte on one rank's engine. Into vLLM's own cache (one per rank) a rank
    needs the whole main KV."""
    return MainShare() if pool is None else MainShare(tp_size, tp_rank)


def _wrapper_snapshot(engine: GuardedEngine | None) -> dict[str, object]:
    """A configured engine wrapper's own counters, when it keeps any (``snapshot()``)."""
    snapshot = getattr(engine.inner, "snapshot", None) if engine is not None else None
    return dict(snapshot()) if callable(snapshot) else {}
