"""End to end: the tiny-MoE CPU job (examples/cpu_tiny_moe: Qwen3-MoE, expert parallelism 2 over
gloo, routing replay, a bf16 rollout engine) for a few steps with tiny settings: it trains, logs
the routing mismatch and the expert statistics every step, and checkpoints without
dist_checkpointing's common-state warning."""

from __future__ import annotations

import math
import os
import sys

import pytest

from hapo_megatron.training.metrics import read_jsonl
from tests.test_train_e2e import _run
from tests.training.tiny_setup import ROOT, prepare_tiny, tiny_overrides

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny_moe", "config.yaml")
pytestmark = pytest.mark.slow


def test_moe_cpu_job_runs_with_expert_parallelism_and_replay(tmp_path):
    data = prepare_tiny(str(tmp_path / "data"), 400, 8, "--arch", "qwen3_moe")
    run_dir = str(tmp_path / "run")
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "hapo_megatron.train", "--config", CONFIG,
                *tiny_overrides(data, run_dir, **{"trainer.total_steps": 2})])
    recs = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "rollout/reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert 0.0 <= r["rollout/routing_mismatch"] < 0.5, r["rollout/routing_mismatch"]  # counted, not NaN
        assert math.isfinite(r["actor/moe_aux_loss"]) and r["actor/moe_expert_load_max"] >= 1.0
    config = open(os.path.join(run_dir, "config.yaml")).read()
    assert "expert_model_parallel_size: 2" in config and "routing_replay: true" in config
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["latest", "step_000002"]
    assert "common state dict differs" not in out
