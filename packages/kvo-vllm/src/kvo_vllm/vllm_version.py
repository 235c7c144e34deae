"""The vLLM versions kvo-vllm supports, checked when kvo starts inside vLLM.

kvo plugs into vLLM's experimental KV-connector API and subclasses vLLM's CPU platform and
attention backend classes: both change between vLLM releases, so kvo states the range it is
tested with (the same range as the ``cpu`` / ``cuda`` extras in kvo-vllm's pyproject.toml) and
says so at start-up when the vLLM it runs in is outside it: the plugins step aside (vLLM runs as
without kvo) and kvo's connectors refuse to start, unless ``KVO_ALLOW_UNSUPPORTED_VLLM=1``,
which keeps everything on with a warning (for trying a new vLLM).
"""

from __future__ import annotations

import logging
import os

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from kvo_core.errors import KvoError

SUPPORTED_VLLM = ">=0.32,<0.33"
ALLOW_ENV_VAR = "KVO_ALLOW_UNSUPPORTED_VLLM"
logger = logging.getLogger(__name__)


class UnsupportedVllmError(KvoError, RuntimeError):
    """The running vLLM is outside kvo-vllm's supported range."""


def running_vllm_version() -> str:
    import vllm.version

    return str(vars(vllm.version)["__version__"])


def unsupported_reason(version: str) -> str | None:
    """Why ``version`` is not supported, or None when it is."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"vLLM reports the version {version!r}, which is not a version number"
    if SpecifierSet(SUPPORTED_VLLM).contains(parsed, prereleases=True):
        return None
    return f"vLLM {version} is outside the range kvo-vllm supports ({SUPPORTED_VLLM})"


def allowed_anyway() -> bool:
    return os.environ.get(ALLOW_ENV_VAR, "0") == "1"


def vllm_supported(what: str, version: str | None = None) -> bool:
    """Whether ``what`` (a kvo plugin) may run in this vLLM; logs a WARNING when not, or when
    it runs anyway because ``KVO_ALLOW_UNSUPPORTED_VLLM=1``."""
    reason = unsupported_reason(running_vllm_version() if version is None else version)
    if reason is None:
        return True
    if allowed_anyway():
        logger.warning("kvo: %s; %s runs anyway because %s=1 (untested)", reason, what,
                       ALLOW_ENV_VAR)
        return True
    logger.warning("kvo: %s; %s steps aside and vLLM runs as without kvo (install a vLLM in "
                   "that range, or set %s=1 to try anyway)", reason, what, ALLOW_ENV_VAR)
    return False


def require_supported_vllm(what: str, version: str | None = None) -> None:
    """Raise UnsupportedVllmError when ``what`` (a kvo connector) must not start here."""
    reason = unsupported_reason(running_vllm_version() if version is None else version)
    if reason is None:
        return
    if allowed_anyway():
        logger.warning("kvo: %s; %s starts anyway because %s=1 (untested)", reason, what,
                       ALLOW_ENV_VAR)
        return
    raise UnsupportedVllmError(f"{what} cannot start: {reason}; install a vLLM in that range "
                               f"(kvo-vllm[cpu] or kvo-vllm[cuda]) or set {ALLOW_ENV_VAR}=1 "
                               "to try anyway")
