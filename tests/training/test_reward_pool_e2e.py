"""The CPU training job completes with a reward that sleeps, hangs, gets stuck, raises and kills
its worker process (tests/training/misbehaving_reward.py, by dotted path, in reward workers), and
the step metrics count every failed response: reward/timeouts = hung + stuck calls,
reward/errors = raising + killing calls, as the reward's own call log records them."""

import os

import pytest

from tests.distributed import run_distributed
from tests.training.misbehaving_reward import read_calls
from tests.training.tiny_setup import ROOT, tiny_overrides, train_main

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")


@pytest.mark.slow
def test_training_completes_and_counts_reward_failures(tiny, tmp_path):
    from hapo_megatron.training.metrics.sinks import read_jsonl

    run_dir, log_dir = str(tmp_path / "run"), tmp_path / "calls"
    log_dir.mkdir()
    argv = ["--config", CONFIG, *tiny_overrides(tiny, run_dir, **{
        "parallel.tensor_model_parallel_size": 1, "trainer.total_steps": 2, "trainer.sft_warmup_steps": 0,
        "trainer.save_interval": 100, "trainer.val_at_end": "false", "rollout.n": 2,
        "reward.reward_fn": "tests.training.misbehaving_reward:score", "reward.num_workers": 2,
        "reward.timeout_s": 0.5, "reward.reward_kwargs": f"{{log_dir: {log_dir}}}",
        "reward.overlong_buffer_enable": "false"})]
    assert run_distributed(train_main, 1, argv, timeout=600) == [0]
    recs = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "reward/timeouts" in r]
    assert [r["step"] for r in recs] == [1, 2]
    calls = read_calls(str(log_dir))
    assert len(calls) == sum(r["rollout/num_sequences"] for r in recs)  # every response scored once
    assert {"hang", "stuck", "raise", "kill"} <= set(calls)  # each misbehaviour happened
    assert sum(r["reward/timeouts"] for r in recs) == calls.count("hang") + calls.count("stuck")
    assert sum(r["reward/errors"] for r in recs) == calls.count("raise") + calls.count("kill")
    assert all(r["timing/reward_wait_s"] >= 0 for r in recs)
