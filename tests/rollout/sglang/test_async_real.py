"""Asynchronous rollouts (`rollout.max_staleness: 1`) on the session's two REAL CPU SGLang servers
(tests/rollout/sglang/conftest.py; attached by URL, so `colocate: false`), the trainer in its own
process, disk weight sync.

- Every trained sample's lag is <= 1 on every batch (the buffer raises otherwise; the metrics
  say so per step), and some batch has lag 1: the servers' per-token weight versions reach the
  trainer.
- Generation for step k+1 overlaps step k's update, from the producer's timers: the time with
  a group in flight since the previous take (`timing/generation_busy_s`) exceeds the trainer's
  wait for the batch (`timing/trainer_wait_s`), so generation ran while the trainer trained.
- The reward rises: a reward the tiny random model learns in a few steps (the share of digits,
  tests/training/digit_reward.py, at a learning rate of 1e-2; the CPU example's math reward needs
  hundreds of warm-start steps first). Compared: the mean reward of the first three steps and of
  the last three (measured before this rate, at the example's 1e-3: -0.76 -> -0.71, too close to
  the step-to-step noise of 32 responses a step to assert on).
- `pause_mode: in_place` (the requests stay on the servers, with their KV cache, during the
  update): the run goes through. SGLang refuses to flush its cache while they run and fails the
  update; the engine then skips the flush (mutation: flush anyway -> the run fails with "cache
  was not flushed").
"""

import json
import os
import subprocess
import sys

import pytest

from hapo_megatron.rollout.sglang.api_key import API_KEY_ENV
from tests.training.tiny_setup import ROOT, tiny_overrides

pytestmark = pytest.mark.slow
STEPS = 12


def _train(real_model_dir, urls, key, run_dir, steps, **extra):
    data = os.path.dirname(real_model_dir)
    cmd = [sys.executable, "-m", "hapo_megatron.train", "--config", os.path.join(ROOT, "examples/cpu_tiny/config.yaml"),
           *tiny_overrides(data, run_dir, **{
               "trainer.total_steps": steps, "trainer.save_interval": 0, "trainer.sft_warmup_steps": 0,
               "trainer.val_at_end": "false", "data.val_files": "[]", "parallel.tensor_model_parallel_size": 1,
               "rollout.engine": "sglang", "rollout.sglang.server_urls": "[" + ",".join(urls) + "]",
               "rollout.sglang.colocate": "false", "rollout.sglang.weight_sync": "disk",
               "rollout.max_staleness": 1, "algo.rollout_is": "token_tis",
               "reward.reward_fn": "tests.training.digit_reward:score", "reward.num_workers": 0,
               "reward.overlong_buffer_enable": "false", "optim.lr": 1e-2, **extra})]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", API_KEY_ENV: key,
           "HAPO_SGLANG_SYNC_DIR": os.path.join(run_dir, "sync"),
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "rollout/reward_mean" in r]


def test_max_staleness_1_on_two_real_servers(real_server, second_real_server, real_api_key, real_model_dir,
                                             tmp_path):
    recs = _train(real_model_dir, [real_server.url, second_real_server.url], real_api_key, str(tmp_path / "run"),
                  STEPS)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    assert all(r["rollout/staleness_max"] <= 1 for r in recs)
    assert max(r["rollout/staleness_max"] for r in recs) == 1
    overlapped = sum(r["timing/generation_busy_s"] - r["timing/trainer_wait_s"] for r in recs[1:])
    print(f"generation in flight while the trainer trained: {overlapped:.1f} s over {STEPS - 1} steps; rewards "
          + " ".join(f"{r['rollout/reward_mean']:.2f}" for r in recs), flush=True)
    assert overlapped > 0
    first, last = (sum(r["rollout/reward_mean"] for r in part) / len(part) for part in (recs[:3], recs[-3:]))
    assert last > first, (first, last)


def test_pause_in_place_on_real_servers(real_server, second_real_server, real_api_key, real_model_dir, tmp_path):
    recs = _train(real_model_dir, [real_server.url, second_real_server.url], real_api_key, str(tmp_path / "run"), 4,
                  **{"rollout.sglang.pause_mode": "in_place"})
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(r["rollout/staleness_max"] <= 1 for r in recs)
