"""`algo.h_hat_mode: reference` reaches both places that read h_hat, through the real trainer.

Under the public code's sign (reference) every token below the pivot gets h_hat > 0, so nearly
every token is "high entropy" in the loss (signed: about 1 - entropy_pivot of them) and no
rollout token is sampled below T_base (signed: the low-entropy majority is sampled colder).
Dropping `h_hat_mode` on its way to the loss or to the sampler fails this test."""

import os

from tests.distributed import run_distributed
from tests.training.tiny_setup import ROOT, tiny_overrides, train_main

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")
T_BASE = 1.0


def test_reference_mode_reaches_rollout_temperatures_and_loss(tiny, tmp_path):
    from hapo_megatron.analysis import read_rollouts, rollout_path
    from hapo_megatron.training.metrics.sinks import read_jsonl

    run_dir = str(tmp_path / "run")
    argv = ["--config", CONFIG, *tiny_overrides(tiny, run_dir, **{
        "parallel.tensor_model_parallel_size": 1, "trainer.total_steps": 2, "trainer.save_interval": 0,
        "trainer.val_at_end": "false", "logging.save_rollouts_interval": 1, "rollout.temperature": T_BASE,
        "algo.h_hat_mode": "reference", "algo.temperature_tau": 0.5, "algo.entropy_pivot": 0.5})]
    assert run_distributed(train_main, 1, argv, timeout=600) == [0]
    recs = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "loss/high_entropy_frac" in r]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:  # signed mode with pivot 0.5 would give about 0.5
        assert r["loss/high_entropy_frac"] > 0.95, r["loss/high_entropy_frac"]
    # step 2 samples with step 1's statistics: reference-mode h_hat >= 0, so T >= T_base everywhere
    temps = [t for row in read_rollouts(rollout_path(run_dir, 2)) for t in row["temperatures"]]
    assert temps and min(temps) >= T_BASE * (1 - 1e-5), min(temps)
    assert sum(temps) / len(temps) > T_BASE * (1 + 1e-3)
