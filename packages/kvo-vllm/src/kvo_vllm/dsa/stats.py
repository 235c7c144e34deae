"""Process-local counters of kvo's sparse MLA backend and indexer: they show that kvo's code ran.

vLLM runs its model in the worker process; with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the
``uni`` executor that is the caller's process, where tests read these.
"""

from __future__ import annotations

import attrs


@attrs.define
class DSACounters:
    indexer_calls: int = 0
    indexer_rows: int = 0
    """Query tokens the indexer selected top-k for (prefill and decode)."""
    attention_calls: int = 0
    attention_rows: int = 0
    """Query tokens that went through sparse attention."""
    kv_rows_written: int = 0

    def reset(self) -> None:
        for field in attrs.fields(DSACounters):
            setattr(self, field.name, 0)


COUNTERS = DSACounters()
