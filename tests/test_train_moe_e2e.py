"""End to end: the tiny-MoE CPU job (examples/cpu_tiny_moe: Qwen3-MoE, expert parallelism 2 over
gloo, routing replay, a bf16 rollout engine) for a few steps with tiny settings: it trains, logs
the routing mismatch and the expert statistics every step, and checkpoints without
dist_checkpointing's common-state warning.

A token budget of 114 and 9 sequences per PPO mini-batch (3 prompts x 3 responses, about 60 tokens
each: one per micro-batch) give the two ranks 5 and 4 micro-batches: every MoE layer's dispatch is
a collective over both, so the job completes only with the fillers that even the counts
(docs/moe.md, "Micro-batch counts"); the warm start's plan is uneven too. A second, shorter run
packs the same job's sequences (the MoE layer spec's CPU per-sequence attention).
Without the fillers this job hangs in its warm start (tried with the budget alone, before they
existed); `_run`'s timeout would fail the test."""

from __future__ import annotations

import math
import os
import sys

import pytest

from hapo_megatron.training.metrics.sinks import read_jsonl
from tests.test_train_e2e import _run
from tests.training.tiny_setup import ROOT, prepare_tiny, tiny_overrides

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny_moe", "config.yaml")
pytestmark = pytest.mark.slow
UNEVEN = {"data.train_batch_size": 6, "rollout.n": 3, "trainer.ppo_mini_batch_size": 3,
          "parallel.max_tokens_per_micro_batch": 114}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_tiny(str(tmp_path_factory.mktemp("data")), 400, 8, "--arch", "qwen3_moe")


def _train(data, run_dir, **over):
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 "-m", "hapo_megatron.train", "--config", CONFIG, *tiny_overrides(data, run_dir, **over)])


def _steps(run_dir):
    return [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "rollout/reward_mean" in r]


def test_moe_cpu_job_runs_with_expert_parallelism_replay_and_uneven_micro_batches(data, tmp_path):
    run_dir = str(tmp_path / "run")
    out = _train(data, run_dir, **{"trainer.total_steps": 2, **UNEVEN})
    recs = _steps(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert 0.0 <= r["rollout/routing_mismatch"] < 0.5, r["rollout/routing_mismatch"]  # counted, not NaN
        assert math.isfinite(r["actor/moe_aux_loss"]) and r["actor/moe_expert_load_max"] >= 1.0
        assert r["perf/filler_micro_batches"] >= 2  # two 9-sequence mini-batches: 5 and 4 micro-batches
        assert math.isfinite(r["actor/grad_norm"]) and r["actor/skipped_updates"] == 0
    config = open(os.path.join(run_dir, "config.yaml")).read()
    assert "expert_model_parallel_size: 2" in config and "routing_replay: true" in config
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["latest", "step_000002"]
    assert "common state dict differs" not in out


def test_moe_cpu_job_runs_packed(data, tmp_path):
    run_dir = str(tmp_path / "packed")
    _train(data, run_dir, **{"trainer.total_steps": 1, "trainer.save_interval": 10, "trainer.val_at_end": "false",
                             "parallel.pack_sequences": "true", **UNEVEN})
    (rec,) = _steps(run_dir)
    assert 0.0 <= rec["rollout/routing_mismatch"] < 0.5
    assert math.isfinite(rec["actor/moe_aux_loss"]) and rec["actor/moe_expert_load_max"] >= 1.0
    assert math.isfinite(rec["actor/grad_norm"]) and rec["actor/skipped_updates"] == 0
