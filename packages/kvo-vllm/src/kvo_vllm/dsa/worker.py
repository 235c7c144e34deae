"""kvo's vLLM CPU worker for the sparse MLA model in offload mode: vLLM's ``CPUWorker`` that
opens the host pool at start-up.

Without it the pool is made at the first layer call that writes rows, i.e. inside the first
request (vLLM-CPU runs no warm-up forward with ``enforce_eager``). At TP > 1 opening the pool
is where the TP ranks of a DP rank create and attach to their one shared pool
(:mod:`kvo_vllm.dsa.offload_tp`): a pool that cannot be created or attached must fail the engine
at start, not its first request. The platform selects this class only for a sparse MLA model
in offload mode whose user left vLLM's ``worker_cls`` at its default.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from kvo_vllm.dsa.offload_main_kv import open_offload_pool

WORKER_CLS = "kvo_vllm.dsa.worker.KvoOffloadCPUWorker"


class KvoOffloadCPUWorker(CPUWorker):
    def compile_or_warm_up_model(self) -> Any:
        times = super().compile_or_warm_up_model()
        open_offload_pool(self.vllm_config)
        return times
