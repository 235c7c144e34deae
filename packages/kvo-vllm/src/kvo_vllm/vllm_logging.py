"""kvo's log lines in a vLLM server's log, in vLLM's format.

vLLM configures only its own ``vllm`` logger (its handler, format and level, from
``VLLM_LOGGING_LEVEL`` / ``VLLM_LOGGING_CONFIG_PATH``) and stops it from propagating to the
root logger; kvo's loggers (``kvo.*``, ``kvo_vllm.*``, ...) sit outside that tree, so in a
server their INFO lines went nowhere and their warnings printed bare. Inside a vLLM process
kvo's plugins make kvo's top-level loggers children of ``vllm``: every kvo line then takes the
path of vLLM's own lines (same handler, format, level, and any logging config a user gives
vLLM), keeps its own name, and a user can still set a level on ``kvo`` or ``kvo_vllm``.
Outside vLLM (kvo-core, kvo-kernels, kvo-transport used alone; the proxy) nothing changes.
"""

from __future__ import annotations

import logging

VLLM_LOGGER = "vllm"
KVO_LOGGERS = ("kvo", "kvo_core", "kvo_kernels", "kvo_transport", "kvo_vllm")
"""The top-level names kvo's packages log under (``kvo.transport.host_pool``,
``kvo_vllm.remote_d2h.connector``, ...)."""


def join_vllm_logging() -> None:
    """Put kvo's loggers under vLLM's ``vllm`` logger in this process (idempotent).

    Loggers created later under these names find their parent by name, so they join too.
    """
    parent = logging.getLogger(VLLM_LOGGER)
    for name in KVO_LOGGERS:
        logging.getLogger(name).parent = parent

