"""Memory and transfer estimates behind ``kvo-plan`` (pure arithmetic, no I/O).

For one model, sequence length and concurrency this works out, per rank, how much KV cache sits
on the device and in host memory without offload, with layerwise prefill offload (only the
planned physical layer buffers on the device) and with sparse decode offload (indexer cache and
per-layer hot top-k buffers on the device, main KV in host memory), plus the per-step decode
transfer bound. Every number derives from :class:`~kvo_core.specs.CacheSpec` sizes and
:func:`~kvo_core.buffer_plan.plan_layer_buffers`, the same code the connectors use.

Conventions (also listed in :attr:`PlanReport.assumptions`):

- ``concurrency`` requests of ``seq_len`` tokens each; caches are paged, so a request takes
  ``ceil(seq_len / block_size)`` blocks in every layer.
- The prefill rank holds the caches of all ``concurrency`` requests (the prefill batch); its
  host store keeps every layer's full caches.
- The decode host pool holds the full main KV of all requests; it is one pool per decode DP
  rank, shared by that rank's TP ranks (MLA KV is replicated, so one copy serves them all).
- A decode rank keeps the full indexer cache and, per sparse layer, one hot buffer of
  ``hot_capacity`` tokens per running request (one residency row per request).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from kvo_core.buffer_plan import LayerBufferPlan, plan_layer_buffers
from kvo_core.config import LayerwiseOffloadConfig, SparseDecodeOffloadConfig
from kvo_core.errors import ConfigError
from kvo_core.models import IndexerKVDtype, ModelDescription
from kvo_core.specs import LayerSpec
from kvo_core.tp import TPMapping


def _positive_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{attribute.name} must be an integer >= 1, got {value!r}")


def _miss_rate(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise ConfigError(f"{attribute.name} must be a fraction in [0, 1], got {value!r}")


@attrs.frozen
class PlannerInputs:
    """What the user asks about; ``top_k``/``block_size`` None take the model's values."""

    model: ModelDescription
    seq_len: int = attrs.field(default=131072, validator=_positive_int)
    concurrency: int = attrs.field(default=16, validator=_positive_int)
    prefill_tp: int = 1
    decode_tp: int = 1
    shared_buffers: int = 2
    independent_layers: Sequence[int] | Literal["all"] = (0,)
    hot_capacity: int = 8192
    top_k: int | None = None
    block_size: int | None = None
    miss_rate: float = attrs.field(default=0.15, validator=_miss_rate)
    indexer_kv_dtype: IndexerKVDtype = "bfloat16"
    include_mtp: bool = True

    @property
    def effective_block_size(self) -> int:
        return self.model.block_size if self.block_size is None else self.block_size

    @property
    def effective_top_k(self) -> int:
        return self.model.default_top_k if self.top_k is None else self.top_k


@attrs.frozen
class Memory:
    """KV-cache bytes on the device and in host memory for one rank (host may be shared)."""

    device_bytes: int
    host_bytes: int


@attrs.frozen
class LayerwiseEstimate:
    """Layerwise prefill offload on one prefill rank."""

    memory: Memory
    physical_buffers: int
    num_layers: int
    footprint_ratio: float
    independent: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...]


@attrs.frozen
class TransferBound:
    """Host-to-device bytes one decode step moves on one decode rank, summed over layers."""

    rows: int
    layers: int
    top_k: int
    row_bytes: int
    worst_case_bytes: int
    miss_rate: float
    expected_bytes: int
    full_reload_bytes: int
    append_bytes: int


@attrs.frozen
class SparseDecodeEstimate:
    """Sparse decode offload on one decode rank (host pool per decode DP rank)."""

    memory: Memory
    indexer_device_bytes: int
    hot_buffer_device_bytes: int
    hot_capacity: int
    transfer: TransferBound


