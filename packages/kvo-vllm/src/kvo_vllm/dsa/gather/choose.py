"""Which gather implementations serve a manager's calls, chosen once at start."""

from __future__ import annotations

from kvo_vllm.dsa.gather.contract import RowSource
from kvo_vllm.dsa.gather.decode_step import DecodeStepGather
from kvo_vllm.dsa.gather.identity_step import IdentityStepGather
from kvo_vllm.dsa.gather.layers import OffloadLayers
from kvo_vllm.dsa.gather.native_lane import NativeLaneGather
from kvo_vllm.dsa.gather.reference import ReferenceGather


def choose_row_sources(layers: OffloadLayers) -> tuple[RowSource, ...]:
    """The chain each call walks until one answers: the steady identity step (with kvo's C++
    host ops the one-call lane, asked first: it computes the row serials itself), the plain
    decode step of offloaded rows, and the reference, which answers every call. (Fused mode
    has no row source: its decode rows go through ``offload_fused``.)"""
    if layers.native:
        return NativeLaneGather(layers), DecodeStepGather(layers), ReferenceGather(layers)
    return DecodeStepGather(layers), IdentityStepGather(layers), ReferenceGather(layers)
