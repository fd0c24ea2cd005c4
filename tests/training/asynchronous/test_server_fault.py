"""A launched rollout server killed under asynchronous rollouts (`rollout.max_staleness: 1`): the
groups sent to it go to the other server, the supervisor restarts it with its own command line
(docs/multinode.md, "Fault tolerance of the rollout servers"), it rejoins at a weight update and
serves again, as in the synchronous loop; every batch keeps the lag rule, the re-sent groups
included (the buffer checks each batch), and no prompt is lost or trained twice.

The servers: two paced stand-ins (tools/bench/paced_sglang_server.py) started by
`rollout.sglang.launch.start_process`, so that they can be restarted as launched servers are; the
engine: a real `SGLangEngine` over their handles with disk weight sync; the rest of the runtime:
tests/training/asynchronous/test_producer.py's fake (prompts, scorer, sampler).

Mutations tried: `ServerSupervisor.request` raising instead of re-sending on a failed server
(`mark_unhealthy` then `raise`): the producer's error reaches the trainer's take; the engine's
pause/continue posting to every server in use without taking a failed one out of use: the
weight update's pause raises on the dead server; `SGLangEngine.shutdown` leaving restarts on: the
requests in flight at shutdown fail and restart the servers again (2 restarts)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import pytest
import torch

from hapo_megatron.rollout.sglang.server_supervisor import IN_USE
from tests.rollout.sglang.engines import sglang_engine
from hapo_megatron.rollout.sglang.launch import free_port, start_process, stop_process
from hapo_megatron.training.asynchronous.producer import AsyncRollout
from tests.training.asynchronous.test_producer import B, N, _prompts, _rt, _sampler_order
from tests.training.tiny_setup import ROOT

PACED = os.path.join(ROOT, "tools", "bench", "paced_sglang_server.py")
MAX_STEPS = 200  # bound on the steps waited for the restarted server to serve again


def _start(rec_dir):
    port = free_port()
    handle = start_process([sys.executable, PACED, "--port", str(port), "--tokens-per-s", "40"],
                           f"http://127.0.0.1:{port}", log_path=os.path.join(rec_dir, f"{port}.log"),
                           env={**os.environ, "HAPO_TEST_STANDIN_DIR": rec_dir})
    return handle, port


def _log(rec_dir, port):
    with open(os.path.join(rec_dir, f"paced_{port}.jsonl")) as f:
        return [json.loads(line) for line in f]


def _step(ar, rt, engine):
    """Take a batch (lag checked), then the weight update inside the producer's pause."""
    kept, metrics, _, _ = ar.take_step(rt.rl.step + 1)
    assert metrics["rollout/staleness_max"] <= 1
    rt.rl.step += 1
    with ar.paused(rt.rl.step):
        engine.update_weights(iter([("w", torch.zeros(2))]), weight_version=rt.rl.step)
    return _prompts(kept), metrics


def _crash_on_next_generate(engine, handle) -> None:
    """Kill ``handle``'s server (SIGKILL, waited for) when its next ``/generate`` is sent."""
    http = engine.supervisor.http
    send, armed = http.request, threading.Lock()  # held once the crash happened (calls run in threads)

    def request(srv, path, body, **kw):
        if srv.url == handle.url and path == "/generate" and armed.acquire(blocking=False):
            http.request = send
            os.killpg(handle.process.pid, signal.SIGKILL)
            handle.process.wait()
        return send(srv, path, body, **kw)

    http.request = request


@pytest.mark.slow
def test_a_killed_launched_server_is_restarted_and_the_lag_holds(tmp_path):
    rec = str(tmp_path)
    (h0, _), (h1, p1) = _start(rec), _start(rec)
    engine = None
    try:
        engine = sglang_engine(server_urls=[h0, h1], weight_sync="disk", colocate=False,
                               disk_sync_dir=str(tmp_path / "sync"), max_retries=0, request_timeout_s=60)
        rt = _rt()
        rt.engine = engine
        engine.update_weights(iter([("w", torch.zeros(2))]), weight_version=0)  # trainer.fit's first sync
        ar = AsyncRollout(rt).start()
        try:
            got = [_step(ar, rt, engine)]
            # server 1 crashes as the next group is sent to it, which then fails over (killed at
            # once, the producer may have been idle and the update's pause found it dead first)
            _crash_on_next_generate(engine, h1)
            steps = 1
            while steps < MAX_STEPS:
                got.append(_step(ar, rt, engine))
                steps += 1
                restarted = [e for e in _log(rec, p1) if e["path"] == "start"][1:]
                served = [e for e in _log(rec, p1) if e["path"] == "/generate"
                          and restarted and e["start"] > restarted[0]["start"]]
                if engine.supervisor.state[1] == IN_USE and served:
                    got.append(_step(ar, rt, engine))  # one batch more with both servers
                    break
        finally:
            ar.close()
    finally:
        if engine is not None:
            engine.shutdown()
        for h in (h0, h1):
            stop_process(h)
    assert steps < MAX_STEPS, "the restarted server never served again"
    assert engine.supervisor.restarts == 1
    assert engine.fault_metrics()["rollout/requests_retried"] >= N  # a group's rows went to server 0
    assert all(m["rollout/staleness_max"] <= 1 for _, m in got)
    assert [p for g, _ in got for p in g] == _sampler_order(len(got) * B)  # none lost or repeated
    # it came back through a weight update (never with the start-up weights): every token it
    # generated since carries that update's version or a later one
    log = _log(rec, p1)
    back = next(int(e["version"]) for e in log if e["path"] == "/update_weights_from_disk"
                and e["start"] > restarted[0]["start"])
    versions = {int(s["version"]) for e in served for row in e["versions"] for s in row}
    assert back >= 2 and versions and min(versions) >= back
