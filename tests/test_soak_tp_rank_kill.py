"""The soak's ``decode_tp_rank_killed``: it finds the decode's TP rank 1 worker among the server's
descendants by vLLM's process title (a fake /proc tree, then real processes titled as vLLM titles
them), and refuses the fault when the decode runs TP 1."""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvo_tools import soak
from kvo_tools.pd.tp_workers import NoTPWorker, descendants, tp_worker


def _fake_process(proc: Path, pid: int, parent: int, title: str, comm: str = "python") -> None:
    entry = proc / str(pid)
    entry.mkdir()
    (entry / "stat").write_text(f"{pid} ({comm}) S {parent} {pid} {pid} 0 -1 4194560 0\n")
    (entry / "cmdline").write_bytes(title.encode() + b"\x00")


@pytest.fixture
def fake_proc(tmp_path: Path) -> Path:
    """An API server (100) -> engine core (101) -> workers TP0 (102), TP1 (103), TP10 (104);
    another server's TP1 worker (201) outside the tree; a comm with ") " in it."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "self").mkdir()  # not a pid: skipped
    _fake_process(proc, 1, 0, "init")
    _fake_process(proc, 100, 1, "python -m vllm.entrypoints.openai.api_server --port 1")
    _fake_process(proc, 101, 100, "VLLM::EngineCore", comm="odd) name")
    _fake_process(proc, 102, 101, "VLLM::Worker_TP0")
    _fake_process(proc, 103, 101, "VLLM::Worker_TP1")
    _fake_process(proc, 104, 101, "VLLM::Worker_TP10")
    _fake_process(proc, 200, 1, "python -m vllm.entrypoints.openai.api_server --port 2")
    _fake_process(proc, 201, 200, "VLLM::Worker_TP1")
    return proc


def test_the_tp_worker_is_found_below_its_own_server_only(fake_proc: Path) -> None:
    assert descendants(100, fake_proc) == [101, 102, 103, 104]
    assert tp_worker(100, 1, fake_proc) == 103
    assert tp_worker(100, 0, fake_proc) == 102
    assert tp_worker(200, 1, fake_proc) == 201


def test_a_missing_tp_worker_is_an_error_naming_what_the_server_runs(fake_proc: Path) -> None:
    with pytest.raises(NoTPWorker, match=r"found 0 .*103: 'VLLM::Worker_TP1'"):
        tp_worker(100, 3, fake_proc)
    with pytest.raises(NoTPWorker, match="descendants: none"):
        tp_worker(102, 1, fake_proc)


TITLED = """
import os, setproctitle, subprocess, sys, time
if sys.argv[1] == "server":
    children = [subprocess.Popen([sys.executable, "-c", sys.argv[2], "worker", str(rank),
                                  sys.argv[2]]) for rank in (0, 1)]
    print("up", flush=True)
    for _ in children:  # reaps whichever ends first
        os.wait()
else:
    setproctitle.setproctitle(f"VLLM::Worker_TP{sys.argv[2]}")
    time.sleep(120)
"""


def test_a_real_worker_titled_as_vllm_titles_it_is_found_and_killed() -> None:
    server = subprocess.Popen([sys.executable, "-c", TITLED, "server", TITLED],
                              stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"up"
        deadline = time.monotonic() + 30
        while True:  # the workers set their titles once started
            try:
                worker = tp_worker(server.pid, 1)
                break
            except NoTPWorker:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert worker in descendants(server.pid)
        assert worker != tp_worker(server.pid, 0)
        kill = soak.TPRankKill(tp_rank=1, pid=worker)
        soak._sigkill(kill)
        assert kill.killed
        deadline = time.monotonic() + 10
        while worker in descendants(server.pid):
            assert time.monotonic() < deadline, "the killed worker is still there"
            time.sleep(0.05)
        assert server.poll() is None  # the rank's parent lives on, as vLLM's may
        soak._sigkill(kill := soak.TPRankKill(tp_rank=1, pid=worker))
        assert not kill.killed  # gone already: the soak counts this kill as not made
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_the_tp_rank_kill_is_refused_with_decode_tp_1(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    with pytest.raises(SystemExit) as exit_info:
        soak.parse_args(["--faults", "decode_killed", "decode_tp_rank_killed"])
    assert exit_info.value.code == 2
    assert ("--faults decode_tp_rank_killed needs --decode-tp 2 (it kills a decode TP worker "
            "other than rank 0), got --decode-tp 1") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        soak.parse_args(["--decode-tp", "3"])
    assert "invalid choice: 3" in capsys.readouterr().err


def test_the_default_draw_has_the_tp_rank_kill_only_at_decode_tp_2() -> None:
    tp1 = soak.parse_args([])
    assert "decode_tp_rank_killed" not in tp1.faults
    assert tp1.skip_faults == {"decode_tp_rank_killed":
                               "needs --decode-tp 2 (the decode runs TP 1)"}
    tp2 = soak.parse_args(["--decode-tp", "2"])
    assert tp2.faults == list(soak.FAULTS) and tp2.skip_faults == {}
    asked = soak.parse_args(["--decode-tp", "2", "--faults", "decode_tp_rank_killed"])
    assert asked.faults == ["decode_tp_rank_killed"]


def test_each_decode_restarting_fault_has_its_own_limit() -> None:
    args = argparse.Namespace(max_decode_kills=2, max_tp_rank_kills=1)
    drawn = collections.Counter({"decode_killed": 1, "decode_tp_rank_killed": 1,
                                 "failed_read": 50})
    assert soak._may_draw("decode_killed", drawn, args)
    assert not soak._may_draw("decode_tp_rank_killed", drawn, args)
    assert soak._may_draw("failed_read", drawn, args)
    drawn["decode_killed"] += 1
    assert not soak._may_draw("decode_killed", drawn, args)


def test_the_soak_records_whether_the_decode_server_exits_after_losing_a_rank(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvo_tools.pd.cluster import Managed, free_port

    monkeypatch.setattr(soak, "SERVER_EXIT_WAIT_S", 2.0)
    for name, code, exited in (("exits", "import time; time.sleep(0.5)", True),
                               ("stays", "import time; time.sleep(30)", False)):
        process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        server = Managed(name=name, argv=[], log_path=tmp_path / name, process=process,
                         url=f"http://127.0.0.1:{free_port()}")  # nothing answers there
        kill = soak.TPRankKill(tp_rank=1, pid=0)
        try:
            soak._watch_server(server, kill)
        finally:
            server.kill()
        assert kill.server_alive_after_batch
        if exited:
            assert kill.server_exited_after_s is not None
            assert 0.2 < kill.server_exited_after_s < 2.0
            assert kill.health_ok_while_running is None
        else:
            assert kill.server_exited_after_s is None
            assert kill.health_ok_while_running is False
