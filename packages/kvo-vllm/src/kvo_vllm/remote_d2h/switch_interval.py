"""Let the hand-off threads run while vLLM's forward holds the GIL.

Each layer of a P/D hand-off crosses threads: decode's receiver thread reads a READY and answers,
prefill's I/O and store-save threads report to the slot gates its forward waits on. A thread
that wants the GIL while another runs Python waits up to the interpreter's switch interval
(5 ms by default) before the holder is asked to let go, and vLLM's forward of a small model and
its idle step loop are mostly Python. So every wake-up on the layer round trip can cost up to
5 ms. A shorter interval made the decode start its reads sooner (``kvo_tools.bench._pd_timeline``)
but did not pay end to end (``kvo_tools.bench._pd_switch_ab``; numbers in docs/benchmarks.md),
so it is opt-in (``gil_switch_interval_s``, default null). The interval is process-wide: it is only
ever shortened here, never lengthened past what the process uses.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


def shorten_switch_interval(seconds: float | None) -> float:
    """Set the GIL switch interval to ``seconds`` when that is shorter (None: leave it);
    returns the interval now in force."""
    current = sys.getswitchinterval()
    if seconds is None or seconds >= current:
        return current
    sys.setswitchinterval(seconds)
    logger.info("kvo remote_d2h: GIL switch interval %.2g s -> %.2g s, so the hand-off threads "
                "run while the forward holds the GIL", current, seconds)
    return sys.getswitchinterval()
