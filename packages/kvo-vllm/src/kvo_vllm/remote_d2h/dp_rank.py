"""Which decode DP rank a worker is, and which accelerator of its node it drives.

vLLM's data parallelism (``--data-parallel-size N`` behind one API server) starts one engine
per DP rank. For a MoE model (DeepSeek-V3.2) each engine keeps ``data_parallel_rank`` /
``data_parallel_size``; for a dense model vLLM makes every rank an independent engine
(``reconfigure_for_independent_dp_rank``: size 1, rank 0) and only ``data_parallel_index``
keeps the rank. kvo's decode control ports are ``kv_port + dp_rank * tp_size + tp_rank`` and the
proxy learns the DP size from the decode's advertisement, so a worker must know both; a dense
model's engine cannot know the DP size, so such a decode is refused (each DP rank then runs as
its own server behind the proxy).
"""

from __future__ import annotations

from typing import Any

import attrs

from kvo_core.errors import ConfigError


@attrs.frozen
class DecodeDpRank:
    """This engine's DP rank among ``size`` (0 of 1 without data parallelism)."""

    rank: int
    size: int


def decode_dp_rank(parallel: Any) -> DecodeDpRank:
    """The DP rank of a decode (kv_consumer) engine from vLLM's ``ParallelConfig``; a
    ConfigError for ranks vLLM runs as independent engines (a dense model's DP)."""
    size = int(parallel.data_parallel_size)
    rank = int(getattr(parallel, "data_parallel_index", parallel.data_parallel_rank))
    if not 0 <= rank < size:
        raise ConfigError(
            f"RemoteD2HConnector cannot serve as a P/D decode at DP rank {rank}: vLLM runs "
            f"this model's DP ranks as independent engines (data_parallel_size is "
            f"{size} inside the engine: a dense, non-MoE model), so the decode cannot tell "
            f"the proxy its DP size; run each DP rank as its own server (data_parallel_size "
            f"1, its own kv_port) behind the proxy")
    return DecodeDpRank(rank=rank, size=size)


def local_device_index(parallel: Any, tp_rank: int) -> int:
    """The accelerator index on this node that vLLM gives the worker of TP rank ``tp_rank``:
    ``local DP rank * (TP * PP * PCP) + tp_rank``, vLLM's rule for a DP engine on one node
    (``gpu_worker.init_device``); ``tp_rank`` alone where vLLM does not shift it (Ray or an
    external launcher place the devices, or the DP group spans nodes). kvo runs with PP 1, so
    the worker's rank inside its DP rank is its TP rank."""
    if (getattr(parallel, "distributed_executor_backend", None) in ("ray", "external_launcher")
            or getattr(parallel, "data_parallel_backend", "mp") == "ray"
            or int(getattr(parallel, "nnodes_within_dp", 1)) != 1):
        return tp_rank
    local_dp = getattr(parallel, "data_parallel_rank_local", None)
    if local_dp is None:
        local_dp = getattr(parallel, "data_parallel_index", parallel.data_parallel_rank)
    ranks_per_dp = (int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
                    * int(getattr(parallel, "prefill_context_parallel_size", 1)))
    return int(local_dp) * ranks_per_dp + tp_rank
