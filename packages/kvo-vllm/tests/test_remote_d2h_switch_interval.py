"""The worker's GIL switch interval is only ever shortened (switch_interval.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from kvo_core.config import RemoteD2HConfig
from kvo_vllm.remote_d2h.switch_interval import shorten_switch_interval


@pytest.fixture(autouse=True)
def restore_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_a_shorter_interval_is_applied() -> None:
    sys.setswitchinterval(0.005)
    assert shorten_switch_interval(0.0005) == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_a_longer_interval_never_replaces_a_shorter_one() -> None:
    sys.setswitchinterval(0.0002)
    assert shorten_switch_interval(0.0005) == pytest.approx(0.0002)
    assert sys.getswitchinterval() == pytest.approx(0.0002)


def test_null_leaves_the_interpreter_alone() -> None:
    sys.setswitchinterval(0.005)
    assert shorten_switch_interval(None) == pytest.approx(0.005)


def test_the_config_default_leaves_the_interpreter_alone_and_a_value_is_accepted() -> None:
    assert RemoteD2HConfig(kv_port=1).gil_switch_interval_s is None
    config = RemoteD2HConfig.from_extra_config({"kv_port": 1, "gil_switch_interval_s": None})
    assert config.gil_switch_interval_s is None
    assert RemoteD2HConfig.from_extra_config(
        {"kv_port": 1, "gil_switch_interval_s": 0.001}).gil_switch_interval_s == 0.001
