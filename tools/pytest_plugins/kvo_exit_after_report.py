"""Pytest plugin for the nox test sessions: the process exits as soon as the report is written.

Why: Mooncake's store client keeps a process-wide registry that tears every client down when
the interpreter exits, including the clients kvo abandoned because their master was dead
(kvo_transport.buffer_store). Tests kill masters on purpose, and each such teardown retries the
dead master for 7-15 s while a background thread keeps reconnecting: measured here, the
transport session spent 30 s after its last test in that teardown. Nothing a test checks
happens there (every fixture has been finalised and the summary printed), so a run that has
reported ends with ``os._exit`` and its exit status instead of waiting for it.

Loaded with ``-p kvo_exit_after_report`` (noxfile.py); a plain ``pytest`` run does without it.
"""

from __future__ import annotations

import os
import sys

import pytest

_status: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if not _status:  # no session ran (``--help``, a usage error): exit the usual way
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status[-1])
