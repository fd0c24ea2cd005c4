"""A stop signal in the middle of a long rollout (docs/troubleshooting.md, "Preemption"): the
trainer gives the step's rollout up (the SGLang engine aborts the requests it waits on), saves the
last finished step and exits with EXIT_STOPPED, instead of waiting for the round to end.

The rollout server is tests/rollout/sglang/standin_sglang_server.py: it answers step 1's /generate, holds
step 2's until an /abort_request arrives and, when it starts holding, sends SIGUSR1 to the trainer
(SLURM's `--signal=USR1@600`). Without the abort (mutation: `stop_check` never set on the engine in
stages._engine_stop_check) no abort is sent and the request stays held until the stand-in's
bound (HAPO_TEST_STANDIN_HOLD_BOUND_S, 600 s; the GPU recipes' round can take as long), after which
the old safe point saves: tried with the bound at 15 s, the test fails on the missing abort.
"""

import json
import os
import subprocess
import sys

from hapo_megatron.rollout.sglang.launch import free_port, start_process, stop_process
from hapo_megatron.rollout.sglang.client import SGLangHTTP
from hapo_megatron.training.checkpointing.checkpoint import find_latest, read_rl_state
from hapo_megatron.training.checkpointing.preemption import EXIT_STOPPED
from tests.training.tiny_setup import ROOT, tiny_overrides

STANDIN = os.path.join(ROOT, "tests", "rollout", "sglang", "standin_sglang_server.py")


def test_signal_during_a_held_generation_round_saves_the_last_step(tiny, tmp_path):
    vocab = json.load(open(os.path.join(tiny, "model", "config.json")))["vocab_size"]
    pid_file = tmp_path / "trainer.pid"
    port = free_port()
    env = {**os.environ, "HAPO_TEST_STANDIN_DIR": str(tmp_path), "HAPO_TEST_STANDIN_VOCAB": str(vocab),
           "HAPO_TEST_STANDIN_HOLD_AFTER": "1", "HAPO_TEST_STANDIN_SIGNAL_PID_FILE": str(pid_file),
           "HAPO_TEST_STANDIN_HOLD_BOUND_S": os.environ.get("HAPO_TEST_STANDIN_HOLD_BOUND_S", "600")}
    server = start_process([sys.executable, STANDIN, "--host", "127.0.0.1", "--port", str(port)],
                           f"http://127.0.0.1:{port}", log_path=str(tmp_path / "server.log"), env=env)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hapo_megatron.train", "--config", os.path.join(ROOT, "examples/cpu_tiny/config.yaml"),
           *tiny_overrides(tiny, str(run_dir), **{
               "parallel.tensor_model_parallel_size": 1, "rollout.engine": "sglang",
               "rollout.sglang.server_urls": f"[{server.url}]", "rollout.sglang.max_retries": 0,
               "rollout.sglang.weight_sync": "disk", "rollout.sglang.colocate": "false",
               "trainer.save_interval": 10, "trainer.val_at_end": "false", "trainer.exit_grace_s": 300})]
    train_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                 "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    try:
        SGLangHTTP(timeout_s=30, max_retries=3).wait_healthy(server, 120.0)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=train_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        pid_file.write_text(str(proc.pid))
        out, _ = proc.communicate()
    finally:
        stop_process(server)
    record = [json.loads(line) for line in open(tmp_path / f"server_{port}.jsonl")]
    paths = [r["path"] for r in record]
    assert "held" in paths, out[-4000:]  # the signal came during step 2's rollout
    assert proc.returncode == EXIT_STOPPED, out[-4000:]
    assert "/abort_request" in paths, paths
    assert "stopping: SIGUSR1 received; step 1 is saved in" in out, out[-4000:]
    latest = find_latest(str(run_dir / "checkpoints"))
    assert latest is not None and latest.endswith("step_000001") and int(read_rl_state(latest)["step"]) == 1
