"""End to end: the CPU example on 2 gloo ranks (TP=2) for a few steps with tiny settings, and a
run killed after a checkpoint that resumes to exactly the metrics of the uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hapo_megatron.training.metrics import read_jsonl, strip_timing
from tests.training.tiny_setup import ROOT, prepare_tiny, tiny_overrides

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")
pytestmark = pytest.mark.slow


def _cmd(data, run_dir, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "hapo_megatron.train", "--config", CONFIG, *tiny_overrides(data, run_dir), *extra]


def _run(cmd, timeout=400):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's workers (they run in their own sessions), then torchrun: a crash."""
    import psutil
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for child in children:
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=30)
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return prepare_tiny(str(tmp_path_factory.mktemp("cpu_tiny_data")))


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("full"))
    out = _run(_cmd(tiny, run_dir, "logging.save_rollouts_interval=2"))
    return run_dir, out


def test_cpu_example_runs_and_logs(full_run):
    run_dir, out = full_run
    recs = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "rollout/reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for key in ("rollout/reward_mean", "rollout/acc", "entropy/mean", "entropy/pivot", "loss/pg_loss",
                "loss/clipfrac_low", "loss/clipfrac_high", "rollout/logprob_abs_diff", "actor/lr",
                "timing/rollout_s", "timing/update_s", "timing/sync_s", "perf/tokens_per_s"):
        assert key in recs[-1], key
    # the HF engine and the Megatron recompute hold the same fp32 weights: step 1 samples at T_base
    # (no entropy statistics yet), so their log-probs agree to rounding; later steps sample at the
    # adaptive temperature (tau = 0.05), whose log-probs differ from the T_base recompute by design
    assert recs[0]["rollout/logprob_abs_diff"] < 1e-5, recs[0]["rollout/logprob_abs_diff"]
    assert all(r["rollout/logprob_abs_diff"] < 0.05 for r in recs), [r["rollout/logprob_abs_diff"] for r in recs]
    ckpts = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert ckpts == ["latest", "step_000002", "step_000004"]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    assert summary["steps"] == 4 and "eval/arithmetic_val/avg@2" in summary["eval_end"]
    assert os.path.exists(os.path.join(run_dir, "config.yaml"))
    assert "reward mean" in out and "wall time" in out


def test_token_diagnostics_logged_and_rollouts_saved(full_run, tiny):
    from hapo_megatron.analysis import analyze_rollouts, read_rollouts, rollout_path
    from hapo_megatron.analysis.cli import main as diag_main
    run_dir, _ = full_run
    recs = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "rollout/reward_mean" in r]
    for key in ("diag/entropy_mean", "diag/entropy_pivot", "diag/high_entropy_share",
                "diag/entropy_frac_lt_0.1", "diag/temperature_mean", "diag/temperature_std",
                "diag/adv_ratio_high", "diag/response_length_mean"):
        assert key in recs[-1], key
    assert abs(recs[-1]["diag/entropy_mean"] - recs[-1]["entropy/mean"]) < 1e-4
    for r in recs:  # the clip flags the diagnostics count are the loss's own, of every update
        for side in ("low", "high", "dual"):
            assert r[f"diag/clipfrac_{side}"] == pytest.approx(r[f"loss/clipfrac_{side}"], rel=1e-9, abs=1e-12)
    assert recs[-1]["diag/response_length_mean"] == pytest.approx(recs[-1]["rollout/response_length_mean"])
    assert sorted(os.listdir(os.path.join(run_dir, "rollouts"))) == ["step_000002.jsonl", "step_000004.jsonl"]
    rows = read_rollouts(rollout_path(run_dir, 4))
    assert len(rows) == 32 and [r["index"] for r in rows] == list(range(32))  # 8 prompts x n=4
    assert all(r["step"] == 4 and len(r["ratio"]) == len(r["response_ids"]) for r in rows)
    # the loss's ratios: 1 in the first mini-batch (4 groups, before any optimizer step of the
    # step), moved in the second (after one)
    first = set(list(dict.fromkeys(r["uid"] for r in rows))[:4])
    assert all(abs(x - 1) < 1e-5 for r in rows if r["uid"] in first for x in r["ratio"])
    assert max(abs(x - 1) for r in rows if r["uid"] not in first for x in r["ratio"]) > 1e-6
    report = analyze_rollouts(rows)
    assert report["metrics"]["diag/entropy_mean"] > 0 and "top_clipped_low" in report
    assert diag_main([rollout_path(run_dir, 2), "--tokenizer", os.path.join(tiny, "model")]) == 0


