"""What the layerwise worker's loader and savers share: the store, and what orders, guards and
counts its use. The worker makes one and owns each part."""

from __future__ import annotations

from typing import Any

import attrs

from kvo_vllm.layerwise.failures import FailurePolicy
from kvo_vllm.layerwise.keys import StoreKeys
from kvo_vllm.layerwise.poisoned_keys import PoisonedKeys
from kvo_vllm.layerwise.slot_rounds import SlotRounds
from kvo_vllm.layerwise.staging import PendingPuts
from kvo_vllm.layerwise.worker_stats import StatsRecorder


@attrs.frozen
class PipelineParts:
    store: Any
    keys: StoreKeys
    rounds: SlotRounds
    poisoned: PoisonedKeys
    failures: FailurePolicy
    recorder: StatsRecorder
    deadline_s: float
    """``LayerwiseOffloadConfig.layer_deadline_s``."""
    pending_puts: PendingPuts
    """The store client's batched puts in flight (shared with a scheduler half that uses the
    same client: ``store_client.SharedStore``)."""
