"""Fault soak of the P/D flow: many requests through the proxy while faults are injected at random.

Starts the demo's deployment (Mooncake master, plain vLLM as the reference, prefill with
KvoMultiConnector, decode with RemoteD2HConnector, the proxy; the control plane authenticated
with a secret) and sends ``--requests`` greedy requests drawn from a fixed prompt set. Before
roughly ``--fault-rate`` of them one fault is injected, drawn at random:

- ``failed_read``: the decode's next engine reads fail (its test-only fault file);
- ``slow_read``: every decode read first sleeps 0.3 s (slow, within the layer deadline);
- ``lost_ack``: the decode's next READ_DONE is dropped on its way to the prefill (its fault
  file; the frame is never sent): the decode has the layer, the prefill hears nothing and fails
  the READY at its layer deadline (10 s here);
- ``bad_frames``: forged, replayed-looking, MAC-less and garbage frames hit the decode's control
  socket from a raw ZMQ peer while the request runs;
- ``bad_notify``: unsigned and forged POSTs hit the proxy's notify endpoint;
- ``master_killed``: the Mooncake master is killed before the request and restarted after it
  (the prefill's store saves and loads fail fast: circuit breaker);
- ``master_frozen``: the Mooncake master is stopped (SIGSTOP) before the request and continued
  (SIGCONT) after it: its connections are still accepted, nothing answers (bounded store calls);
- ``decode_killed``: the decode vLLM is killed while the request runs, then restarted (at most
  ``--max-decode-kills`` times: a restart takes a minute here);
- ``routing_id_takeover``: while the batch runs, a second ZMQ connection claims the routing id
  of the prefill's live control connection on the decode's ROUTER again and again (read from
  the decode's log; kvo_tools.pd.hostile); the decode must never answer it (``takeover`` in the
  JSON counts tries and answers) and the prefill's own connection must keep working;
- ``shm_nearly_full``: /dev/shm is filled up to ``--shm-remainder-kib`` KiB while the batch
  runs, then emptied again. The soak runs in a mount namespace of its own with a small private
  tmpfs (``--shm-mib``, by default sized for the engines' TP: kvo_tools.pd.shm_budget) on
  /dev/shm (kvo_tools.pd.private_shm), shared by all its engines as one host's are: the
  machine's /dev/shm is never filled. Without root (no mount namespace) the
  fault is left out and the JSON says why (``skipped_faults``).

- ``decode_tp_rank_killed`` (only with ``--decode-tp`` 2): one decode TP worker other than
  rank 0 (vLLM's ``VLLM::Worker_TP1`` process, found among the decode server's descendants:
  kvo_tools.pd.tp_workers) is SIGKILLed while the batch runs; the requests in flight must fail
  cleanly or answer right, never hang. Then the decode is restarted as for ``decode_killed``
  (its whole process group killed first, whatever vLLM made of the lost rank), at most
  ``--max-tp-rank-kills`` times. The JSON's ``tp_rank_kills`` says which rank and pid died and
  whether the decode's API server was still running after the batch.

``--decode-tp`` N runs the decode at TP N (vLLM's ``mp`` executor, one core per worker). The
prefill and the plain reference then run at TP N too: kvo's TP mapping needs prefill TP >= decode
TP, and a reference at the decode's TP shards its sums the same way, so its answers still compare
token for token.

Requests go out in batches of ``--concurrency`` at once (each batch at most one fault, active for
the whole batch): a fault must leave every other request in flight exact too. A faulted batch's
first request gets a prompt of its own (the request number in front): a prompt the decode has
cached would need no pull, and a read fault would then never bite. Each answer is compared
with the plain vLLM's answer to the same prompt (token ids): identical,
failed cleanly (an error status), wrong (a different answer: must be 0) or hung (no answer
within ``--timeout``: must be 0). A prefill or decode that dies without being killed by the soak
is counted (``crashes``), its log tail kept in the JSON, and restarted so the soak goes on.
After each faulted batch the soak measures how long the prefill-decode pair stayed unusable
(``unusable_s``): the time from the fault's end (the moment the soak stops injecting it: fault
file emptied, noise or takeover thread stopped, master restarted or continued, /dev/shm emptied;
for ``decode_killed``, the restarted decode answering /health) until the end of the first
probe request that the pair served: a request with a fresh prompt sent through the proxy whose
KV the decode pulled from the prefill (its ``received`` counter went up; a request the decode
recomputed does not count) and whose answer equals plain vLLM's. Probes go one at a time, back
to back, so the time includes one probe's own latency. A pair still unusable after
``--recovery-limit`` seconds counts as ``unrecovered`` (must be 0). The issue's target is one
layer deadline (10 s here) plus one handshake.
The JSON records each engine's resident memory and /dev/shm files at the soak's start and end
(``footprint``: per process group, kvo_tools.pd.footprint). Each process logs to
``<workdir>/logs/<name>.log``; a restarted one (a killed decode) to ``<name>.restart1.log``,
``<name>.restart2.log``, ... beside the earlier ones. Prints the table and writes JSON. Not
part of ``nox -s tests``: ``nox -s soak`` (``-- --requests 50`` for a shorter run). Exit 0 when
wrong == hung == crashes == unrecovered == 0
(probes included) and every decode TP rank kill reached its worker.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import attrs

from kvo_tools.pd import shm_budget
from kvo_tools.pd.client import Answer, complete, completion_body
from kvo_tools.pd.cluster import (
    Cluster,
    Managed,
    decode_transfer_config,
    free_port,
    http_ok,
    prefill_transfer_config,
    reexec_in_namespace,
    start_master,
    stopping_on_signals,
    wait_healthy,
)
from kvo_tools.pd.footprint import footprint, shm_listing
from kvo_tools.pd.hostile import TakeoverCounts, keep_taking_over
from kvo_tools.pd.private_shm import filled, private, reexec_with_private_shm, why_no_private_shm
from kvo_tools.pd.sites import faulty_decode_env
from kvo_tools.pd.stats import decode_stats
from kvo_tools.pd.tp_workers import tp_worker

NUM_LAYERS = 4
MAX_TOKENS = 6
SECRET = "soak control secret, test only"
TEXT = ("A soak sends many requests while things break underneath; every answer must be the "
        "plain answer or a clean failure. ")
OUTCOMES = ("identical", "failed_cleanly", "wrong", "hung")
FAULTS = ("failed_read", "slow_read", "lost_ack", "bad_frames", "bad_notify",
          "master_killed", "master_frozen", "decode_killed", "routing_id_takeover",
          "shm_nearly_full", "decode_tp_rank_killed")
KILL_LIMITS = {"decode_killed": "max_decode_kills", "decode_tp_rank_killed": "max_tp_rank_kills"}
"""Faults that restart the decode (a minute each here): drawn at most that argument's times."""
TP_ONLY_FAULTS = ("decode_tp_rank_killed",)
"""Faults that need ``--decode-tp`` 2."""
PROBE_TEXT = ("A probe asks whether the pair serves again after a fault: the decode must pull "
              "this prompt's KV from the prefill. ") * 6
