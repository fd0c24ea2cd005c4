"""The step-wide selections through the real trainer (docs/algorithm.md, "Forking tokens",
"Clip-Cov and KL-Cov"): the trainer computes the forking threshold and the Clip-Cov statistics once
per step from its real micro-batches (old entropies, sequence indices, positions) and the loss
reports what it selected. One run for both, to keep the suite's time (the objectives' math and
layouts are tested without the trainer), on two pipeline stages with EDGE-GRPO's entropy-driven
advantage: the step-wide metrics computed on the last stage (`cov/*`, `adv/edge_eda_*`) reach the
logger of rank 0, on the first."""

import math
import os

import pytest

from tests.distributed import run_distributed
from tests.training.tiny_setup import ROOT, tiny_overrides, train_main

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")

SWITCHES = {"algo.forking_tokens": "true", "algo.forking_rho": 0.3, "algo.policy_loss": "clip_cov",
            "algo.clip_cov_ratio": 0.05, "algo.clip_cov_lb": 0.0, "algo.clip_cov_ub": 100.0,
            "algo.edge_eda": "true"}


@pytest.mark.slow
def test_forking_tokens_and_clip_cov_through_the_trainer(tiny, tmp_path):
    from hapo_megatron.training.metrics.sinks import read_jsonl

    run_dir = str(tmp_path / "run")
    argv = ["--config", CONFIG, *tiny_overrides(tiny, run_dir, **{
        "parallel.tensor_model_parallel_size": 1, "parallel.pipeline_model_parallel_size": 2,
        "trainer.total_steps": 2, "trainer.save_interval": 0,
        "trainer.sft_warmup_steps": 0, "trainer.val_at_end": "false", **SWITCHES})]
    assert run_distributed(train_main, 2, argv, timeout=600) == [0, 0]
    recs = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "loss/num_tokens" in r]
    assert [r["step"] for r in recs] == [1, 2], recs
    for r in recs:
        # ceil(0.3 n) of the step's tokens (ties aside), the update's share of them about the same
        assert 0.25 < r["loss/selected_frac"] < 0.4, r["loss/selected_frac"]
        assert r["loss/selected_entropy"] > r["loss/unselected_entropy"]
        assert 0 < r["loss/cov_selected_frac"] <= 0.1, r["loss/cov_selected_frac"]
        cov = [r[f"cov/{q}"] for q in ("p1", "p10", "p50", "p90", "p99", "max")]
        assert cov == sorted(cov) and cov[0] < cov[-1] and math.isfinite(r["cov/mean"]), r
        assert 0 < r["adv/edge_eda_scale_min"] <= r["adv/edge_eda_scale_mean"] <= r["adv/edge_eda_scale_max"], r
