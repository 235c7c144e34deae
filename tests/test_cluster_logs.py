"""A restarted process keeps the log of the one before it (kvo_tools.pd.cluster): after the
soak kills and restarts a decode, both decodes' logs are there to read."""

from __future__ import annotations

import sys
from pathlib import Path

from kvo_tools.pd.cluster import Cluster


def test_a_restart_under_the_same_name_writes_a_log_of_its_own(tmp_path: Path) -> None:
    with Cluster(tmp_path) as cluster:
        for text in ("first decode", "second decode", "third decode"):
            managed = cluster.start("decode", [sys.executable, "-c", f"print({text!r})"])
            managed.process.wait(timeout=60)
        other = cluster.start("prefill", [sys.executable, "-c", "print('prefill')"])
        other.process.wait(timeout=60)
    logs = {path.name: path.read_text().strip() for path in tmp_path.glob("*.log")}
    assert logs == {"decode.log": "first decode", "decode.restart1.log": "second decode",
                    "decode.restart2.log": "third decode", "prefill.log": "prefill"}
    assert managed.log_path.name == "decode.restart2.log"  # log_tail reads the live one
    assert managed.log_tail().strip() == "third decode"