ENGINES = ("plain", "prefill", "decode", "proxy")

_T = TypeVar("_T")


def _prompts(count: int) -> list[str]:
    rng = random.Random(7)
    return [(f"soak {i}: " + TEXT * 40)[:rng.randint(40, 1200)] for i in range(count)]


class Deployment:
    """The processes of the soak, with what the faults need to restart them."""

    def __init__(self, workdir: Path, cluster: Cluster, model: Path, tp: int = 1) -> None:
        self.workdir = workdir
        self.cluster = cluster
        self.model = model
        self.tp = tp
        """TP of every engine (decode, prefill and the plain reference)."""
        self.faults_file = workdir / "faults.json"
        self.faults_file.write_text("{}")
        self.kv_port = free_port()
        self.decode_port = free_port()
        self.master = start_master()
        self.plain = cluster.start_vllm("plain", model, free_port(), **self._tp_options())
        self.prefill_port = free_port()
        self.prefill = self._start_prefill()
        self.decode = self._start_decode()
        self.proxy = cluster.start_proxy(free_port(), self.prefill.url or "",
                                         self.decode.url or "", extra_args=["--ready-timeout",
                                                                            "30"])
        wait_healthy([self.plain, self.prefill, self.decode, self.proxy], 900,
                     progress=lambda note: print(f"  {note}", flush=True))

    def _start_prefill(self) -> Managed:
        return self.cluster.start_vllm("prefill", self.model, self.prefill_port,
                                       prefill_transfer_config(
                                           self.master.address, self.kv_port,
                                           self.workdir / "prefill-stats.json",
                                           layer_deadline_s=10.0, handshake_timeout_s=10.0),
                                       **self._tp_options())

    def _tp_options(self) -> dict[str, Any]:
        """``start_vllm`` arguments for an engine at the deployment's TP."""
        if self.tp == 1:
            return {}
        return {"extra_args": ["--tensor-parallel-size", str(self.tp),
                               "--distributed-executor-backend", "mp"],
                "env": {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(self.tp)))}}

    def restart_dead(self) -> list[tuple[str, str]]:
        """Restart a prefill or decode that died on its own; (name, log tail) of each."""
        dead = []
        for name in ("prefill", "decode"):
            managed = getattr(self, name)
            if managed.alive():
                continue
            dead.append((name, managed.log_tail(4000)))
            self.cluster.processes.remove(managed)
            if name == "decode":
                self._forget_decode_stats()
            setattr(self, name, self._start_prefill() if name == "prefill"
                    else self._start_decode())
            wait_healthy([getattr(self, name)], 900)
        return dead

    @property
    def decode_stats_file(self) -> Path:
        return self.workdir / "decode-stats.json"

    def _start_decode(self) -> Managed:
        config = decode_transfer_config(self.kv_port, self.decode_stats_file,
                                        layer_deadline_s=10.0, handshake_timeout_s=10.0,
                                        read_retries=0)
        options = self._tp_options()
        options["env"] = {**options.get("env", {}), **faulty_decode_env(self.faults_file)}
        return self.cluster.start_vllm("decode", self.model, self.decode_port, config,
                                       **options)

    def _forget_decode_stats(self) -> None:
        """Remove every decode rank's stats file: a new decode counts from 0."""
        from kvo_vllm.remote_d2h.stats_file import rank_stats_path

        for rank in range(self.tp):
            Path(rank_stats_path(str(self.decode_stats_file), rank) or "").unlink(
                missing_ok=True)

    def restart_decode(self) -> None:
        """Kill what is left of the decode's process group (a server that lost a TP rank may
        still run), then start a new decode and wait for its /health."""
        self.decode.kill()
        self.cluster.processes.remove(self.decode)
        self._forget_decode_stats()
        self.decode = self._start_decode()
        wait_healthy([self.decode], 900)

    def restart_master(self) -> None:
        port = self.master.rpc_port
        from kvo_tools.pd.cluster import STORE_LEASE_MS
        from kvo_transport.mooncake_master import MooncakeMaster

        self.master = MooncakeMaster(rpc_port=port,
                                     default_kv_lease_ttl_ms=STORE_LEASE_MS).start()

    def decode_control_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_port}"

    def footprints(self) -> dict[str, Any]:
        """Per engine: resident memory and /dev/shm files of its process group; all of
        /dev/shm too."""
        engines: dict[str, Any] = {name: footprint(getattr(self, name).process.pid)
                                   for name in ENGINES}
        return {"engines": engines, "dev_shm": shm_listing()}