def test_killed_run_resumes_to_identical_metrics(tiny, full_run, tmp_path):
    run_dir = str(tmp_path / "killed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(_cmd(tiny, run_dir), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    pointer = os.path.join(run_dir, "checkpoints", "latest")
    deadline = time.time() + 400
    try:
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(pointer) and open(pointer).read().strip() == "step_000002":
                break
            time.sleep(0.05)
    finally:
        _kill_tree(proc)
    assert open(pointer).read().strip() == "step_000002", "the run never wrote its step-2 checkpoint"
    _run(_cmd(tiny, run_dir, "--resume", "auto"))
    full = [strip_timing(r) for r in read_jsonl(os.path.join(full_run[0], "metrics.jsonl"))]
    resumed = [strip_timing(r) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    assert resumed == full


def test_resume_under_another_layout_continues_the_run(tiny, full_run, tmp_path):
    """The TP=2 (2 ranks) run's step-2 checkpoint resumed on 1 rank at TP=1: the saved and the new
    layout are logged, and steps 3-4 reproduce the uninterrupted run's metrics to float32
    rounding (rel 1e-4 / abs 1e-5 on every number; the sampled tokens are the same)."""
    import math
    import shutil
    run_dir = str(tmp_path / "relayout")
    shutil.copytree(full_run[0], run_dir)
    shutil.rmtree(os.path.join(run_dir, "checkpoints", "step_000004"))
    with open(os.path.join(run_dir, "checkpoints", "latest"), "w") as f:
        f.write("step_000002\n")
    cmd = _cmd(tiny, run_dir, "parallel.tensor_model_parallel_size=1", "--resume", "auto")
    cmd[cmd.index("--nproc-per-node") + 1] = "1"
    out = _run(cmd)
    assert ("saved under TP=2 PP=1 CP=1 DP=1 (2 ranks), resuming under TP=1 PP=1 CP=1 DP=1 (1 rank)"
            in out), out[-3000:]
    full = [strip_timing(r) for r in read_jsonl(os.path.join(full_run[0], "metrics.jsonl"))]
    resumed = [strip_timing(r) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for got, want in zip(resumed, full):
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, float) and math.isfinite(value):
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (got["step"], key)
            else:
                assert got[key] == value, (got["step"], key)


def _preempted_run(tiny, run_dir: str, stage: str, step: int):
    """The example under torchrun with ``stage`` of ``step`` held on every rank until its SIGTERM
    arrives (tests/training/preempt_hook.py); SIGTERM goes to torchrun, which forwards it to the
    workers. Returns (each rank's exit code, torchrun's exit code, the run's output)."""
    markers, log = run_dir + ".markers", run_dir + ".log"
    os.makedirs(markers)
    cmd = _cmd(tiny, run_dir)
    cmd[cmd.index("hapo_megatron.train")] = "tests.training.preempt_hook"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HAPO_TEST_HOLD_STAGE": stage,
           "HAPO_TEST_HOLD_STEP": str(step), "HAPO_TEST_MARKER_DIR": markers}
    held = [os.path.join(markers, f"held.{stage}.rank{r}") for r in (0, 1)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.time() + 400
            while proc.poll() is None and time.time() < deadline and not all(map(os.path.exists, held)):
                time.sleep(0.05)
            assert all(map(os.path.exists, held)), f"{stage} of step {step} never reached: " + open(log).read()[-3000:]
            proc.send_signal(signal.SIGTERM)
            torchrun_code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                _kill_tree(proc)
    exits = [os.path.join(markers, f"exit.rank{r}") for r in (0, 1)]
    codes = [int(open(p).read()) if os.path.exists(p) else None for p in exits]  # None: the rank crashed
    return codes, torchrun_code, open(log).read()


@pytest.mark.parametrize("stage,step,saved,kept", [("rollout", 2, 1, [1]), ("update", 3, 3, [2, 3])])
def test_sigterm_saves_the_last_finished_step_and_resumes_to_identical_metrics(tiny, full_run, tmp_path,
                                                                               stage, step, saved, kept):
    """SIGTERM during step 2's rollout abandons step 2 and saves step 1 (the state before the
    rollout); during step 3's update the update finishes and step 3 is saved (after step 2's
    periodic save: dist_checkpointing's writer process outlives the signal). Every rank exits
    with EXIT_STOPPED; `--resume auto` then reproduces the uninterrupted run's metrics exactly."""
    from hapo_megatron.training.checkpoint_manifest import verify
    from hapo_megatron.training.preemption import EXIT_STOPPED
    run_dir = str(tmp_path / stage)
    codes, torchrun_code, out = _preempted_run(tiny, run_dir, stage, step)
    assert codes == [EXIT_STOPPED, EXIT_STOPPED], out[-3000:]
    assert torchrun_code != 0  # torchrun re-raises the signal it forwarded (docs/troubleshooting.md)
    ckpts = os.path.join(run_dir, "checkpoints")
    name = f"step_{saved:06d}"
    assert open(os.path.join(ckpts, "latest")).read().strip() == name
    assert sorted(os.listdir(ckpts)) == ["latest"] + [f"step_{k:06d}" for k in kept]  # step 2: save_interval
    assert os.path.isfile(os.path.join(ckpts, name, "COMPLETE")) and verify(os.path.join(ckpts, name)) == []
    assert f"stopping: SIGTERM received; step {saved} is saved in" in out
    logged = [r["step"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "rollout/reward_mean" in r]
    assert logged == list(range(1, saved + 1))
    _run(_cmd(tiny, run_dir, "--resume", "auto"))
    full = [strip_timing(r) for r in read_jsonl(os.path.join(full_run[0], "metrics.jsonl"))]
    resumed = [strip_timing(r) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    assert resumed == full


def test_truncated_shard_in_newest_checkpoint_resumes_from_the_previous_one(tiny, full_run, tmp_path):
    """A shard of step 4 cut short after its COMPLETE marker: `--resume auto` says it skips step 4
    and why, resumes from step 2 and reproduces the uninterrupted run's steps 3-4."""
    import shutil
    run_dir = str(tmp_path / "truncated")
    shutil.copytree(full_run[0], run_dir)
    model = os.path.join(run_dir, "checkpoints", "step_000004", "model")
    shard = sorted(f for f in os.listdir(model) if f.endswith(".distcp"))[0]
    os.truncate(os.path.join(model, shard), os.path.getsize(os.path.join(model, shard)) // 2)
    out = _run(_cmd(tiny, run_dir, "--resume", "auto"))
    assert f"resume: skipping step_000004: checkpoint {os.path.join(run_dir, 'checkpoints', 'step_000004')} " \
           f"fails verification against its manifest.json: model/{shard}:" in out, out[-3000:]
    assert "resumed from " + os.path.join(run_dir, "checkpoints", "step_000002") in out
    full = [strip_timing(r) for r in read_jsonl(os.path.join(full_run[0], "metrics.jsonl"))]
    resumed = [strip_timing(r) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    assert resumed == full