@attrs.frozen
class PlanReport:
    inputs: PlannerInputs
    tp: TPMapping
    block_size: int
    top_k: int
    prefill_layers: tuple[LayerSpec, ...]
    decode_layers: tuple[LayerSpec, ...]
    no_offload_prefill: Memory
    no_offload_decode: Memory
    layerwise: LayerwiseEstimate
    sparse_decode: SparseDecodeEstimate | None
    not_applicable: str | None
    assumptions: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def decode_device_ratio(self) -> float | None:
        """Decode rank's device KV with sparse offload / without (indexer included)."""
        if self.sparse_decode is None or not self.no_offload_decode.device_bytes:
            return None
        return self.sparse_decode.memory.device_bytes / self.no_offload_decode.device_bytes

    @property
    def decode_main_kv_ratio(self) -> float | None:
        """Decode rank's device main KV with sparse offload (hot buffers) / without."""
        if self.sparse_decode is None:
            return None
        full_main = (self.no_offload_decode.device_bytes
                     - self.sparse_decode.indexer_device_bytes)
        return self.sparse_decode.hot_buffer_device_bytes / full_main if full_main else None

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-ready data (bytes as integers)."""
        model = self.inputs.model
        prefill_main = self.prefill_layers[0].main
        decode_main = self.decode_layers[0].main
        indexer = next((layer for layer in self.decode_layers if layer.indexer), None)
        independent = self.inputs.independent_layers
        return {
            "model": {
                "name": model.name,
                "description": model.describe(),
                "attention": model.attention,
                "num_layers": model.num_layers,
                "num_mtp_layers": model.num_mtp_layers if self.inputs.include_mtp else 0,
                "cache_layers": len(self.prefill_layers),
                "has_indexer": model.has_indexer,
                "main_bytes_per_token_prefill_rank": prefill_main.bytes_per_token,
                "main_bytes_per_token_decode_rank": decode_main.bytes_per_token,
                "indexer_bytes_per_token": _indexer_bytes_per_token(indexer),
            },
            "inputs": {
                "seq_len": self.inputs.seq_len,
                "concurrency": self.inputs.concurrency,
                "prefill_tp": self.tp.prefill_tp,
                "decode_tp": self.tp.decode_tp,
                "tp_ratio": self.tp.ratio,
                "shared_buffers": self.inputs.shared_buffers,
                "independent_layers": (independent if isinstance(independent, str)
                                       else list(independent)),
                "hot_capacity": self.inputs.hot_capacity,
                "top_k": self.top_k,
                "block_size": self.block_size,
                "miss_rate": self.inputs.miss_rate,
                "indexer_kv_dtype": self.inputs.indexer_kv_dtype,
            },
            "no_offload": {"prefill_rank": attrs.asdict(self.no_offload_prefill),
                           "decode_rank": attrs.asdict(self.no_offload_decode)},
            "layerwise_prefill": {
                **attrs.asdict(self.layerwise.memory),
                "physical_buffers": self.layerwise.physical_buffers,
                "num_layers": self.layerwise.num_layers,
                "footprint_ratio": self.layerwise.footprint_ratio,
                "independent": list(self.layerwise.independent),
                "slots": [list(slot) for slot in self.layerwise.slots],
            },
            "sparse_decode": None if self.sparse_decode is None else {
                **attrs.asdict(self.sparse_decode.memory),
                "indexer_device_bytes": self.sparse_decode.indexer_device_bytes,
                "hot_buffer_device_bytes": self.sparse_decode.hot_buffer_device_bytes,
                "hot_capacity": self.sparse_decode.hot_capacity,
                "device_ratio": self.decode_device_ratio,
                "main_kv_device_ratio": self.decode_main_kv_ratio,
                "per_step_transfer": attrs.asdict(self.sparse_decode.transfer),
            },
            "sparse_decode_not_applicable": self.not_applicable,
            "assumptions": list(self.assumptions),
            "notes": list(self.notes),
        }


def _indexer_bytes_per_token(layer: LayerSpec | None) -> int:
    if layer is None:
        return 0
    return sum(part.bytes_per_token for part in (layer.indexer, layer.indexer_scale)
               if part is not None)


def _total_bytes(layers: Sequence[LayerSpec], blocks: int) -> int:
    return sum(layer.bytes_per_block for layer in layers) * blocks


def estimate(inputs: PlannerInputs) -> PlanReport:
    """Work out every number the planner prints (see the module docstring for conventions)."""
    model = inputs.model
    tp = TPMapping(inputs.prefill_tp, inputs.decode_tp)
    block_size = inputs.effective_block_size
    top_k = inputs.effective_top_k
    layerwise_config = LayerwiseOffloadConfig(shared_buffers=inputs.shared_buffers,
                                              independent_layers=_as_config_layers(inputs))
    prefill_layers = model.layer_specs(tp=tp.prefill_tp, block_size=block_size,
                                       indexer_kv_dtype=inputs.indexer_kv_dtype,
                                       include_mtp=inputs.include_mtp)
    decode_layers = model.layer_specs(tp=tp.decode_tp, block_size=block_size,
                                      indexer_kv_dtype=inputs.indexer_kv_dtype,
                                      include_mtp=inputs.include_mtp)
    blocks_per_request = math.ceil(inputs.seq_len / block_size)
    blocks = blocks_per_request * inputs.concurrency

    no_offload_prefill = Memory(_total_bytes(prefill_layers, blocks), 0)
    no_offload_decode = Memory(_total_bytes(decode_layers, blocks), 0)

    plan = plan_layer_buffers(prefill_layers, layerwise_config.shared_buffers,
                              layerwise_config.independent_layers)
    layerwise = _layerwise(plan, blocks, no_offload_prefill.device_bytes)

    sparse: SparseDecodeEstimate | None = None
    not_applicable: str | None = None
    notes: list[str] = []
    if not model.has_indexer:
        not_applicable = (f"{model.name} has no sparse-attention indexer "
                          f"({model.attention.upper()} attention reads every past token)")
    else:
        sparse_config = SparseDecodeOffloadConfig(top_k=top_k, block_size=block_size,
                                                  hot_capacity=inputs.hot_capacity)
        sparse = _sparse_decode(decode_layers, sparse_config, inputs, blocks)
        if inputs.hot_capacity >= inputs.seq_len:
            notes.append(f"hot_capacity {inputs.hot_capacity} >= seq_len {inputs.seq_len}: "
                         f"the hot buffers hold whole requests, so sparse decode offload "
                         f"saves no device memory")
    if tp.ratio > 1:
        notes.append(f"TP {tp.prefill_tp} -> {tp.decode_tp}: contribution groups of "
                     f"{tp.ratio} prefill ranks per decode rank; member 0 sends main KV, the "
                     f"indexer blocks are split {tp.ratio} ways")

    return PlanReport(
        inputs=inputs, tp=tp, block_size=block_size, top_k=top_k,
        prefill_layers=tuple(prefill_layers), decode_layers=tuple(decode_layers),
        no_offload_prefill=no_offload_prefill, no_offload_decode=no_offload_decode,
        layerwise=layerwise, sparse_decode=sparse, not_applicable=not_applicable,
        assumptions=_assumptions(model, sparse is not None), notes=tuple(notes))


def _as_config_layers(inputs: PlannerInputs) -> tuple[int, ...] | Literal["all"]:
    value = inputs.independent_layers
    return value if isinstance(value, str) else tuple(value)


def _layerwise(plan: LayerBufferPlan, blocks: int, full_bytes: int) -> LayerwiseEstimate:
    device = sum(slot.bytes_per_block for slot in plan.slots) * blocks
    return LayerwiseEstimate(
        memory=Memory(device, full_bytes), physical_buffers=plan.physical_buffers,
        num_layers=plan.num_layers, footprint_ratio=plan.footprint_ratio,
        independent=tuple(sorted(plan.independent)),
        slots=tuple(slot.layers for slot in plan.slots))


def _sparse_decode(layers: Sequence[LayerSpec], config: SparseDecodeOffloadConfig,
                   inputs: PlannerInputs, blocks: int) -> SparseDecodeEstimate:
    rows = inputs.concurrency
    indexer = sum(_indexer_bytes_per_token(layer) for layer in layers) * config.block_size
    indexer_device = indexer * blocks
    main_per_token = sum(layer.main.bytes_per_token for layer in layers)
    hot = rows * config.hot_capacity * main_per_token
    host = sum(layer.main.bytes_per_block for layer in layers) * blocks
    # At most min(top_k, seq_len) distinct tokens can miss per row and layer.
    misses = min(config.top_k, inputs.seq_len)
    worst = rows * misses * main_per_token
    full_reload = rows * sum(layer.main.bytes_for_tokens(inputs.seq_len) for layer in layers)
    transfer = TransferBound(
        rows=rows, layers=len(layers), top_k=config.top_k,
        row_bytes=layers[0].main.bytes_per_token, worst_case_bytes=worst,
        miss_rate=float(inputs.miss_rate), expected_bytes=round(worst * inputs.miss_rate),
        full_reload_bytes=full_reload, append_bytes=rows * main_per_token)
    return SparseDecodeEstimate(
        memory=Memory(indexer_device + hot, host), indexer_device_bytes=indexer_device,
        hot_buffer_device_bytes=hot, hot_capacity=config.hot_capacity, transfer=transfer)


def _assumptions(model: ModelDescription, sparse: bool) -> tuple[str, ...]:
    sharding = ("MLA latent KV and indexer keys are replicated on every TP rank (not sharded)"
                if model.attention == "mla" else
                "dense KV heads are sharded across TP ranks (one replicated head per rank "
                "once TP exceeds the KV heads)")
    common = (
        sharding,
        "each of the `concurrency` requests holds seq_len tokens, paged in whole blocks; "
        "the prefill rank holds all of them (the prefill batch)",
        "layerwise device = the planned physical layer buffers (main KV + indexer); "
        "host = every layer's full caches in the prefill store",
    )
    if not sparse:
        return common
    return (
        *common,
        "sparse decode host = full main KV, one pool per decode DP rank shared by its TP ranks; "
        "device = full indexer cache + one hot buffer of hot_capacity tokens per request and "
        "layer",
        "transfer per decode step: misses x main-KV row bytes over all layers and requests; "
        "worst case = top-k misses per row and layer; full reload = every layer's whole main KV",
    )
