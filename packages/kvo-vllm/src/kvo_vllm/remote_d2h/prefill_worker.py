"""Prefill half of RemoteD2H's worker: expose the layer buffers, publish READY per layer.

At start-up every layer's KV tensor (a DSA layer: its MLA cache and its indexer key cache) is
registered with the transfer engine and described in MF_META (kvo_transport's
``PrefillPublisher`` handshakes it with each decode rank; aliased buffers simply repeat a base
address; the indexer is the layer's ``indexer`` group and each READY names its blocks too).
During a step, right after a layer's attention wrote its cache (the indexer wrote its keys
before), the step's chunks of that layer are published to the decode ranks; the answers close
the layer's part of the slot gate (buffer reuse) and, after a request's last layer, its
completion (its blocks may be freed).

Buffer reuse: with a slot-gate table (KvoMultiConnector gives the layerwise pipeline's), each
layer's reads are one part of the round the layer pipeline closes on the buffer: the sender
announces the part ``remote:STEP:LAYER:DECODE_TP`` before publishing (the answers may beat the
round) and its publisher joins the per-endpoint reads into it (kvo_core.gates); the pipeline's
round takes every part announced on the slot in its step, so no part name travels back. Without one
(RemoteD2H alone) nothing reuses the buffers and no slot is reported.

Fences (kvo_transport.fence): the sender's epoch words are registered with its engine and
shared by its publishers; the gate table advances a slot's word when a round fails (before
the layer pipeline may overwrite the buffer), and ``finished_sending`` releases a request's word
before vLLM gets its blocks back, so a decode still reading them refuses what it read.

Draft (MTP) layers: with speculative decoding (``speculative_config={"method": "mtp"}``)
vLLM's KV caches hold the drafter's layers after the model's (``model.layers.N`` for a model of
N layers) and the drafter writes them after the model's forward, in the same step: vLLM 0.32
then runs ``get_transfer_results`` (``finished_sending``) between the model and the drafter and
defers ``wait_for_save`` until after the drafter (``KVConnectorModelRunnerMixin``,
``defer_finalize``). So the step's chunks stay published to the draft layers until
``end_step`` (``wait_for_save``), and each layer is published once per step: the drafter runs
its layer once per draft token (``num_speculative_tokens`` > 1), the later passes writing only
rows past the step's tokens, which no chunk of the step holds. The draft layer is the last
layer, so a request's completion counts it (the decode, serving the same speculative config,
expects it too: its layer count is checked at the handshake).

A request whose hand-off cannot start (the decode refused the handshake, or did not answer in
time) is reported to the proxy with the reason, so the client gets a clear error instead of
waiting for the decode's deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import attrs
import torch

from kvo_core.config import RemoteD2HConfig
from kvo_core.gates import RequestCompletionTracker, SlotGates, SlotKey
from kvo_core.tp import TPMapping
from kvo_transport.control import LayerMeta, PrefillPublisher, ReadyRequest, TensorGroup
from kvo_transport.engine import TransferEngine
from kvo_transport.fence import FenceWords
from kvo_transport.frame_auth import control_key
from kvo_vllm.remote_d2h.kv_caches import (
    block_bytes,
    describe_kv_caches,
    merged_regions,
    transfer_engine_for,
)
from kvo_vllm.remote_d2h.metadata import IDLE_WAIT_S, RemoteD2HMetadata, SendChunk
from kvo_vllm.remote_d2h.notify import Notifier
from kvo_vllm.remote_d2h.params import PrefillFailed

logger = logging.getLogger(__name__)

REQUEST_PART = "remote-read"
MAX_REMEMBERED_FAILURES = 4096


@attrs.define
class _Send:
    request_id: str
    transfer_id: str
    published_at: float | None = None
    failure: str | None = None
    give_up_at: float | None = None
    """Set when the request cannot complete normally: report it done at this time."""
    counted: bool = False
    """Its transfer's failure is already in ``sends_failed`` (a later chunk of a failed
    transfer: one failure per transfer, not one per chunk)."""
    endpoint: str | None = None
    """The decode control endpoint its READYs go to, and that endpoint's decode TP size."""
    decode_tp: int = 0


@attrs.define
class PrefillStats:
    handshakes: int = 0
    handshake_failures: int = 0
    published_layers: int = 0
    published_blocks: int = 0
    published_bytes: int = 0
    sends_done: int = 0
    sends_failed: int = 0