def _bad_frames(endpoint: str, stop: threading.Event) -> None:
    """Frames no authenticated decode may act on, until ``stop``."""
    import zmq

    from kvo_transport.frame_auth import AuthCounters, ControlKey, PrefillChannel
    from kvo_transport.protocol import PROTOCOL_VERSION, ReadReadyBatch, encode

    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    ready = encode(ReadReadyBatch(version=PROTOCOL_VERSION, seq=1, layer_index=0,
                                  layer_name="model.layers.0.self_attn.attn", member=0, ratio=1))
    forger = PrefillChannel(ControlKey.from_secret("not the soak's secret!"), AuthCounters())
    frames = [ready, b"\x00garbage", b"KVA1" + bytes(80), forger.seal_hello(ready)]
    try:
        while not stop.wait(0.05):
            sock.send(random.choice(frames))
    finally:
        sock.close()
        context.term()


def _bad_notify(proxy: str) -> None:
    body = json.dumps({"kind": "prefill_failed", "transfer_id": "x", "error": "forged"}).encode()
    for headers in ({}, {"X-Kvo-Auth": "v1 0011223344556677.1." + "0" * 64}):
        request = urllib.request.Request(proxy + "/kvo/v1/notify", data=body, method="POST",
                                         headers={"content-type": "application/json",
                                                  **headers})
        try:
            urllib.request.urlopen(request, timeout=10).read()
        except Exception:  # 401 expected: the proxy refuses them
            pass


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvo_tools.models.tiny_llama import build_tiny_llama

    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="kvo-soak-"))
    os.environ["KVO_CONTROL_SECRET"] = SECRET  # engines and proxy inherit it
    model = build_tiny_llama(workdir / "model", num_layers=NUM_LAYERS)
    counts: collections.Counter[str] = collections.Counter()
    faults: collections.Counter[str] = collections.Counter()
    by_fault: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    wrong_examples: list[dict[str, Any]] = []
    crashes: list[dict[str, Any]] = []
    footprints: dict[str, Any] = {}
    unusable: dict[str, list[float]] = collections.defaultdict(list)
    unrecovered: collections.Counter[str] = collections.Counter()
    probes: collections.Counter[str] = collections.Counter()
    notes = Notes()
    drawn = [kind for kind in args.faults if kind not in args.skip_faults]
    with stopping_on_signals(), Cluster(workdir / "logs") as cluster:
        print("starting the deployment ...", flush=True)
        deployment = Deployment(workdir, cluster, model, tp=args.decode_tp)
        try:
            prompts = _prompts(args.prompts)
            reference = {}
            for prompt in prompts:
                answer = complete(deployment.plain.url or "", completion_body(
                    prompt, MAX_TOKENS, stream=False), timeout_s=args.timeout)
                assert answer.ok, answer.error
                reference[prompt] = answer.token_ids
            print(f"reference answers for {len(prompts)} prompts; soaking with "
                  f"{args.concurrency} request(s) in flight ...", flush=True)
            footprints = {"start": deployment.footprints()}
            i = 0
            while i < args.requests:
                size = min(args.concurrency, args.requests - i)
                batch = [rng.choice(prompts) for _ in range(size)]
                fault = rng.choice(drawn) if rng.random() < args.fault_rate else None
                if fault is not None and not _may_draw(fault, faults, args):
                    fault = rng.choice([kind for kind in drawn if _may_draw(kind, faults, args)]
                                       or [None])
                if fault is not None:  # its own prompt: nothing of it is cached anywhere
                    batch[0] = f"request {i} under fault {fault}. {batch[0]}"
                    answer = complete(deployment.plain.url or "", completion_body(
                        batch[0], MAX_TOKENS, stream=False), timeout_s=args.timeout)
                    assert answer.ok, answer.error
                    reference[batch[0]] = answer.token_ids
                    faults[fault] += 1
                answers, cleared = _batch(deployment, batch, fault, args, rng, notes)
                for offset, (prompt, answer) in enumerate(zip(batch, answers, strict=True)):
                    if answer.ok and answer.token_ids == reference[prompt]:
                        outcome = "identical"
                    elif answer.ok:
                        outcome = "wrong"
                        wrong_examples.append({"i": i + offset, "fault": fault,
                                               "got": answer.token_ids,
                                               "want": reference[prompt]})
                    elif answer.total_s >= args.timeout * 0.99:
                        outcome = "hung"
                    else:
                        outcome = "failed_cleanly"
                    counts[outcome] += 1
                    by_fault[fault or "none"][outcome] += 1
                for name, tail in deployment.restart_dead():
                    crashes.append({"i": i, "process": name, "fault": fault, "log_tail": tail})
                    print(f"  {name} died on its own in the batch from request {i} (fault "
                          f"{fault}); restarted", flush=True)
                    cleared = time.monotonic()
                if fault is not None:
                    took = _time_until_usable(deployment, cleared, f"{i}", reference, args,
                                              probes)
                    if took is None:
                        unrecovered[fault] += 1
                        print(f"  the pair stayed unusable for over {args.recovery_limit:g} s "
                              f"after {fault} (batch from request {i})", flush=True)
                    else:
                        unusable[fault].append(round(took, 3))
                before, i = i, i + size
                if i // 25 > before // 25:
                    print(f"  {i} requests: {dict(counts)}; faults {dict(faults)}",
                          flush=True)
            footprints["end"] = deployment.footprints()
        finally:
            deployment.master.stop()
    worst = {kind: max(times) for kind, times in unusable.items()}
    return {"requests": args.requests, "faults": dict(faults),
            "identical": counts["identical"], "failed_cleanly": counts["failed_cleanly"],
            "wrong": counts["wrong"], "hung": counts["hung"], "crashes": len(crashes),
            "by_fault": {kind: dict(outcomes) for kind, outcomes in by_fault.items()},
            "crash_details": crashes, "wrong_examples": wrong_examples,
            "concurrency": args.concurrency, "footprints": footprints,
            "unusable_s": dict(unusable), "worst_unusable_s": worst,
            "unrecovered": dict(unrecovered), "probes": dict(probes),
            "takeover": attrs.asdict(notes.takeover), "shm_left_bytes": notes.shm_left,
            "decode_tp": args.decode_tp,
            "private_shm_mib": args.shm_mib if private() else None,
            "tp_rank_kills": [attrs.asdict(kill) for kill in notes.tp_rank_kills],
            "skipped_faults": args.skip_faults, "workdir": str(workdir)}


