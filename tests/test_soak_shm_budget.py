"""The soak's private /dev/shm follows its engines' shape (``kvo_tools.pd.shm_budget``).

The sizes are vLLM's: checked here against the installed vLLM's sources and defaults, so a
vLLM that changes its ring buffers fails this test instead of a soak at TP 2 failing an hour in.
"""

from __future__ import annotations

import inspect

import pytest

from kvo_tools import soak
from kvo_tools.pd import shm_budget

MEASURED_TP2_ENGINE_BYTES = 696254546
"""/dev/shm bytes one TP 2 engine held at start in a soak's footprints (plain, prefill and
decode alike, 4 psm_* files; notes/s36/soak-tp2.json)."""


def test_a_tp2_engine_holds_what_the_soak_measured_and_a_tp1_engine_nothing() -> None:
    assert shm_budget.engine_ring_bytes(2) == MEASURED_TP2_ENGINE_BYTES
    assert shm_budget.engine_ring_bytes(1) == 0
    # A larger broadcast chunk (the engines inherit VLLM_MQ_MAX_CHUNK_BYTES_MB) grows it.
    assert shm_budget.engine_ring_bytes(2, chunk_mib=32) == (
        MEASURED_TP2_ENGINE_BYTES + 10 * 16 * shm_budget.MIB)
    with pytest.raises(ValueError, match="tp must be >= 1, got 0"):
        shm_budget.engine_ring_bytes(0)


def test_the_sizes_are_the_installed_vllms() -> None:
    from vllm import envs
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.v1.executor import multiproc_executor

    queue = inspect.signature(shm_broadcast.MessageQueue.__init__).parameters
    assert queue["max_chunk_bytes"].default == shm_budget.RESPONSE_CHUNK_BYTES
    assert queue["max_chunks"].default == shm_budget.RESPONSE_CHUNKS
    assert queue["max_chunks"].default == shm_budget.BROADCAST_CHUNKS
    source = inspect.getsource(envs)
    assert 'os.getenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", "16")' in source
    assert shm_budget.DEFAULT_MQ_CHUNK_MIB == 16
    group = inspect.getsource(parallel_state.GroupCoordinator.__init__)
    assert "create_from_process_group(\n                self.cpu_group, 1 << 22, 6\n" in group
    assert shm_budget.TP_GROUP_CHUNK_BYTES == 1 << 22 and shm_budget.TP_GROUP_CHUNKS == 6
    executor = inspect.getsource(multiproc_executor)
    assert "self.worker_response_mq = MessageQueue(1, 1)" in executor  # 24 MiB x 10, 1 reader


def test_the_default_follows_the_decode_tp_and_the_decode_kills() -> None:
    assert soak.parse_args([]).shm_mib == 256  # TP 1: no ring buffers
    tp2 = soak.parse_args(["--decode-tp", "2"])
    engine_mib = MEASURED_TP2_ENGINE_BYTES / shm_budget.MIB  # 664 MiB
    # Three TP 2 engines, plus what 2 decode kills and 2 TP rank kills may leave behind.
    assert tp2.shm_mib == 256 + round(3 * engine_mib + 0.5) + round(4 * engine_mib + 0.5)
    fewer = soak.parse_args(["--decode-tp", "2", "--max-decode-kills", "0",
                             "--max-tp-rank-kills", "1"])
    assert fewer.shm_mib == 256 + round(3 * engine_mib + 0.5) + round(engine_mib + 0.5)


def test_a_private_shm_too_small_for_the_engines_is_refused_naming_the_size_needed(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert soak.parse_args(["--shm-mib", "256"]).shm_mib == 256  # enough at TP 1
    assert soak.parse_args(["--decode-tp", "2", "--shm-mib", "2249"]).shm_mib == 2249
    with pytest.raises(SystemExit):
        soak.parse_args(["--decode-tp", "2", "--shm-mib", "2248"])
    error = capsys.readouterr().err
    assert "--shm-mib 2248 is too small for engines at --decode-tp 2" in error
    assert "need at least 2249 MiB of /dev/shm" in error
    assert "decode TP 2: 664 MiB" in error and "VLLM_MQ_MAX_CHUNK_BYTES_MB=16" in error


def test_the_broadcast_chunk_size_comes_from_the_environment() -> None:
    assert shm_budget.mq_chunk_mib({}) == 16
    assert shm_budget.mq_chunk_mib({"VLLM_MQ_MAX_CHUNK_BYTES_MB": "32"}) == 32
    assert shm_budget.mq_chunk_mib({"VLLM_MQ_MAX_CHUNK_BYTES_MB": "junk"}) == 16
