"""End to end: the tiny CPU job with `rollout.max_staleness: 1` (the producer in the rollout
manager process, the default) on two paced stand-in servers, the manager SIGKILLed as step 3
starts to take its batch (tests/training/preempt_hook.py, ``kill_manager``): the trainer does not
hang; it ends with exit code 1, one line naming the manager and its exit code, and step 2 saved;
no manager process is left behind (trainer.save_interval 0: the checkpoint is the stop's)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hapo_megatron.training.checkpointing.checkpoint import step_dir_name
from tests.tools._load import load_tool
from tests.training.tiny_setup import ROOT, prepare_tiny

pytestmark = pytest.mark.slow
bench = load_tool("bench/async_rollout")
KILL_STEP = 3


def test_a_killed_manager_ends_the_run_with_one_line_and_the_last_step_saved(tmp_path):
    data = prepare_tiny(str(tmp_path / "data"), 40, 2)
    rec, run_dir = str(tmp_path / "servers"), str(tmp_path / "run")
    os.makedirs(rec)
    procs, urls = bench.start_servers(2, 10.0, rec)
    try:
        over = bench.job_overrides(data, run_dir, urls, max_staleness=1, steps=5, batch=2, n=2, response_length=4)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
               "HAPO_SGLANG_SYNC_DIR": os.path.join(run_dir, "sync"), "HAPO_TEST_HOLD_STAGE": "kill_manager",
               "HAPO_TEST_HOLD_STEP": str(KILL_STEP), "HAPO_TEST_MARKER_DIR": rec}
        proc = subprocess.run([sys.executable, "-m", "tests.training.preempt_hook", "--config", bench.CONFIG, *over],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    finally:
        bench.stop_servers(procs)
    with open(os.path.join(rec, f"killed.manager.step{KILL_STEP}")) as f:
        pid = int(f.read())
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("hapo train: stopped early")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert f"the rollout manager process (pid {pid}) exited with code -9" in lines[0]
    assert f"stopped after step {KILL_STEP - 1}" in lines[0] and "saved in" in lines[0]
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", step_dir_name(KILL_STEP - 1)))
    assert not os.path.isdir(os.path.join(run_dir, "checkpoints", step_dir_name(KILL_STEP)))
    with pytest.raises(ProcessLookupError):  # reaped, not left behind
        os.kill(pid, 0)