def _may_draw(fault: str, faults: collections.Counter[str], args: argparse.Namespace) -> bool:
    """Whether ``fault`` is still below its limit (``KILL_LIMITS``; other faults have none)."""
    limit = KILL_LIMITS.get(fault)
    return limit is None or faults[fault] < getattr(args, limit)


@attrs.define
class TPRankKill:
    """One ``decode_tp_rank_killed``: whom it killed and what the decode server did."""

    tp_rank: int
    pid: int
    killed: bool = False
    """The SIGKILL reached the worker (False: it had already gone)."""
    server_alive_after_batch: bool | None = None
    """Whether the decode's API server still ran when the batch's answers were in."""
    server_exited_after_s: float | None = None
    """Seconds after the batch until the decode's API server exited on its own (None: still
    running after ``SERVER_EXIT_WAIT_S``)."""
    health_ok_while_running: bool | None = None
    """If it still ran then: whether its /health answered 200 (a server with a dead rank
    that calls itself healthy would keep getting requests in production)."""


@attrs.define
class Notes:
    """What the new faults observed, for the JSON."""

    takeover: TakeoverCounts = attrs.Factory(TakeoverCounts)
    shm_left: list[int] = attrs.Factory(list)
    """Bytes left in /dev/shm while each shm_nearly_full batch ran."""
    tp_rank_kills: list[TPRankKill] = attrs.Factory(list)


