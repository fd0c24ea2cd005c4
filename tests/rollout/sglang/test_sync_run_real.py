"""The CPU example the user's way (docs/multinode.md, "Weight sync and server lifetime"): torchrun,
2 ranks (TP=2), two REAL CPU SGLang servers the trainer launches, ``colocate=false``,
``max_staleness=1`` with ``over_sampling: 2``, ``weight_sync: auto`` (-> distributed: gloo on CPU,
its store hosted by rank 0).

- The run finishes (it used to wait at the first sync until the 30-minute store timeout), the
  servers report the weight version of every sync so far (advancing with the steps) and hold
  trained weights (not the initial model's), and none of their processes is left after the run.
- A rank lost mid-run (SIGKILL of rank 1), the synchronous loop with its rollouts in the rollout
  manager process (``rollout.sync_producer: process``, with over-sampling): torchrun tears the job down, and no server
  process, nor the manager, is left 30 s after it exited. One launched server there: each server has a guard of its own
  (server_guard.py), so a second one would only double the start-up (most of the run's time).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from hapo_megatron.rollout.sglang.api_key import KEY_FILE_NAME, resolve_api_key
from hapo_megatron.rollout.sglang.client import SGLangHTTP, ServerHandle
from hapo_megatron.rollout.sglang.launch import free_port
from tests.rollout.sglang.real_sglang import hf_model, require_sglang
from tests.tools._load import load_tool
from tests.training.tiny_setup import ROOT, prepare_tiny, tiny_overrides

pytestmark = pytest.mark.slow
procs = load_tool("bench/procs")
GONE_WITHIN_S = 30.0  # the spec's bound: no launched server is left this long after its trainer
WEIGHT = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    require_sglang()
    return prepare_tiny(str(tmp_path_factory.mktemp("sync_run_data")), n_train=64, n_val=4)


class Run:
    """One torchrun job of the CPU example with launched servers, its output read as it comes."""

    def __init__(self, data: str, run_dir: str, steps: int, servers: int = 2, extra: dict | None = None):
        self.run_dir, self.port, self.num_servers = run_dir, free_port(), servers
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "hapo_megatron.train", "--config", os.path.join(ROOT, "examples/cpu_tiny/config.yaml"),
               *tiny_overrides(data, run_dir, **{
                   "rollout.engine": "sglang", "rollout.sglang.num_servers": servers,
                   "rollout.sglang.colocate": "false",
                   "rollout.max_staleness": 1, "rollout.sglang.port_base": self.port,
                   "trainer.total_steps": steps, "trainer.sft_warmup_steps": 0, "trainer.save_interval": 0,
                   "trainer.val_at_end": "false", "data.val_files": "[]", **(extra or {})})]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.out: list[str] = []
        self.reader = threading.Thread(target=lambda: self.out.extend(iter(self.proc.stdout.readline, "")),
                                       daemon=True)
        self.reader.start()

    def text(self) -> str:
        return "".join(self.out)

    def records(self) -> list[dict]:
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [r for r in map(json.loads, f) if "rollout/reward_mean" in r]

    def steps(self) -> list[int]:
        return [r["step"] for r in self.records()]

    def wait_for(self, what: str, cond) -> None:
        while not cond():
            assert self.proc.poll() is None, f"the run exited while waiting for {what}:\n{self.text()[-5000:]}"
            subprocess.run(["sleep", "0.5"])

    def servers(self) -> list[ServerHandle]:
        return [ServerHandle(f"http://127.0.0.1:{self.port + i}") for i in range(self.num_servers)]

    def server_processes(self) -> list:
        """Every process of the servers' groups (the servers, their SGLang subprocesses, watchers)."""
        import psutil
        found = []
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and self.port <= conn.laddr.port < self.port + self.num_servers \
                    and conn.pid:
                found += procs.group_processes(os.getpgid(conn.pid))
        return found

    def close(self) -> None:
        if self.proc.poll() is None:
            procs.kill_tree(self.proc)
        self.reader.join()


def _state(http: SGLangHTTP, server: ServerHandle) -> tuple[int, torch.Tensor]:
    """(the server's weight version, the first rows of WEIGHT)."""
    version = http.request(server, "/model_info", None, method="GET")["weight_version"]
    rows = http.request(server, "/get_weights_by_name", {"name": WEIGHT, "truncate_size": 100})
    return int(version), torch.tensor(rows, dtype=torch.float32)


def test_distributed_sync_on_launched_servers_finishes_and_leaves_no_server(tiny, tmp_path):
    # over-sampling under asynchronous rollouts (docs/architecture.md): batches of the groups that
    # finish first, on the same servers
    run = Run(tiny, str(tmp_path / "run"), steps=3, extra={"rollout.over_sampling": 2.0})
    try:
        run.wait_for("step 1", lambda: len(run.steps()) >= 1)
        group = run.server_processes()
        key = resolve_api_key(os.path.join(run.run_dir, KEY_FILE_NAME), create=False)
        http = SGLangHTTP(timeout_s=300, max_retries=0, api_key=key)
        first = [_state(http, s) for s in run.servers()]
        run.wait_for("step 2", lambda: len(run.steps()) >= 2)
        second = [_state(http, s) for s in run.servers()]
        run.proc.wait()  # a hang here is the failure being tested
    finally:
        run.close()
    assert run.proc.returncode == 0, run.text()[-5000:]
    assert run.steps() == [1, 2, 3]
    assert all("rollout/passed_over_groups" in r for r in run.records())
    initial = hf_model(None, os.path.join(tiny, "model")).state_dict()[WEIGHT][:100]
    # each step's sync (after its update, before its metrics line) tags the servers with the step
    assert all(v >= 1 for v, _ in first) and all(v >= 2 for v, _ in second), (first, second)
    assert all(w.shape == initial.shape and not torch.equal(w, initial) for _, w in first + second)
    assert len(group) >= 2 and procs.survivors(group, GONE_WITHIN_S) == []


def test_a_rank_lost_mid_run_leaves_no_server(tiny, tmp_path):
    """The synchronous loop with its rollouts in the rollout manager process
    (``rollout.sync_producer: process``): the steps' batches come through it, and neither a
    server nor the manager outlives the job."""
    import psutil
    run = Run(tiny, str(tmp_path / "run"), steps=1000, servers=1,  # over-sampling: its pool goes through it
              extra={"rollout.max_staleness": 0, "rollout.sync_producer": "process", "rollout.over_sampling": 1.5})
    try:
        run.wait_for("step 1", lambda: len(run.steps()) >= 1)
        group = run.server_processes()
        ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(run.proc.pid).children()}
        managers = [p for p in ranks[0].children() if "multiprocessing" in " ".join(p.cmdline())]
        ranks[1].send_signal(signal.SIGKILL)
        run.proc.wait()  # torchrun ends the other rank; a hang here is a failure
    finally:
        run.close()
    assert run.proc.returncode != 0
    assert "timing/manager_transport_s" in run.records()[0]  # step 1's batch came from the manager
    assert "rollout/partial_groups" in run.records()[0]  # ... by over-sampling's rollout
    assert managers and procs.survivors(managers, GONE_WITHIN_S) == []  # the manager (and reward workers)
    assert len(group) >= 2 and procs.survivors(group, GONE_WITHIN_S) == [], run.text()[-3000:]
