"""The tests' fault injection is plugged into a decode from outside, not named in its config.

``kvo_tools.pd.sites.faulty_decode_env`` gives a decode server an environment whose
``sitecustomize`` (``kvo_tools/pd/engine_site``) makes every ``DecodePuller`` read through the
fault-injecting engine; the connector's own config refuses an ``engine_wrapper`` key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvo_core.errors import ConfigError
from kvo_tools.pd import sites
from kvo_vllm.remote_d2h.options import RemoteD2HOptions

# What a decode worker does: import kvo's decode worker module, build a puller from its config.
PULLER = """
import json
from kvo_core.config import RemoteD2HConfig
from kvo_vllm.remote_d2h.decode_worker import DecodePuller

puller = DecodePuller(config=RemoteD2HConfig(kv_port=27100), tp_rank=0, tp_size=1, dp_rank=0)
wrapper = puller._engine_wrapper
print(json.dumps(None if wrapper is None else {
    "factory": f"{wrapper.func.__module__}:{wrapper.func.__name__}",
    "options": wrapper.keywords}))
puller.close()
"""


def _puller_wrapper(env: dict[str, str]) -> object:
    done = subprocess.run([sys.executable, "-c", PULLER], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_decode_started_with_the_fault_env_reads_through_the_faulty_engine(
        tmp_path: Path) -> None:
    control = tmp_path / "faults-{tp_rank}.json"
    assert _puller_wrapper(sites.faulty_decode_env(control)) == {
        "factory": "kvo_tools.pd.faulty_engine:wrap", "options": {"control_file": str(control)}}


def test_without_the_env_a_decode_reads_through_no_wrapper() -> None:
    assert _puller_wrapper({}) is None


def test_the_connector_config_refuses_an_engine_wrapper() -> None:
    with pytest.raises(ConfigError, match="engine_wrapper"):
        RemoteD2HOptions.from_extra_config({
            "kv_port": 27100,
            "engine_wrapper": {"factory": "kvo_tools.pd.faulty_engine:wrap", "options": {}}})


@pytest.mark.parametrize(("value", "reason"), [
    ("not json", "is not JSON"),
    (json.dumps({"factory": "kvo_tools.pd.faulty_engine:wrap", "extra": 1}), "must be"),
    (json.dumps({"factory": "kvo_tools.pd.no_such_module:wrap"}), "cannot be loaded"),
    (json.dumps({"factory": "kvo_tools.pd.faulty_engine"}), "must be 'module:callable'"),
    (json.dumps({"factory": "kvo_tools.pd.faulty_engine:CORRUPT_BYTE"}), "is not callable"),
])
def test_a_bad_wrapper_value_fails_naming_it(value: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        sites.engine_wrapper_from_env(value)


def test_the_harness_refuses_a_factory_that_cannot_be_loaded() -> None:
    with pytest.raises(ValueError, match="no_such_module"):
        sites.wrapped_decode_env("kvo_tools.pd.no_such_module:wrap")
