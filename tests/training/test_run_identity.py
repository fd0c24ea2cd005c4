"""A changed algorithm on an existing run directory is refused at start (config/run_identity.py;
docs/troubleshooting.md, "Preemption"), naming the fields, unless `--resume none` or
`--allow-config-change`; harmless changes (steps, intervals, logging, layout) resume as before."""

import os

import pytest

from hapo_megatron.config import load_config, save_config
from hapo_megatron.config.run_identity import ConfigChangeError, algorithm_changes, is_algorithm_field
from hapo_megatron.train import main, preflight
from tests.training.tiny_setup import ROOT, tiny_overrides

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")
TP1 = {"parallel.tensor_model_parallel_size": 1}


def _config(tiny, run_dir, *extra, preset=None):
    return load_config(CONFIG, tiny_overrides(tiny, str(run_dir), **TP1) + list(extra), preset=preset)


@pytest.fixture
def run_dir(tiny, tmp_path):
    """A HAPO run that saved its config and one complete checkpoint (the marker is what resume
    looks for; nothing here loads it)."""
    run = tmp_path / "run"
    save_config(_config(tiny, run), str(run / "config.yaml"))
    step = run / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    return run


def test_preset_switch_is_refused_naming_the_fields(tiny, run_dir, capsys):
    """`--preset dapo` on a HAPO run directory stops with code 2 before any work (mutation: the
    check_same_algorithm call removed from train.preflight resumes the HAPO checkpoint as DAPO)."""
    argv = ["--config", CONFIG, "--preset", "dapo", *tiny_overrides(tiny, str(run_dir), **TP1)]
    before = (run_dir / "config.yaml").read_text()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "another algorithm" in err and "algo.adv_estimator: 'hapo' -> 'grpo'" in err, err
    assert "algo.clip_ratio_high: 0.2 -> 0.28" in err and "--allow-config-change" in err
    assert (run_dir / "config.yaml").read_text() == before, "the saved config was overwritten"


def test_override_flag_and_fresh_start_accept_the_change(tiny, run_dir):
    with pytest.raises(ConfigChangeError, match="optim.weight_decay: "):
        preflight(_config(tiny, run_dir, "optim.weight_decay=0.05"), 1)
    with pytest.warns(UserWarning, match="optim.weight_decay: "):
        preflight(_config(tiny, run_dir, "optim.weight_decay=0.05"), 1, allow_config_change=True)
    preflight(_config(tiny, run_dir, "optim.weight_decay=0.05", "trainer.resume=none"), 1)


def test_no_checkpoint_yet_compares_nothing(tiny, run_dir):
    """A run that saved its config but no checkpoint (stopped at start) may be corrected freely."""
    (run_dir / "checkpoints" / "step_000002" / "COMPLETE").unlink()
    preflight(_config(tiny, run_dir, preset="dapo"), 1)


def test_harmless_changes_resume(tiny, run_dir):
    """More steps, other intervals, logging, evaluation, engine sizing and layout are the same run
    (mutation: counting trainer.* or parallel.* as the algorithm refuses this)."""
    preflight(_config(tiny, run_dir, "trainer.total_steps=40", "trainer.save_interval=5", "trainer.eval_interval=3",
                      "logging.console=true", "parallel.max_tokens_per_micro_batch=4096",
                      "trainer.exit_after_minutes=30", "rollout.val_n=4", "reward.num_workers=0"), 1)


def test_which_fields_are_the_algorithm():
    for name in ("algo.adv_estimator", "algo.temperature_tau", "reward.reward_fn", "reward.overlong_buffer_len",
                 "model.hf_model_path", "model.max_position_embeddings", "optim.lr", "rollout.n",
                 "rollout.temperature", "data.train_batch_size", "trainer.ppo_mini_batch_size"):
        assert is_algorithm_field(name), name
    for name in ("trainer.total_steps", "trainer.run_dir", "trainer.save_interval", "logging.wandb",
                 "parallel.tensor_model_parallel_size", "rollout.engine", "rollout.sglang.num_servers",
                 "reward.num_workers", "data.train_files", "model.use_te", "model.megatron_load_path"):
        assert not is_algorithm_field(name), name


def test_the_same_hub_snapshot_in_another_cache_is_the_same_model():
    a = {"model": {"hf_model_path": "/home/a/.cache/huggingface/hub/models--Qwen--Qwen2.5-Math-7B/snapshots/abc"}}
    b = {"model": {"hf_model_path": "/scratch/hf/hub/models--Qwen--Qwen2.5-Math-7B/snapshots/abc/"}}
    c = {"model": {"hf_model_path": "/scratch/hf/hub/models--Qwen--Qwen2.5-Math-1.5B/snapshots/abc"}}
    assert algorithm_changes(a, b) == []
    assert algorithm_changes(a, c) and "model.hf_model_path" in algorithm_changes(a, c)[0]
