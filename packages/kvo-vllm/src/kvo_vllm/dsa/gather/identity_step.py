"""A plain decode step of NOT_OFFLOADED rows in their steady state: every row decodes one token,
fits its hot row and holds the request it held last call, filled up to its new position. Copy
each row's new position into its identity slot and answer with the hot buffer at slots
``row * capacity + position``: no residency, no miss copy. Where kvo's C++ host ops are loaded
the native lane serves these steps instead (:mod:`.native_lane`)."""

from __future__ import annotations

import numpy as np
import torch

from kvo_vllm.dsa.gather.contract import GatherCounts, Gathered, LayerCall
from kvo_vllm.dsa.gather.layers import OffloadLayers
from kvo_vllm.dsa.offload_hot_rows import IdentityPlan


def identity_counts(requests: int, selected: int, context: int, filled: int) -> GatherCounts:
    """A step whose rows all stayed NOT_OFFLOADED: every selected entry a hit."""
    return GatherCounts(decode_rows=requests, decode_tokens=requests, pool_rows=0,
                        selected=selected, misses=0, reload_tokens=context,
                        pool_rows_used=context, identity_rows=requests, identity_fills=filled)


class IdentityStepGather:
    """Steady NOT_OFFLOADED decode steps (module docstring); declines any other call (a join,
    a move, a first step: the reference plans those)."""

    name = "identity_step"

    def __init__(self, layers: OffloadLayers) -> None:
        self.layers = layers

    def select_rows(self, call: LayerCall) -> Gathered | None:
        lay, step, topk = self.layers, call.step, call.topk
        requests = step.requests
        if not (step.one_token_each and requests and topk.shape[0] == requests
                and step.longest <= lay.capacity):
            return None
        layer, lens = call.layer, step.seq_lens.numpy()
        if not lay.held[layer].advance_decode_step(lay.serials(call).numpy(), lens):
            return None
        filled = lay.fill_identity_rows(layer, IdentityPlan(   # each row's new position
            identity=torch.ones(requests, dtype=torch.bool),
            first=torch.zeros(requests, dtype=torch.bool),
            fill_rows=torch.arange(requests, dtype=torch.int64),
            fill_pos=torch.from_numpy(lens - 1)), step.blocks)
        picks = topk.numpy()
        valid = picks >= 0
        return Gathered(rows=lay.hot_answer(layer, picks, valid),
                        counts=identity_counts(requests, int(np.count_nonzero(valid)),
                                               int(lens.sum()), filled))

