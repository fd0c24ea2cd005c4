"""Two REAL SGLang servers (the session's shared ones, on the loopback address):
the second is SIGKILLed, then SIGSTOPped, in the middle of a generation round. Every row is
answered (by the survivor, same sampling seeds), the lost server is restarted with its own
command line and API key, and it serves again only after the next weight sync, with the
current weights: its greedy output equals the survivor's and transformers' on those weights.
One failure past ``max_restarts`` (the restarted process dying during start-up) stops the
engine's weight sync with the reason (rollout/sglang/server_supervisor.py).

The recovery times are printed (``-s``) for the docs' figures."""

import os
import signal
import time

import pytest
import torch

from hapo_megatron.rollout.sglang import engine as se
from hapo_megatron.rollout.engine import SamplingParams
from hapo_megatron.rollout.sglang.server_supervisor import IN_USE, LOST, RESTARTING, ServerPoolError
from hapo_megatron.rollout.sglang.launch import stop_process

from .real_sglang import hf_greedy, hf_model
from tests.rollout.sglang.engines import sglang_engine

PROMPTS = [[1, 10 + p, 11, 12 + p] for p in range(12)]  # x n=2: 24 rows, 6 calls of 4 rows, 3 per server
SAMPLED = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=24, ignore_eos=True, seed=11)
GREEDY = SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_new_tokens=8, ignore_eos=True)
# request timeout: how long a stopped server may take to be found. A request of this test's tiny
# model takes well under a second even on a loaded 2-core machine.
TIMEOUT_S = 20.0
TRAINER_TIMEOUT_S = 60.0  # the trainer's requests (whole steps' rounds); its faults are SIGKILLs


def perturbed(model_dir, seed):
    """The tiny model's weights with noise (a policy the servers did not start with)."""
    g = torch.Generator().manual_seed(seed)
    state = hf_model(None, model_dir).state_dict()
    return [(n, t + 0.2 * t.std() * torch.randn(t.shape, generator=g)) for n, t in state.items()]


def wait_healthy(eng, handle):
    """Poll until the restarted server answers (bounded by its start-up timeout)."""
    eng.http.wait_healthy(handle, 900.0, poll_s=0.5)


def greedy_on(eng, i):
    """Greedy continuations of PROMPTS from server ``i`` alone."""
    body = se.generate_payload(PROMPTS, GREEDY)
    return [se.parse_generate_item(item)[0] for item in eng.http.request(eng.servers[i], "/generate", body)]


def generate_with_fault(eng, sig, handle, nth=2):
    """One sampled round in which ``sig`` hits ``handle``'s process group just before the ``nth``
    /generate call to it is sent (earlier calls answered: the middle of a round). Returns
    (samples, time of the signal)."""
    sent, calls, request = [], [], eng.http.request

    def faulty(server, path, *args, **kwargs):
        if server is handle and path == "/generate":
            calls.append(1)
            if len(calls) == nth:
                sent.append(time.monotonic())
                os.killpg(handle.process.pid, sig)
        return request(server, path, *args, **kwargs)

    eng.http.request = faulty
    try:
        return eng.generate(PROMPTS, SAMPLED), sent[0]
    finally:
        eng.http.request = request


def rows(out):
    return [(s.prompt_index, s.sample_index, list(s.response_ids), list(s.rollout_logprobs)) for g in out for s in g]


@pytest.mark.slow
def test_lost_servers_are_replaced_and_rejoin_with_the_current_weights(real_server, second_real_server, real_api_key,
                                                                        real_model_dir):
    second = second_real_server  # the pool's second server, launched with the first (tests/rollout/sglang/conftest.py)
    lines = []
    try:
        eng = sglang_engine(server_urls=[real_server, second], launch=False, colocate=True, weight_sync="tensor",
                              max_retries=0, request_timeout_s=TIMEOUT_S, send_sampling_seed=True,
                              requests_per_call=4, max_restarts=2, api_key=real_api_key, model_path=real_model_dir)
        eng.supervisor._log = lambda m: (lines.append(m), print(m, flush=True))
        eng.update_weights(iter(perturbed(real_model_dir, 1)))
        reference = rows(eng.generate(PROMPTS, SAMPLED))

        # SIGKILL in the middle of a round: every row is answered, the server restarted
        out, killed_at = generate_with_fault(eng, signal.SIGKILL, second)
        retried_rows = eng.fault_metrics()["rollout/requests_retried"]
        assert sorted((p, k) for p, k, _, _ in rows(out)) == sorted((p, k) for p, k, _, _ in reference)
        assert eng.supervisor.state[1] == RESTARTING and eng.fault_metrics()["rollout/server_restarts"] == 1
        assert retried_rows > 0
        print(f"SIGKILL: {retried_rows:.0f} rows retried", flush=True)
        assert eng.generate(PROMPTS, GREEDY) and eng.supervisor.state[1] == RESTARTING  # not before a sync
        wait_healthy(eng, second)
        healthy_after = time.monotonic() - killed_at
        current = perturbed(real_model_dir, 2)
        eng.update_weights(iter(current))
        back_after = time.monotonic() - killed_at
        assert eng.supervisor.state == {0: IN_USE, 1: IN_USE}
        print(f"SIGKILL: restarted server healthy {healthy_after:.1f} s after the kill, back in use after the "
              f"next sync at {back_after:.1f} s", flush=True)
        want = hf_greedy(hf_model(current, real_model_dir), PROMPTS, GREEDY.max_new_tokens)
        assert want != hf_greedy(hf_model(None, real_model_dir), PROMPTS, GREEDY.max_new_tokens)  # not vacuous
        assert greedy_on(eng, 1) == greedy_on(eng, 0) == want  # the replaced server has the current weights

        # SIGSTOP (a wedged server): found when its request times out, handled the same way
        out, stopped_at = generate_with_fault(eng, signal.SIGSTOP, second)
        found = next(t for t, i, st, _ in eng.supervisor.events if i == 1 and st == LOST and t > stopped_at)
        assert len(rows(out)) == len(reference) and eng.supervisor.state[1] == RESTARTING
        assert any(f"no answer within {TIMEOUT_S:g} s" in m for m in lines if "unhealthy" in m)
        assert eng.fault_metrics()["rollout/server_restarts"] == 2
        print(f"SIGSTOP: found {found - stopped_at:.1f} s after the stop (request timeout {TIMEOUT_S:g} s)",
              flush=True)

        # a third failure (the new process dies during start-up): past max_restarts=2 the sync stops
        # with the reason instead of going on
        os.killpg(second.process.pid, signal.SIGKILL)
        second.process.wait()
        with pytest.raises(ServerPoolError, match=r"after 2 restart\(s\): rollout.sglang.max_restarts=2 used up"):
            eng.update_weights(iter(current))
    finally:
        stop_process(second)


