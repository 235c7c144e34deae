"""A plain decode step of offloaded rows: every row decodes one token and has outgrown its hot
row, none is NOT_OFFLOADED. The reference's residency update, copies and rows, with the index
arithmetic in NumPy on views of the same memory (a PyTorch op's dispatch costs several
microseconds here, more than its arithmetic on a few hundred indices). With kvo's C++ host
ops the misses are copied straight from the update's result (``copy_residency_misses``). The
answer names hot rows (``SelectedRows.slots``) instead of gathering them."""

from __future__ import annotations

import numpy as np
import torch

from kvo_core.residency import ResidencyResult
from kvo_kernels.host_copy import copy_residency_misses_host
from kvo_vllm.dsa.gather.contract import GatherCounts, Gathered, LayerCall
from kvo_vllm.dsa.gather.layers import OffloadLayers
from kvo_vllm.dsa.main_kv import SelectedRows


class DecodeStepGather:
    """Plain decode steps of offloaded rows (module docstring); declines any other call."""

    name = "decode_step"

    def __init__(self, layers: OffloadLayers) -> None:
        self.layers = layers
        self._copy = self._copy_native if layers.native else self._copy_listed

    def select_rows(self, call: LayerCall) -> Gathered | None:
        lay, layer, step, topk = self.layers, call.layer, call.step, call.topk
        requests = step.requests
        if not (step.one_token_each and requests and topk.shape[0] == requests
                and step.shortest > lay.capacity and not lay.held[layer].any_held):
            return None
        serials = lay.serials(call)
        picks = topk.numpy()
        lens = step.lens
        result = lay.residency.update(layer, picks, serials.numpy(), lens - 1, requests)
        misses = self._copy(layer, result, step.blocks, requests)
        valid = picks >= 0
        slots = result.slots[:requests, :picks.shape[1]].numpy()
        hot_slots = np.where(valid, slots + lay.row_base[:requests], -1)
        selected, context = int(valid.sum()), int(lens.sum())
        return Gathered(
            rows=SelectedRows(rows=lay.hot[layer], valid=torch.from_numpy(valid).to(lay.device),
                              slots=torch.from_numpy(hot_slots).to(lay.device)),
            counts=GatherCounts(decode_rows=requests, decode_tokens=requests, pool_rows=0,
                                selected=selected, misses=misses, reload_tokens=context,
                                pool_rows_used=context))

    def _copy_native(self, layer: int, result: ResidencyResult, blocks: torch.Tensor,
                     requests: int) -> int:
        lay = self.layers
        return copy_residency_misses_host(
            lay.pools[layer], lay.hot[layer], blocks, result.miss_counts, result.miss_tokens,
            result.miss_slots, rows=requests, block_size=lay.block_size, capacity=lay.capacity)

    def _copy_listed(self, layer: int, result: ResidencyResult, blocks: torch.Tensor,
                     requests: int) -> int:
        lay = self.layers
        return lay.copy_misses(layer, *lay.residency.miss_rows(result, blocks, requests))
