"""Let the hand-off threads run while vLLM's forward holds the GIL.

Each layer of a P/D hand-off crosses threads: decode's receiver thread reads a READY and answers,
prefill's I/O and store-save threads report to the slot gates its forward waits on. A thread
that wants the GIL while another runs Python waits up to the interpreter's switch interval
(5 ms by default) before the holder is asked to let go, and vLLM's forward of a small model and
its idle step loop are mostly Python. So every wake-up on the layer round trip can cost up to
5 ms. Measured with ``tools/bench/_pd_timeline.py`` (128-token prompts, two runs on 2 cores
shared with other work, load ~10-15): the decode's read of a layer started a median 9.1 ms after
the prefill published it with the default interval, 1.0 ms with 0.5 ms, and the prefill's
forward waited a median 2.1 vs 1.3 ms per layer on its slot gates. End to end it did not pay
(tools/bench/_pd_switch_ab.py, paired, 8 rounds): on a quiet host (load ~3) TTFT B/A 0.99 at
128 tokens and 1.02 at 1024; loaded, 0.81x at 1024 in one run, 1.0-1.36x at 128 in others. So it
is opt-in (``gil_switch_interval_s``, default null). The interval is process-wide: it is only
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
