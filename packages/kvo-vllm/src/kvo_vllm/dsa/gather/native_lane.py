"""The steady state of short requests in one C++ call (kvo-kernels' ``identity_decode_lane``):
the row serials and the identity step together, from vLLM's own metadata tensors, with the
same state and answer as :mod:`.identity_step` (which it replaces where kvo's C++ host ops
are loaded). At a short context the offload path's cost
over resident mode's was its Python at a step's first layer (caches cold after sampling and
scheduling); this lane is what is left of it. Only where kvo's C++ host ops are loaded."""

from __future__ import annotations

import torch

from kvo_kernels.host_identity import identity_decode_lane_host
from kvo_vllm.dsa.gather.contract import Gathered, LayerCall
from kvo_vllm.dsa.gather.identity_step import identity_counts
from kvo_vllm.dsa.gather.layers import OffloadLayers
from kvo_vllm.dsa.main_kv import SelectedRows


class NativeLaneGather:
    """Steady NOT_OFFLOADED decode steps in one call; the op declines (changing nothing) any
    step that is not one (a join, two query tokens, a row filled to another length). It
    computes the serials itself, so it must be asked before anything else in a call."""

    name = "native_lane"

    def __init__(self, layers: OffloadLayers) -> None:
        self.layers = layers
        # The answer: each token's hot rows and validity, caller-owned (read by the layer's
        # attention before its next call), viewed once per shape.
        self._hot_slots = torch.empty(layers.max_rows * layers.top_k, dtype=torch.int64)
        self._valid = torch.empty(layers.max_rows * layers.top_k, dtype=torch.bool)
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def select_rows(self, call: LayerCall) -> Gathered | None:
        # The op checks that every row has one query token: then T = R rows, no padding.
        lay, layer, step, topk = self.layers, call.layer, call.step, call.padded_topk
        requests = step.requests
        held = lay.held[layer]
        if (call.serials is not None or not held.any_held or requests < 1
                or requests > lay.max_rows or topk.dim() != 2 or topk.shape[0] != requests
                or topk.shape[1] > lay.top_k
                or not (step.vllm_query_start_loc.is_cpu and step.vllm_seq_lens.is_cpu
                        and step.vllm_block_table.is_cpu)):
            return None
        width = int(topk.shape[1])
        views = self._views.get((requests, width))
        if views is None:
            views = self._views[(requests, width)] = (
                self._hot_slots[:requests * width].view(requests, width),
                self._valid[:requests * width].view(requests, width))
        slots, valid = views
        answer = identity_decode_lane_host(
            lay.pools[layer], lay.hot[layer], step.vllm_query_start_loc, step.vllm_seq_lens,
            step.vllm_block_table, lay.identity[layer].state, held.held_serials, held.filled, topk,
            slots, valid, rows=requests, block_size=lay.block_size, capacity=lay.capacity)
        if answer is None:
            return None
        selected, context = answer
        return Gathered(rows=SelectedRows(rows=lay.hot[layer], valid=valid, slots=slots),
                        counts=identity_counts(requests, selected, context, requests))
