"""Metric sinks: JSONL records, TensorBoard and wandb (offline) files, Timer. (What a resume does to
metrics.jsonl: tests/training/test_run_records.py.)"""

import glob
import math
import os
import time

from hapo_megatron.config import LoggingConfig
from hapo_megatron.training.metrics.sinks import MetricsLogger, Timer, read_jsonl, strip_timing


def test_jsonl_console_tensorboard_wandb(tmp_path, capsys):
    run = str(tmp_path)
    sinks = LoggingConfig(console=True, jsonl=True, tensorboard=True, wandb=True, wandb_mode="offline",
                          wandb_run_name="t")
    log = MetricsLogger(sinks, run, total_steps=3, config={"a": 1})
    for step in (1, 2, 3):
        log.log(step, {"rollout/reward_mean": 0.1 * step, "rollout/acc": 0.5, "entropy/mean": 1.0,
                       "loss/pg_loss": float("nan"), "timing/rollout_s": 0.2})
    log.close()
    recs = read_jsonl(os.path.join(run, "metrics.jsonl"))
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert math.isclose(recs[2]["rollout/reward_mean"], 0.3) and recs[0]["loss/pg_loss"] is None
    assert strip_timing(recs[0]) == {k: v for k, v in recs[0].items() if k != "timing/rollout_s"}
    assert glob.glob(os.path.join(run, "tensorboard", "events.out.tfevents.*"))
    assert glob.glob(os.path.join(run, "wandb", "offline-run-*"))
    err = capsys.readouterr()
    assert "reward=0.300" in err.out + err.err


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(LoggingConfig(), str(tmp_path / "r"), total_steps=1, enabled=False)
    log.log(1, {"a/b": 1.0})
    log.close()
    assert not os.path.exists(tmp_path / "r")


def test_timer():
    t = Timer()
    with t("rollout"):
        time.sleep(0.01)
    with t("rollout"):
        pass
    out = t.pop()
    assert set(out) == {"timing/rollout_s"} and out["timing/rollout_s"] >= 0.01
    assert t.pop() == {}


def test_logging_config_reaches_wandb_init(tmp_path, monkeypatch):
    """logging.wandb_* through build_logger into wandb.init, every field (entity included)."""
    import sys
    from types import SimpleNamespace

    from hapo_megatron.config import HapoConfig
    from hapo_megatron.training.build import build_logger

    calls = []
    fake = SimpleNamespace(init=lambda **kw: calls.append(kw) or SimpleNamespace(finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = HapoConfig.from_dict({"trainer": {"run_dir": str(tmp_path), "project_name": "proj",
                                            "experiment_name": "exp"},
                                "logging": {"wandb": True, "wandb_mode": "online", "wandb_entity": "team",
                                            "console": False, "jsonl": False}})
    build_logger(cfg, enabled=True).close()
    (kw,) = calls
    assert (kw["entity"], kw["project"], kw["name"], kw["mode"]) == ("team", "proj", "exp", "online")
    assert kw["config"]["logging"]["wandb_entity"] == "team"


def test_a_log_file_gets_one_plain_line_per_step_and_no_bar(tmp_path, capsys):
    """Without a terminal (a log file; here pytest's capture) every step is one line starting with
    `step N ` and nothing of a progress bar (mutation: the bar whatever the stream writes its
    carriage-return redraws and `step/s` into the log)."""
    log = MetricsLogger(LoggingConfig(console=True, jsonl=False), str(tmp_path), total_steps=3)
    for step in (1, 2, 3):
        log.log(step, {"rollout/reward_mean": 0.1 * step, "perf/step_time_s": 2.0})
    log.write("a message")
    log.close()
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert [line.split(" |")[0] for line in text.splitlines() if line.startswith("step ")] == [
        "step 1", "step 2", "step 3"]
    assert "\r" not in text and "step/s" not in text and "a message" in text
