"""The scheduler of an in-process vLLM ``LLM``: the benchmarks read its queues and connector."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.v1.core.sched.scheduler import Scheduler


def inproc_scheduler(llm: LLM) -> Scheduler:
    """``llm``'s scheduler when its core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0).

    A multiprocess engine keeps its core, and so its scheduler, in another process: an error
    naming the client type then, not an attribute error deep in a benchmark.
    """
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core_client import InprocClient

    client = llm.llm_engine.engine_core
    if not isinstance(client, InprocClient):
        raise TypeError(f"the engine core runs behind {type(client).__name__}, not in this "
                        "process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 before starting it")
    scheduler = client.engine_core.scheduler
    if not isinstance(scheduler, Scheduler):
        raise TypeError(f"the engine's scheduler is {type(scheduler).__name__}, not vLLM's "
                        "Scheduler")
    return scheduler