class PrefillSender:
    """Owns the prefill rank's engine and publishers; one per worker."""

    def __init__(self, *, config: RemoteD2HConfig, tp_rank: int, tp_size: int,
                 instance_id: str, gates: SlotGates | None = None,
                 device_index: int | None = None, first_draft_layer: int | None = None) -> None:
        self.config = config
        self.first_draft_layer = first_draft_layer
        """Layers at or past this index are the drafter's (MTP), written after the model's
        forward; None without speculative decoding."""
        self.tp_rank = tp_rank
        self.device_index = tp_rank if device_index is None else device_index
        """This worker's accelerator on its node (MemFabric's default device)."""
        self.tp_size = tp_size
        self.instance_id = instance_id
        self.stats = PrefillStats()
        self._gates = gates
        self._tracker = RequestCompletionTracker()
        self._engine: TransferEngine | None = None
        self._fences: FenceWords | None = None
        self._layers: tuple[LayerMeta, ...] = ()
        self._index_of: dict[str, int] = {}
        self._slot_keys: dict[str, SlotKey] = {}
        self._block_bytes = 0
        self._indexer_block_bytes = 0
        self._bases: dict[int, int] = {}
        self._publishers: dict[int, PrefillPublisher] = {}
        self._publishers_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sends: dict[str, _Send] = {}  # transfer id -> state
        self._done: set[str] = set()  # vLLM request ids whose sends are over
        self._settled: dict[str, str | None] = {}  # transfer id -> None (ok) or the failure
        self._failed: OrderedDict[str, str] = OrderedDict()
        """Transfers that failed: later chunks of theirs (chunked prefill) are not published."""
        self._vllm_finished: set[str] = set()
        self._transfer_of: dict[str, str] = {}
        """transfer id -> vLLM request id, until the request's blocks go back to vLLM."""
        self._step = 0
        self._chunks: tuple[SendChunk, ...] = ()
        self._published_in_step: set[int] = set()
        self._idle = False
        """This step schedules no tokens (``finished_sending`` may wait for a send to end)."""
        self._model_pass_over = False
        """``finished_sending`` ran this step: only draft layers may still be published."""
        self._notifier = Notifier("kvo-prefill-notify", control_key(config.control_secret))

    # -- set-up -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor],
                           slot_key_of: Callable[[str], SlotKey] | None = None) -> None:
        layout = describe_kv_caches(kv_caches)
        engine = transfer_engine_for(self.config, [t for layer in layout.layers
                                                   for _, t in layer.tensors()],
                                     role="Prefill", device_index=self.device_index)
        metas = []
        for layer in layout.layers:
            num_blocks = layer.main.shape[0]
            indexer = None if layer.indexer is None else TensorGroup(
                base_addrs=(layer.indexer.data_ptr(),),
                block_bytes=(block_bytes(layer.indexer),), num_blocks=num_blocks)
            metas.append(LayerMeta(index=layer.index, name=layer.name, main=TensorGroup(
                base_addrs=(layer.main.data_ptr(),), block_bytes=(layout.main_block_bytes,),
                num_blocks=num_blocks), indexer=indexer))
            self._index_of[layer.name] = layer.index
            self._bases[layer.index] = layer.main.data_ptr()
            self._slot_keys[layer.name] = (slot_key_of(layer.name) if slot_key_of
                                           else (layer.main.data_ptr(),))
        spans = layout.spans()
        for start, end in merged_regions(spans):
            engine.register(start, end - start)
        self._engine = engine
        self._fences = FenceWords(engine=engine)
        if self._gates is not None:  # a failed round advances the slot's word before reuse
            self._gates.attach_fence(self._fences)
        self._layers = tuple(metas)
        self._block_bytes = layout.main_block_bytes
        self._indexer_block_bytes = layout.indexer_block_bytes or 0
        logger.info("kvo remote_d2h prefill rank %d/%d: %d layers (%s) exposed in %d region(s), "
                    "engine %s", self.tp_rank, self.tp_size, len(metas),
                    "main KV + indexer" if layout.has_indexer else "main KV",
                    len(merged_regions(spans)), engine.session_id)

    def _publisher(self, decode_tp: int) -> PrefillPublisher:
        with self._publishers_lock:
            publisher = self._publishers.get(decode_tp)
            if publisher is None:
                if self._engine is None or self._fences is None:
                    raise RuntimeError("register_kv_caches has not run yet")
                publisher = PrefillPublisher.for_engine(
                    self._engine, instance_id=self.instance_id, prefill_tp=self.tp_size,
                    p_rank=self.tp_rank, decode_tp=decode_tp, layers=self._layers,
                    gates=self._gates, fences=self._fences, tracker=self._tracker,
                    handshake_timeout_s=self.config.handshake_timeout_s,
                    layer_deadline_s=self.config.layer_deadline_s,
                    request_part=REQUEST_PART, control_secret=self.config.control_secret)
                if self._gates is not None and not self._publishers:
                    # The layer pipeline waits on these gates: let it handle the decode's
                    # answers itself (one thread hand-off less per layer; see GatePump).
                    self._gates.attach_pump(publisher)
                self._publishers[decode_tp] = publisher
            return publisher

    def _endpoint(self, chunk: SendChunk) -> str:
        mapping = TPMapping(self.tp_size, len(chunk.decode_endpoints))
        return chunk.decode_endpoints[mapping.decode_rank(self.tp_rank)]

    # -- per step -----------------------------------------------------------------------

    def start_step(self, metadata: RemoteD2HMetadata) -> None:
        self._step += 1
        self._published_in_step = set()
        self._idle = metadata.idle
        self._model_pass_over = False
        if self._fences is not None:
            for transfer_id in metadata.preempted_sends:  # before this forward reuses blocks
                self._fences.release(transfer_id)
        for request_id in metadata.abandoned_sends:
            self._abandon(request_id)
        chunks = []
        for chunk in metadata.sends:
            send = self._track(chunk)
            if send.failure is None and self._connect(chunk, send):
                chunks.append(chunk)
        self._chunks = tuple(chunks)

    def _track(self, chunk: SendChunk) -> _Send:
        with self._lock:
            send = self._sends.get(chunk.transfer_id)
            if send is None:
                send = self._sends[chunk.transfer_id] = _Send(request_id=chunk.request_id,
                                                              transfer_id=chunk.transfer_id)
                self._transfer_of[chunk.transfer_id] = chunk.request_id
                failure = self._failed.get(chunk.transfer_id)
                if failure is not None:  # an earlier chunk failed: the decode gave up
                    send.failure = failure
                    send.give_up_at = time.monotonic()
                    send.counted = True
            send.endpoint = self._endpoint(chunk)
            send.decode_tp = len(chunk.decode_endpoints)
            return send

    def _connect(self, chunk: SendChunk, send: _Send) -> bool:
        endpoint = self._endpoint(chunk)
        try:
            publisher = self._publisher(len(chunk.decode_endpoints))
            if publisher.is_connected(endpoint):
                return True
            publisher.connect(endpoint)
            with self._lock:
                self.stats.handshakes += 1
            return True
        except Exception as error:  # refused, timed out, bad topology: this request only
            with self._lock:
                self.stats.handshake_failures += 1
            reason = f"prefill cannot hand request KV to decode {endpoint}: {error}"
            logger.error("kvo remote_d2h: %s", reason)
            self._give_up(send, reason)
            self._notifier.post(chunk.notify_url,
                                PrefillFailed(transfer_id=chunk.transfer_id,
                                              error=str(error)).to_json())
            return False

    def publish_layer(self, layer_name: str) -> list[str]:
        """Publish this step's chunks of ``layer_name``; the slot-gate parts that now wait.

        A request whose decode stopped answering (a READY failed or passed its deadline) is
        not published any further: later layers of the step then do not wait for it too.
        """
        index = self._index_of.get(layer_name)
        if index is None or not self._chunks or index in self._published_in_step:
            return []   # not a KV layer, nothing to send, or a drafter's later pass
        if self._model_pass_over and not self._is_draft(index):
            return []   # a forward before this step's start_step: its chunks are spent
        self._published_in_step.add(index)
        self._drain_tracker()
        with self._lock:
            live = [c for c in self._chunks
                    if (send := self._sends.get(c.transfer_id)) is not None
                    and send.failure is None]
        by_tp: dict[int, list[SendChunk]] = {}
        for chunk in live:
            by_tp.setdefault(len(chunk.decode_endpoints), []).append(chunk)
        key = self._slot_keys[layer_name]
        last_layer = index == len(self._layers) - 1
        parts = []
        for decode_tp, chunks in by_tp.items():
            part = f"remote:{self._step}:{index}:{decode_tp}"
            if self._gates is not None:
                self._gates.announce(key, part)
            try:
                self._publish(decode_tp, index, key, chunks, last_layer,
                              part if self._gates is not None else None)
            except Exception as error:
                logger.error("kvo remote_d2h: publishing layer %s failed: %s", layer_name, error)
                for chunk in chunks:
                    send = self._sends.get(chunk.transfer_id)
                    if send is not None:
                        self._give_up(send, f"publish failed: {error}")
                        self._tell_decode(send, f"prefill could not publish layer {index}")
                if self._gates is not None:  # nothing reads the buffer for this part
                    self._gates.mark_done(key, part)
            parts.append(part)
        return parts

    def _is_draft(self, index: int) -> bool:
        return self.first_draft_layer is not None and index >= self.first_draft_layer

    @property
    def has_draft_layers(self) -> bool:
        """Whether vLLM's caches hold drafter (MTP) layers, published after the model's."""
        return any(self._is_draft(layer.index) for layer in self._layers)

    def end_step(self) -> None:
        """``wait_for_save``: the step's forwards (model and drafter) are over; its chunks
        are spent (see ``finished_sending`` for why none may be kept). A chunk whose draft
        layers were not published (vLLM skipped the drafter this step) cannot complete: its
        request is given up (the decode recomputes or fails it), not left to time out."""
        chunks, self._chunks = self._chunks, ()
        unpublished = [layer.index for layer in self._layers if self._is_draft(layer.index)
                       and layer.index not in self._published_in_step]
        if chunks and unpublished:
            self.give_up_requests({chunk.request_id for chunk in chunks},
                                  f"the drafter did not write draft layer(s) {unpublished} "
                                  f"in step {self._step}")

    def give_up_requests(self, request_ids: set[str], reason: str) -> None:
        """Publish nothing more of these vLLM requests: their KV is not to be trusted."""
        with self._lock:
            sends = [s for s in self._sends.values()
                     if s.request_id in request_ids and s.failure is None]
        for send in sends:
            logger.error("kvo remote_d2h: not sending request %s any further: %s",
                         send.request_id, reason)
            self._give_up(send, reason)
            self._tell_decode(send, reason)

    def _publish(self, decode_tp: int, index: int, key: SlotKey, chunks: list[SendChunk],
                 last_layer: bool, slot_part: str | None) -> None:
        publisher = self._publisher(decode_tp)
        by_endpoint: dict[str, list[ReadyRequest]] = {}
        blocks = 0
        with_indexer = self._layers[index].indexer is not None
        published = 0
        for chunk in chunks:
            ready = publisher.ready_request(chunk.transfer_id, chunk.start_block,
                                            chunk.block_ids,
                                            chunk.block_ids if with_indexer else ())
            by_endpoint.setdefault(self._endpoint(chunk), []).append(ready)
            blocks += len(chunk.block_ids)
            published += (len(ready.main_block_ids) * self._block_bytes
                          + len(ready.indexer_block_ids) * self._indexer_block_bytes)
        last = [c.transfer_id for c in chunks if c.last] if last_layer else []
        publisher.publish_layer(index, key, by_endpoint, last_layer_request_ids=last,
                                slot_part=slot_part)
        now = time.monotonic()
        with self._lock:
            for chunk in chunks:
                self._sends[chunk.transfer_id].published_at = now
            self.stats.published_layers += 1
            self.stats.published_blocks += blocks
            self.stats.published_bytes += published

    # -- completion ---------------------------------------------------------------------

    def _remember_failure(self, transfer_id: str, reason: str) -> None:
        """(lock held)"""
        self._failed[transfer_id] = reason
        while len(self._failed) > MAX_REMEMBERED_FAILURES:
            self._failed.popitem(last=False)

    def _give_up(self, send: _Send, reason: str) -> None:
        """The request will not complete normally: report it once its READYs have settled."""
        with self._lock:
            self._remember_failure(send.transfer_id, reason)
            if send.failure is None:
                send.failure = reason
            grace = 0.0 if send.published_at is None else self.config.layer_deadline_s + 1.0
            base = time.monotonic() if send.published_at is None else send.published_at
            send.give_up_at = base + grace

    def _abandon(self, request_id: str) -> None:
        with self._lock:
            sends = [s for s in self._sends.values() if s.request_id == request_id]
        for send in sends:
            reason = "request finished before its prompt was sent"
            self._give_up(send, reason)
            self._tell_decode(send, reason)
            for publisher in list(self._publishers.values()):
                publisher.forget(send.transfer_id)

    def _tell_decode(self, send: _Send, reason: str) -> None:
        """Let the decode fail the request's pull now (SEND_ABORTED) rather than wait for
        layers until its deadline; it then recomputes the prompt or fails the request, as its
        ``kv_load_failure_policy`` says. Sent whether or not a READY of it went out (in the
        concurrent flow the decode may hold its destination already), over an accepted
        session only (``PrefillPublisher.abort``)."""
        if send.endpoint is None:
            return
        with self._publishers_lock:
            publisher = self._publishers.get(send.decode_tp)
        if publisher is not None:
            publisher.abort(send.endpoint, (send.transfer_id,), reason)

    def _drain_tracker(self) -> None:
        """Take the publishers' verdicts; a failed request is not published any more."""
        ok, failed = self._tracker.pop_finished()
        if not ok and not failed:
            return
        with self._lock:
            for transfer_id in ok:
                self._settled[transfer_id] = None
            for transfer_id, error in failed.items():
                self._settled[transfer_id] = error
                self._remember_failure(transfer_id, error)
                send = self._sends.get(transfer_id)
                if send is not None and send.failure is None:
                    send.failure = error

    def finished_sending(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Request ids vLLM finished whose sends are all answered (their blocks may go).

        vLLM calls this once per step, after the forward: the step's chunks are spent here.
        On a step without sends vLLM runs ``start_load_kv`` (``start_step``) only after the
        forward, so chunks kept past this point would be published again by that step's
        ``save_kv_layer`` calls: READYs for blocks already handed over, reaching a decode
        that may have completed (and released) the request, or racing the fence release of
        its blocks. With draft layers the drafter still runs after this call, so only the model's
        layers stop here; ``end_step`` spends the chunks (module docstring).
        """
        if self.has_draft_layers:   # the drafter runs after this: its layers are published
            self._model_pass_over = True   # with this step's chunks, until end_step
        else:
            self._chunks = ()
        if self._idle:
            # Nothing computed this step: sleep until a send ends (or briefly) rather than
            # have vLLM step again at once while the decode reads (IDLE_WAIT_S).
            self._idle = False
            with self._lock:
                sending = bool(self._sends)
            if sending:
                self._tracker.wait_finished(IDLE_WAIT_S)
        self._drain_tracker()
        now = time.monotonic()
        with self._lock:
            known = {send.request_id for send in self._sends.values()} | self._done
            self._vllm_finished.update(r for r in finished_req_ids if r in known)
            settled, self._settled = self._settled, {}
            for transfer_id, failure in settled.items():
                send = self._sends.pop(transfer_id, None)
                if send is not None:
                    self._done.add(send.request_id)
                    if failure is not None:
                        self.stats.sends_failed += 0 if send.counted else 1
                        logger.warning("kvo remote_d2h: sending request %s failed: %s",
                                       send.request_id, failure)
                    else:
                        self.stats.sends_done += 1
            for transfer_id, send in list(self._sends.items()):
                if send.give_up_at is not None and now >= send.give_up_at:
                    del self._sends[transfer_id]
                    self._done.add(send.request_id)
                    self.stats.sends_failed += 0 if send.counted else 1
            ready = self._done & self._vllm_finished
            self._done -= ready
            self._vllm_finished -= ready
            released = [t for t, r in self._transfer_of.items() if r in ready]
            for transfer_id in released:
                del self._transfer_of[transfer_id]
        if self._fences is not None:
            for transfer_id in released:  # before vLLM may hand the blocks to another request
                self._fences.release(transfer_id)
        return ready

    def snapshot(self) -> dict[str, object]:
        return {"role": "prefill", **attrs.asdict(self.stats),
                "layer_bases": {str(i): base for i, base in sorted(self._bases.items())},
                "in_flight_sends": len(self._sends),
                "in_flight_reads": sum(p.reads_in_flight()
                                       for p in list(self._publishers.values()))}

    def close(self) -> None:
        if self._gates is not None:
            self._gates.attach_pump(None)
        for publisher in list(self._publishers.values()):
            publisher.close()
        self._publishers.clear()
        self._notifier.close()
        if self._fences is not None:
            self._fences.close()
            self._fences = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None
