"""Dynamic sampling that cannot fill the batch within `max_num_gen_batches` trains on the groups it
kept (fewer PPO mini-batches, so fewer optimizer steps), and the LR schedule counts exactly the
optimizer steps that ran."""

import math
import os

from tests.distributed import run_distributed
from tests.training.tiny_setup import ROOT, tiny_overrides, train_main

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")
BATCH, MINI, SFT = 8, 2, 3


def test_short_batches_train_on_what_was_kept_and_the_schedule_counts_real_steps(tiny, tmp_path):
    from hapo_megatron.training.checkpointing.checkpoint import read_rl_state
    from hapo_megatron.training.metrics.sinks import read_jsonl

    run_dir = str(tmp_path / "run")
    argv = ["--config", CONFIG, *tiny_overrides(tiny, run_dir, **{
        "parallel.tensor_model_parallel_size": 1, "data.train_batch_size": BATCH,
        "trainer.ppo_mini_batch_size": MINI, "trainer.sft_warmup_steps": SFT, "trainer.total_steps": 3,
        "trainer.save_interval": 3, "trainer.val_at_end": "false", "algo.filter_groups": "true",
        "algo.filter_groups_metric": "score", "algo.max_num_gen_batches": 1,
        "reward.reward_fn": "tests.training.parity_reward:score", "reward.overlong_buffer_enable": "false"})]
    assert run_distributed(train_main, 1, argv, timeout=600) == [0]
    recs = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "batch/num_groups" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        kept = int(r["batch/num_groups"])
        assert 0 < kept < BATCH, kept  # short, yet trained on
        assert r["actor/num_updates"] == math.ceil(kept / MINI)
        assert r["actor/skipped_updates"] == 0 and r["actor/consecutive_skips"] == 0
    ran = SFT + sum(int(r["actor/num_updates"]) for r in recs)
    assert ran < SFT + 3 * BATCH // MINI  # the short steps really ran fewer optimizer steps
    state = read_rl_state(os.path.join(run_dir, "checkpoints", "step_000003"))
    assert state["scheduler"]["num_steps"] == ran
