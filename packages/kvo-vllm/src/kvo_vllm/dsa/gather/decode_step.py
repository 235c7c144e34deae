"""A plain decode step of offloaded rows: every row decodes one token and has outgrown its hot
row, none is NOT_OFFLOADED. The reference's residency update, copies and rows, with the index
arithmetic in NumPy on views of the same memory (a PyTorch op's dispatch costs several
microseconds here, more than its arithmetic on a few hundred indices). With kvo's C++ host
ops the misses are copied straight from the update's result (``copy_residency_misses``). The
answer names hot rows (``SelectedRows.slots``) instead of gathering them."""

from __future__ import annotations

from kvo_kernels.host_copy import copy_residency_misses_host
from kvo_vllm.dsa.gather.contract import GatherCounts, Gathered, LayerCall
from kvo_vllm.dsa.gather.layers import OffloadLayers


class DecodeStepGather:
    """Plain decode steps of offloaded rows (module docstring); declines any other call."""

    name = "decode_step"

    def __init__(self, layers: OffloadLayers) -> None:
        self.layers = layers

    def select_rows(self, call: LayerCall) -> Gathered | None:
        lay, layer, step, topk = self.layers, call.layer, call.step, call.topk
        requests = step.requests
        if not (step.one_token_each and requests and topk.shape[0] == requests
                and step.shortest > lay.capacity and not lay.held[layer].any_held):
            return None
        serials = lay.serials(call)
        picks = topk.numpy()
        lens = step.seq_lens.numpy()
        result = lay.residency.update(layer, picks, serials.numpy(), lens - 1, requests)
        if lay.native:
            misses = copy_residency_misses_host(
                lay.pools[layer], lay.hot[layer], step.blocks, result.miss_counts,
                result.miss_tokens, result.miss_slots, rows=requests, block_size=lay.block_size,
                capacity=lay.capacity)
        else:
            misses = lay.copy_misses(layer, *lay.residency.miss_rows(result, step.blocks,
                                                                     requests))
        valid = picks >= 0
        selected, context = int(valid.sum()), int(lens.sum())
        return Gathered(
            rows=lay.hot_answer(layer, result.slots[:requests, :picks.shape[1]].numpy(), valid),
            counts=GatherCounts(decode_rows=requests, decode_tokens=requests, pool_rows=0,
                                selected=selected, misses=misses, reload_tokens=context,
                                pool_rows_used=context))

