"""What kvo's platform plugin decided in this process, and saying it where it can be read.

vLLM picks its platform (and so calls kvo's platform plugin) before it has set up its logging
in the API server process: a line logged then goes nowhere (INFO) or prints bare (WARNING and
above). The plugin's lines are therefore held until vLLM's logging is set up, which is the
case when vLLM builds an engine config: both kvo's platform and the guard kvo puts on any other
platform (:mod:`kvo_vllm.dsa.elsewhere`) call :func:`announce` from ``check_and_update_config``.
Where logging is already set up (vLLM's engine and worker processes), lines go out at once.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("kvo_vllm.dsa")
_lock = threading.Lock()
_pending: list[tuple[int, str, BaseException | None]] = []
_step_aside: list[str] = []


def _logging_ready() -> bool:
    """Whether a line logged now reaches a handler (vLLM's, or one a user or a test set up)."""
    return logging.getLogger("vllm").hasHandlers()


def say(level: int, message: str, error: BaseException | None = None) -> None:
    """Log ``message`` now if it can be read, else hold it for :func:`announce`."""
    if _logging_ready():
        logger.log(level, message, exc_info=error)
        return
    with _lock:
        _pending.append((level, message, error))


def announce() -> None:
    """Log the held lines (once)."""
    with _lock:
        held = list(_pending)
        _pending.clear()
    for level, message, error in held:
        logger.log(level, message, exc_info=error)


def step_aside(reason: str, level: int = logging.INFO, error: BaseException | None = None,
               message: str | None = None) -> None:
    """Record why kvo's platform plugin stepped aside in this process, and say it."""
    _step_aside[:] = [reason]
    say(level, message or ("kvo: platform plugin steps aside, vLLM keeps its own platform: "
                           + reason), error)


def step_aside_reason() -> str | None:
    """Why kvo's platform plugin stepped aside in this process, if it did."""
    return _step_aside[0] if _step_aside else None


def reset() -> None:
    """Forget the decision (the plugin decides again; tests)."""
    with _lock:
        _pending.clear()
    _step_aside.clear()
