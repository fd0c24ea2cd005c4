"""`hapo train` and a run directory's records (training/run_records.py): a finished run re-run does
nothing and says how to extend it; a fresh start moves the earlier run's records aside before it
writes its own config.yaml. No model is built: what is tested happens before training."""

from __future__ import annotations

import os

import pytest

from hapo_megatron.config import load_config, save_config
from hapo_megatron.refusal import NOTHING_TO_DO
from hapo_megatron.train import main
from hapo_megatron.training.run_records import PREVIOUS, write_json_atomic
from tests.training.tiny_setup import ROOT, tiny_overrides

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")
TP1 = {"parallel.tensor_model_parallel_size": 1}


def _argv(tiny, run, *extra):
    return ["--config", CONFIG, *tiny_overrides(tiny, str(run), **TP1), *extra]


def _snapshot(run):
    return {os.path.relpath(os.path.join(d, f), run): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(run) for f in files}


@pytest.fixture
def finished(tiny, tmp_path, monkeypatch):
    """A run dir as a finished 4-step run leaves it (the final checkpoint's marker and RL state,
    its metrics, summary and config); training must not start from here (`_init_distributed` fails
    the test if reached)."""
    import hapo_megatron.train as train

    def no_training(*_):
        raise AssertionError("hapo train went past its checks")
    monkeypatch.setattr(train, "_init_distributed", no_training)
    run = tmp_path / "run"
    save_config(load_config(CONFIG, tiny_overrides(tiny, str(run), **TP1)), str(run / "config.yaml"))
    step = run / "checkpoints" / "step_000004"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("")
    (step / "rl_state.json").write_text('{"step": 4}')
    (run / "checkpoints" / "latest").write_text("step_000004\n")
    (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "rollout/reward_mean": 0.{s}}}\n'
                                               for s in (1, 2, 3, 4)))
    write_json_atomic(str(run / "summary.json"), {"steps": 4, "wall_time_s": 292.0, "sft_time_s": 60.0,
                                                  "eval_start": {"eval/arithmetic_val/avg@2": 0.5}})
    return run


def test_a_finished_run_rerun_does_nothing_and_says_how_to_extend_it(tiny, finished, capsys):
    """Mutation: without the check_not_finished call in train.preflight the run goes on (here:
    past `_init_distributed`), rewriting its summary and logging its last step again."""
    before = _snapshot(finished)
    assert main(_argv(tiny, finished)) == 0
    out = capsys.readouterr().out
    assert "is finished" in out and "trainer.total_steps=N" in out and "--resume none" in out, out
    assert _snapshot(finished) == before
    # the launcher's check says the same, with its own exit code (the script then exits 0)
    assert main(_argv(tiny, finished, "--check")) == NOTHING_TO_DO
    assert "is finished" in capsys.readouterr().out
    # a larger trainer.total_steps goes on (the check passes)
    assert main(_argv(tiny, finished, "--check", "trainer.total_steps=6")) == 0
    assert _snapshot(finished) == before


def test_a_fresh_start_moves_the_records_before_writing_its_config(tiny, finished, monkeypatch, capsys):
    """`--resume none` on a finished run: every record of it goes to one dated folder and the new
    config.yaml is written after (mutation: saving the config before `start_records` moves the new
    config aside too; the old `start_fresh` left config.yaml and summary.json in place)."""
    import hapo_megatron.train as train
    import hapo_megatron.training.trainer as trainer
    before = _snapshot(finished)
    monkeypatch.setattr(train, "_init_distributed", lambda *_: None)  # one process: no group needed here
    seen = {}

    def fit_stand_in(cfg, **_):  # what the trainer would find in the run dir when it starts
        seen["files"] = sorted(os.listdir(cfg.trainer.run_dir))
        return {}
    monkeypatch.setattr(trainer, "fit", fit_stand_in)
    assert main(_argv(tiny, finished, "--resume", "none")) == 0
    assert seen["files"] == ["config.yaml", PREVIOUS]
    (moved,) = os.listdir(finished / PREVIOUS)
    assert _snapshot(finished / PREVIOUS / moved) == before
    assert f"moved to {finished / PREVIOUS / moved}" in capsys.readouterr().out


def test_attached_servers_keep_their_logs_at_a_fresh_start(tmp_path):
    """Servers started by a recipe's launch_servers.sh into the run dir (the async recipe's shared
    dir) log into its sglang_logs before the trainer starts: a fresh start leaves them there (they
    are this run's and still open); with servers the trainer launches they are the earlier run's
    and move aside (mutation: no `keep` -> the live logs end up under previous/)."""
    from hapo_megatron.train import start_records

    for attached, kept in ((True, True), (False, False)):
        run = tmp_path / f"run_{attached}"
        (run / "sglang_logs").mkdir(parents=True)
        (run / "sglang_logs" / "sglang_server_0.log").write_text("live\n")
        (run / "metrics.jsonl").write_text('{"step": 1}\n')  # an earlier run's record: moved either way
        sglang = ["rollout.engine=sglang", "rollout.sglang.colocate=false", f"trainer.run_dir={run}"]
        cfg = load_config(overrides=sglang + (["rollout.sglang.server_urls=[http://127.0.0.1:1]"] if attached else []))
        start_records(cfg)
        assert (run / "sglang_logs" / "sglang_server_0.log").exists() == kept
        assert not (run / "metrics.jsonl").exists() and os.listdir(run / PREVIOUS)
