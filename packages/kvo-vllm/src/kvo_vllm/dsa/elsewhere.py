"""kvo's sparse settings on a vLLM platform that is not kvo's: an error, not silence.

Where kvo's platform does not run (a CUDA or other non-CPU vLLM, ``KVO_DSA_PLATFORM=0``, a CPU
platform kvo does not extend, an unsupported vLLM version, a failed plugin), nothing of kvo
reads ``additional_config.kvo_sparse`` or ``KVO_SPARSE_CONFIG``: a user who set them would get
vLLM's own attention without a word. The general plugin wraps that platform's
``check_and_update_config`` (which vLLM calls on every engine config it builds) so that such a
config fails at start-up naming the platform; configs without kvo's settings pass through
untouched.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from kvo_core.errors import ConfigError
from kvo_vllm.dsa.config import ADDITIONAL_CONFIG_KEY, ENV_VAR
from kvo_vllm.dsa.decision import announce

logger = logging.getLogger(__name__)
_GUARD_MARK = "_kvo_refuses_sparse_settings"


def platform_name(platform: Any) -> str:
    kind = type(platform)
    return (f"{kind.__module__}.{kind.__qualname__} "
            f"(device {getattr(platform, 'device_name', '?')!r})")


def check_no_sparse_settings(vllm_config: Any, platform: Any, reason: str | None) -> None:
    """Raise ConfigError when ``vllm_config`` (or the environment) carries kvo's sparse
    settings while ``platform`` is not kvo's."""
    additional = getattr(vllm_config, "additional_config", None)
    if isinstance(additional, Mapping) and ADDITIONAL_CONFIG_KEY in additional:
        where = f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]"
    elif os.environ.get(ENV_VAR):
        where = f"the environment variable {ENV_VAR}"
    else:
        return
    why = reason or "kvo's platform plugin is not active in this vLLM"
    raise ConfigError(
        f"{where} is set, but kvo's sparse MLA backend cannot run on this vLLM's platform "
        f"{platform_name(platform)}: {why}. kvo's sparse backend runs on vLLM's CPU platform "
        f"through kvo's platform plugin (kvo_vllm.dsa.platform); remove {where} to serve "
        "without it")


def refuse_sparse_settings_on(platform: Any, reason: str | None) -> None:
    """Wrap ``platform.check_and_update_config`` (this process's platform object) with the
    check above; idempotent."""
    if vars(platform).get(_GUARD_MARK):  # not getattr: vLLM's Platform warns on a miss
        return
    original: Callable[[Any], None] = platform.check_and_update_config

    def check_and_update_config(vllm_config: Any) -> None:
        announce()  # the platform plugin's decision, now that vLLM's logging is set up
        check_no_sparse_settings(vllm_config, platform, reason)
        original(vllm_config)

    platform.check_and_update_config = check_and_update_config
    setattr(platform, _GUARD_MARK, True)
    logger.debug("kvo: %s is not kvo's platform; kvo's sparse settings are refused on it",
                 platform_name(platform))