def _server_group(port: int) -> int:
    """Process group of the server listening on ``port`` (started by the trainer, in its own session)."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return os.getpgid(conn.pid)
    raise AssertionError(f"no process listens on port {port}")


@pytest.mark.slow
def test_trainer_goes_on_after_a_server_dies_and_stops_past_max_restarts(real_model_dir, tmp_path):
    """`hapo train` with two servers it launched itself (CPU, loopback, disk sync), max_restarts=1: server 1
    is SIGKILLed after checkpoint 1; every later step completes (its requests go to server 0), the
    restarted server is used again after a weight sync; killed a second time, the run stops with
    the reason and its latest checkpoint is intact."""
    import json
    import subprocess
    import sys
    import threading

    from hapo_megatron.rollout.sglang.launch import free_port
    from hapo_megatron.training.checkpointing.checkpoint import find_latest, read_rl_state
    from tests.training.tiny_setup import ROOT, tiny_overrides

    data, run_dir, port = os.path.dirname(real_model_dir), str(tmp_path / "run"), free_port()
    cmd = [sys.executable, "-m", "hapo_megatron.train", "--config", os.path.join(ROOT, "examples/cpu_tiny/config.yaml"),
           *tiny_overrides(data, run_dir, **{
               "trainer.total_steps": 1000, "trainer.save_interval": 1, "trainer.keep_last_k": 2,
               "parallel.tensor_model_parallel_size": 1, "rollout.engine": "sglang", "rollout.sglang.num_servers": 2,
               "rollout.sglang.colocate": "false", "rollout.sglang.weight_sync": "disk",  # 2 servers, 1 CPU rank
               "rollout.sglang.port_base": port, "rollout.sglang.max_restarts": 1,
               "rollout.sglang.request_timeout_s": TRAINER_TIMEOUT_S, "trainer.val_at_end": "false"})]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()

    def wait_for(what, cond):
        while not cond():
            assert proc.poll() is None, f"trainer exited while waiting for {what}:\n{''.join(out)[-4000:]}"
            subprocess.run(["sleep", "0.5"])

    try:
        first = os.path.join(run_dir, "checkpoints", "step_000001", "COMPLETE")
        wait_for("checkpoint 1", lambda: os.path.exists(first))
        os.killpg(_server_group(port + 1), signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for("the server back in use", lambda: any("is back in use" in line for line in out))
        back_after = time.monotonic() - killed_at
        ckpt_step = lambda: int(read_rl_state(find_latest(os.path.join(run_dir, "checkpoints")))["step"])  # noqa: E731
        recovered_at = ckpt_step()
        wait_for("a step generated on both servers again", lambda: ckpt_step() >= recovered_at + 2)
        os.killpg(_server_group(port + 1), signal.SIGKILL)
        proc.wait()  # a hang here is the failure being tested
        reader.join()
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in (port, port + 1):
            try:
                os.killpg(_server_group(p), signal.SIGKILL)  # only if the trainer left one behind
            except (AssertionError, ProcessLookupError):
                pass
    text = "".join(out)
    print(f"trainer: server 1 back in use {back_after:.1f} s after the SIGKILL", flush=True)
    assert proc.returncode == 1, text[-4000:]
    assert "hapo train: stopped: the SGLang rollout engine failed" in text, text[-4000:]
    assert "rollout.sglang.max_restarts=1 used up" in text and f"127.0.0.1:{port + 1}" in text
    assert "restarting SGLang server" in text and "is unhealthy" in text
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"step"' in line]
    steps = [r["step"] for r in records if "rollout/server_restarts" in r]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= recovered_at + 2  # every step, none skipped
    assert records[-1]["rollout/server_restarts"] == 1.0
    latest = find_latest(os.path.join(run_dir, "checkpoints"))
    assert latest is not None and int(read_rl_state(latest)["step"]) >= recovered_at + 2