def _batch(deployment: Deployment, prompts: list[str], fault: str | None,
           args: argparse.Namespace, rng: random.Random, notes: Notes
           ) -> tuple[list[Answer], float]:
    """Send ``prompts`` at once through the proxy while ``fault`` is in effect; the answers and
    when the fault ended (monotonic)."""
    bodies = [completion_body(prompt, MAX_TOKENS, stream=rng.random() < 0.5)
              for prompt in prompts]

    def send() -> list[Answer]:
        url = deployment.proxy.url or ""
        if len(bodies) == 1:
            return [complete(url, bodies[0], timeout_s=args.timeout)]
        with ThreadPoolExecutor(len(bodies), thread_name_prefix="soak-request") as pool:
            return list(pool.map(lambda body: complete(url, body, timeout_s=args.timeout),
                                 bodies))

    if fault in ("failed_read", "slow_read", "lost_ack"):
        setting = {"failed_read": {"fail_reads": 2}, "slow_read": {"stall_reads_s": 0.3},
                   "lost_ack": {"drop_acks": 1}}[fault]
        deployment.faults_file.write_text(json.dumps(setting))
        time.sleep(0.3)  # the decode reads its fault file when it changes
        try:
            answers = send()
        finally:
            deployment.faults_file.write_text("{}")
        cleared = time.monotonic()
        time.sleep(0.3)
        return answers, cleared
    if fault == "bad_frames":
        answers = _alongside(send, lambda stop: _bad_frames(
            deployment.decode_control_endpoint(), stop))
        return answers, time.monotonic()
    if fault == "routing_id_takeover":
        answers = _alongside(send, lambda stop: keep_taking_over(
            deployment.decode_control_endpoint(), deployment.decode.log_path, notes.takeover,
            stop))
        return answers, time.monotonic()
    if fault == "shm_nearly_full":
        with filled(args.shm_remainder_kib * 1024) as left:
            notes.shm_left.append(left)
            answers = send()
        return answers, time.monotonic()
    if fault == "bad_notify":
        _bad_notify(deployment.proxy.url or "")
        return send(), time.monotonic()
    if fault == "master_killed":
        process = deployment.master._process
        assert process is not None
        process.send_signal(signal.SIGKILL)
        process.wait()
        deployment.master._cleanup()
        try:
            answers = send()
        finally:
            deployment.restart_master()
        return answers, time.monotonic()
    if fault == "master_frozen":
        pid = deployment.master.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            answers = send()
        finally:
            os.kill(pid, signal.SIGCONT)
        return answers, time.monotonic()
    if fault == "decode_killed":
        killer = threading.Timer(rng.uniform(0.05, 0.5), deployment.decode.kill)
        killer.start()
        try:
            answers = send()
        finally:
            killer.join()
            deployment.restart_decode()
        return answers, time.monotonic()
    if fault == "decode_tp_rank_killed":
        kill = TPRankKill(tp_rank=rng.randrange(1, deployment.tp), pid=0)
        kill.pid = tp_worker(deployment.decode.process.pid, kill.tp_rank)
        notes.tp_rank_kills.append(kill)
        killer = threading.Timer(rng.uniform(0.05, 0.5), _sigkill, args=(kill,))
        killer.start()
        try:
            answers = send()
        finally:
            killer.join()
            _watch_server(deployment.decode, kill)
            print(f"  decode TP rank {kill.tp_rank} (pid {kill.pid}) killed: {kill}; "
                  "restarting the decode", flush=True)
            deployment.restart_decode()
        return answers, time.monotonic()
    return send(), time.monotonic()


SERVER_EXIT_WAIT_S = 15.0
"""How long the soak waits for a decode that lost a TP rank to exit on its own."""


def _watch_server(server: Managed, kill: TPRankKill) -> None:
    """Record in ``kill`` what the decode's API server did after losing its rank."""
    kill.server_alive_after_batch = server.alive()
    started = time.monotonic()
    while server.alive() and time.monotonic() - started < SERVER_EXIT_WAIT_S:
        time.sleep(0.2)
    if server.alive():
        kill.health_ok_while_running = http_ok(f"{server.url}/health")
    else:
        kill.server_exited_after_s = round(time.monotonic() - started, 2)


def _sigkill(kill: TPRankKill) -> None:
    try:
        os.kill(kill.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    kill.killed = True


def _time_until_usable(deployment: Deployment, cleared: float, label: str,
                       reference: dict[str, tuple[int, ...]], args: argparse.Namespace,
                       probes: collections.Counter[str]) -> float | None:
    """Seconds from ``cleared`` until a probe request was served by the pair (see the module
    docstring); None when none was within ``--recovery-limit``. Counts each probe's outcome
    in ``probes`` (identical, recomputed, failed_cleanly, wrong, hung)."""
    limit = cleared + args.recovery_limit
    attempt = 0
    while time.monotonic() < limit:
        prompt = f"probe {label}.{attempt}: {PROBE_TEXT}"
        attempt += 1
        before = decode_stats(deployment.decode_stats_file).get("received", 0)
        timeout = min(args.timeout, max(5.0, limit - time.monotonic() + 5.0))
        answer = complete(deployment.proxy.url or "",
                          completion_body(prompt, MAX_TOKENS, stream=False), timeout_s=timeout)
        ended = time.monotonic()
        if not answer.ok:
            probes["hung" if answer.total_s >= timeout * 0.99 else "failed_cleanly"] += 1
            time.sleep(0.2)
            continue
        plain = complete(deployment.plain.url or "",
                         completion_body(prompt, MAX_TOKENS, stream=False),
                         timeout_s=args.timeout)
        assert plain.ok, plain.error
        reference[prompt] = plain.token_ids
        if answer.token_ids != plain.token_ids:
            probes["wrong"] += 1
            continue
        if not _pulled(deployment.decode_stats_file, before):
            probes["recomputed"] += 1
            time.sleep(0.2)
            continue
        probes["identical"] += 1
        return ended - cleared
    return None


def _pulled(stats_file: Path, before: int, wait_s: float = 3.0) -> bool:
    """Whether the decode's ``received`` counter rose above ``before`` (it is written after
    the step that counted the request, so wait a little)."""
    limit = time.monotonic() + wait_s
    while True:
        if decode_stats(stats_file).get("received", 0) > before:
            return True
        if time.monotonic() > limit:
            return False
        time.sleep(0.1)


def _alongside(send: Callable[[], _T], noise: Callable[[threading.Event], None]) -> _T:
    stop = threading.Event()
    thread = threading.Thread(target=noise, args=(stop,), daemon=True)
    thread.start()
    try:
        return send()
    finally:
        stop.set()
        thread.join(10)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The soak's arguments; a fault the deployment cannot inject is refused here, naming
    what it needs. ``skip_faults`` names each fault left out of the default draw and why."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--fault-rate", type=float, default=0.3)
    parser.add_argument("--max-decode-kills", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, choices=(1, 2), default=1,
                        help="TP of the decode (and of the prefill and plain reference); "
                             "2 needs 2 cores, one per worker")
    parser.add_argument("--max-tp-rank-kills", type=int, default=2,
                        help="how often decode_tp_rank_killed is drawn at most")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--concurrency", type=_positive, default=8,
                        help="requests in flight at once (each batch shares its fault)")
    parser.add_argument("--faults", nargs="+", choices=FAULTS,
                        help="the faults drawn from (default: all the deployment can inject)")
    parser.add_argument("--recovery-limit", type=float, default=120.0,
                        help="seconds after a fault within which the pair must serve again")
    parser.add_argument("--shm-mib", type=_positive, default=None,
                        help="size of the soak's private /dev/shm (tmpfs); default: what the "
                             "engines' TP needs, plus room for what each decode kill leaves "
                             "(kvo_tools.pd.shm_budget; 256 MiB at TP 1, 4906 at TP 2); "
                             "shm_nearly_full fills it, taking that much memory meanwhile")
    parser.add_argument("--shm-remainder-kib", type=int, default=16,
                        help="what shm_nearly_full leaves free in /dev/shm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.skip_faults = {}
    if args.decode_tp == 1:
        asked = [kind for kind in args.faults or () if kind in TP_ONLY_FAULTS]
        if asked:
            parser.error(f"--faults {' '.join(asked)} needs --decode-tp 2 (it kills a decode TP "
                         "worker other than rank 0), got --decode-tp 1")
        for kind in TP_ONLY_FAULTS:
            args.skip_faults[kind] = "needs --decode-tp 2 (the decode runs TP 1)"
    if args.faults is None:
        args.faults = [kind for kind in FAULTS if kind not in args.skip_faults]
    size_private_shm(parser, args)
    return args


def size_private_shm(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``args.shm_mib``: the default for the engines' TP, or the user's value if it is at
    least what they need (else a usage error naming the size needed and why)."""
    engines = dict.fromkeys(("plain", "prefill", "decode"), args.decode_tp)
    chunk_mib = shm_budget.mq_chunk_mib()
    needed = shm_budget.needed_mib(list(engines.values()), chunk_mib)
    if args.shm_mib is None:
        restarts = args.max_decode_kills + (args.max_tp_rank_kills if args.decode_tp > 1 else 0)
        args.shm_mib = shm_budget.default_mib(list(engines.values()), args.decode_tp, restarts,
                                              chunk_mib)
    elif args.shm_mib < needed:
        parser.error(f"--shm-mib {args.shm_mib} is too small for engines at --decode-tp "
                     f"{args.decode_tp}: they need at least {needed} MiB of /dev/shm "
                     f"({shm_budget.describe(engines, chunk_mib)})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    again = ["-m", "kvo_tools.soak", *(argv or sys.argv[1:])]
    reexec_in_namespace(again)
    problem = why_no_private_shm()
    if problem is None:
        reexec_with_private_shm(again, args.shm_mib)
    else:
        args.skip_faults["shm_nearly_full"] = f"no private /dev/shm: {problem}"
        print(f"shm_nearly_full left out: {problem}", flush=True)
    assert "shm_nearly_full" in args.skip_faults or private()
    result = run(args)
    print()
    print(f"{'requests':<28}{result['requests']:>6}")
    print(f"{'in flight at once':<28}{result['concurrency']:>6}")
    for kind in FAULTS:
        print(f"{'faults: ' + kind:<28}{result['faults'].get(kind, 0):>6}")
    for key in ("identical", "failed_cleanly", "wrong", "hung"):
        print(f"{'answers ' + key:<28}{result[key]:>6}")
    print(f"{'engines died on their own':<28}{result['crashes']:>6}")
    print(f"{'probes':<28}{result['probes']}")
    print(f"{'takeover':<28}{result['takeover']}")
    print(f"{'decode TP':<28}{result['decode_tp']:>6}")
    for kill in result["tp_rank_kills"]:
        print(f"{'decode TP rank killed':<28}{kill}")
    print()
    print(f"{'fault':<22}" + "".join(f"{key:>15}" for key in OUTCOMES)
          + f"{'worst unusable':>16}")
    for kind in ("none", *FAULTS):
        outcomes = result["by_fault"].get(kind, {})
        worst = result["worst_unusable_s"].get(kind)
        shown = f"{worst:.1f} s" if worst is not None else "-"
        if result["unrecovered"].get(kind):
            shown = f"> {args.recovery_limit:g} s"
        print(f"{kind:<22}" + "".join(f"{outcomes.get(key, 0):>15}" for key in OUTCOMES)
              + f"{shown:>16}")
    print()
    for moment in ("start", "end"):
        prints = result["footprints"].get(moment, {})
        for name, engine in prints.get("engines", {}).items():
            kinds = ", ".join(f"{kind} {engine.get(f'rss_{kind}_bytes', 0) / 2**20:.0f}"
                              for kind in ("anon", "file", "shmem"))
            print(f"{moment + ' ' + name:<28}RSS {engine['rss_bytes'] / 2**20:8.0f} MiB "
                  f"({kinds}), {len(engine['shm_files'])} /dev/shm files "
                  f"({engine['shm_bytes'] / 2**20:.0f} MiB)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    bad = (result["wrong"] + result["hung"] + result["crashes"]
           + sum(result["unrecovered"].values()) + result["probes"].get("wrong", 0)
           + result["probes"].get("hung", 0)
           + result["takeover"]["answered"]
           + sum(not kill["killed"] for kill in result["tp_rank_kills"]))
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
