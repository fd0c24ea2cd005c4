"""End to end: the CPU example on 2 gloo ranks (TP=2) for a few steps with tiny settings, and a
run killed after a checkpoint that resumes to exactly the metrics of the uninterrupted run."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from hapo_megatron.training.metrics.sinks import read_jsonl, strip_timing
from tests.float_bounds import ENTROPY_REL, h_hat_bound, near_loss_discontinuity, stats_bounds
from tests.tools._load import load_tool
from tests.training.tiny_setup import ROOT, prepare_tiny, tiny_overrides
from hapo_megatron.algo.loss_config import PolicyLossConfig

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")
pytestmark = pytest.mark.slow
kill_tree = load_tool("bench/procs").kill_tree  # torchrun and its workers (own sessions)


def _cmd(data, run_dir, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "hapo_megatron.train", "--config", CONFIG, *tiny_overrides(data, run_dir), *extra]


def _run(cmd, timeout=400):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


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
                "timing/rollout_s", "timing/update_s", "timing/sync_s", "perf/tokens_per_s",
                "perf/tokens_per_s_per_gpu", "perf/model_tflops_per_gpu",
                "timing/advantages_s", "timing/layout_s", "timing/old_logprob_s", "perf/token_efficiency",
                "adv/abs_mean"):
        assert key in recs[-1], key
    # per training GPU: the 2 ranks of this run share the step's tokens
    assert math.isclose(recs[-1]["perf/tokens_per_s_per_gpu"], recs[-1]["perf/tokens_per_s"] / 2, rel_tol=1e-12)
    # the HF engine and the Megatron recompute hold the same fp32 weights: step 1 samples at T_base
    # (no entropy statistics yet), so their log-probs agree to rounding (two float32 forwards of
    # another layout: logits and log-sum-exp a few ulps apart, ~1e-6 of |log p| ~ 4.5; 1e-5 is the
    # mean of that, with margin); later steps sample at the adaptive temperature (tau = 0.05),
    # whose log-probs differ from the T_base recompute by design
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
    # step; the update's forward and the old-log-prob pass cut the batch differently, so their
    # float32 log-probs differ by a few ulps of |log p| ~ 4.5, ~2e-6), moved in the second (after one)
    first = set(list(dict.fromkeys(r["uid"] for r in rows))[:4])
    assert all(abs(x - 1) < 1e-5 for r in rows if r["uid"] in first for x in r["ratio"])
    assert max(abs(x - 1) for r in rows if r["uid"] not in first for x in r["ratio"]) > 1e-6
    report = analyze_rollouts(rows, entropy_pivot_q=PolicyLossConfig().entropy_pivot)
    assert report["metrics"]["diag/entropy_mean"] > 0 and "top_clipped_low" in report
    assert diag_main(["rollouts", rollout_path(run_dir, 2), "--tokenizer", os.path.join(tiny, "model")]) == 0


@pytest.fixture(scope="module")
def killed_run(tiny, full_run, tmp_path_factory):
    """A run SIGKILLed once its step-2 checkpoint is the latest, then given a newer checkpoint that
    fails verification: the full run's step 4 with a shard cut short after its COMPLETE marker, as
    `latest`, and the metrics lines the full run logged after step 2. One `--resume auto` then
    serves two tests: it must skip step 4, resume the killed run from its own step 2 and drop those
    lines. Returns (run dir, `latest` after the kill, the resume's output, the
    truncated shard's name)."""
    import shutil
    run_dir = str(tmp_path_factory.mktemp("killed") / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(_cmd(tiny, run_dir), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    ckpts = os.path.join(run_dir, "checkpoints")
    pointer = os.path.join(ckpts, "latest")
    deadline = time.time() + 400
    try:
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(pointer) and open(pointer).read().strip() == "step_000002":
                break
            time.sleep(0.05)
    finally:
        kill_tree(proc)
    after_kill = open(pointer).read().strip() if os.path.exists(pointer) else None
    if after_kill != "step_000002":
        return run_dir, after_kill, None, None
    assert not os.path.exists(os.path.join(ckpts, "step_000004"))
    shutil.copytree(os.path.join(full_run[0], "checkpoints", "step_000004"), os.path.join(ckpts, "step_000004"))
    model = os.path.join(ckpts, "step_000004", "model")
    shard = sorted(f for f in os.listdir(model) if f.endswith(".distcp"))[0]
    os.truncate(os.path.join(model, shard), os.path.getsize(os.path.join(model, shard)) // 2)
    with open(pointer, "w") as f:
        f.write("step_000004\n")
    # and the lines a run that reached step 4 would have logged after step 2 (resume drops them)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    later = [line for line in open(os.path.join(full_run[0], "metrics.jsonl")) if json.loads(line).get("step", 0) > 2]
    with open(metrics) as f:
        torn = f.read()[-1:] not in ("", "\n")
    with open(metrics, "a") as f:
        f.write("\n" * torn + "".join(later))
    out = _run(_cmd(tiny, run_dir, "--resume", "auto"))
    return run_dir, after_kill, out, shard


def test_killed_run_resumes_to_identical_metrics(killed_run, full_run):
    """SIGKILL (torchrun and its workers) once the step-2 checkpoint is the latest; `--resume auto`
    (past a damaged newer checkpoint, `killed_run`) reproduces the uninterrupted run's metrics."""
    run_dir, after_kill, out, _ = killed_run
    assert after_kill == "step_000002", "the run never wrote its step-2 checkpoint"
    assert "resumed from " + os.path.join(run_dir, "checkpoints", "step_000002") in out, out[-3000:]
    full = [strip_timing(r) for r in read_jsonl(os.path.join(full_run[0], "metrics.jsonl"))]
    resumed = [strip_timing(r) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    assert resumed == full


# Metrics the sampled tokens alone decide: with the same tokens, equal bit for bit.
_TOKEN_DETERMINED = re.compile(
    r"^(step|eval/.*|batch/.*|adv/.*|actor/(lr|num_updates|skipped_updates|consecutive_skips)"
    r"|rollout/(reward_mean|score_mean|acc|clip_ratio|kept_group_frac|num_.*|response_length_.*)"
    r"|diag/response_.*|loss/num_(tokens|seqs))$")
# Functions of the per-token entropies alone (no h_hat): the entropy's own rounding.
_ENTROPY_ONLY = ("entropy/mean", "diag/entropy_mean", "entropy/pivot", "diag/entropy_pivot")
_STATS = ("pivot", "std", "pos_max", "neg_min")
# Split by entropy class (h_hat > 0 or <= 0): a token within rounding of h_hat = 0 may change class.
_BY_CLASS = re.compile(r"(high|low)_entropy|^diag/.*_(high|low)$")


def _tokens(rows, field):
    return torch.tensor([x for r in rows for x in r[field]], dtype=torch.float64)


def _h_hat_noise(got, want):
    """The step's entropy statistics agree within `stats_bounds`; returns the bound on any token's
    |d h_hat| that the entropy's rounding and the statistics' measured moves give."""
    std, pos_max, neg_min = (want[f"entropy/{k}"] for k in ("std", "pos_max", "neg_min"))
    allowed = stats_bounds(std, pos_max, neg_min)
    moved = {k: got[f"entropy/{k}"] - want[f"entropy/{k}"] for k in _STATS}
    for k in _STATS:
        assert abs(moved[k]) <= allowed[k], (want["step"], f"entropy/{k}", moved[k], allowed[k])
    return h_hat_bound(std, pos_max, neg_min, d_pivot=moved["pivot"], d_std=moved["std"],
                       d_pos_max=moved["pos_max"], d_neg_min=moved["neg_min"])


def _assert_step_close(got, want, d_h, rows, algo):
    """Metrics of one resumed step vs the uninterrupted run's. `d_h` bounds |d h_hat| of any token
    in this step and the last (whose statistics set this step's sampling temperatures); `rows` are
    the step's saved rollouts (tokens, h_hat, A)."""
    from hapo_megatron.analysis import ENTROPY_BIN_EDGES
    h, ent, adv = _tokens(rows, "h_hat"), _tokens(rows, "entropy"), _tokens(rows, "adv_before").abs()
    # Every per-token quantity behind the other metrics moves with h_hat at most linearly:
    # A' = A (1 + beta h) (continuous at h = 0, so a class change alone does not move it),
    # eps_t = eps (1 +- alpha h), T = T_base (1 + tau h); with gain = max(1, beta, alpha, tau) a
    # token's term moves by <= gain * d_h * (its size or |A|), a mean by d_h * gain * (|v| + mean|A|).
    gain = max(1.0, algo["adv_beta"], algo["clip_alpha"], algo["temperature_tau"])
    # no ratio within rounding of a clip / neutral-zone edge, so every token takes the same branch
    # of the loss in both runs: a ratio moves by the log-probs' rounding (1e-5) plus, after the
    # step's first update, d_h of that update's size |ratio - 1| (the update is linear in A')
    ratio = _tokens(rows, "ratio")
    edge_rel = d_h * float((ratio - 1).abs().max()) + 1e-5
    assert not near_loss_discontinuity(ratio, h, torch.ones_like(h, dtype=torch.bool),
                                       SimpleNamespace(**algo), edge_rel).any(), (want["step"], edge_rel)
    # tokens within d_h of h_hat = 0 may sit in the other entropy class in the other run
    near_zero = h.abs() <= d_h
    movers, movers_adv = int(near_zero.sum()), float(adv[near_zero].sum())
    edges = torch.tensor(ENTROPY_BIN_EDGES, dtype=torch.float64)
    near_edge = int(((ent[:, None] - edges).abs() <= ENTROPY_REL * ent[:, None]).any(1).sum())
    for key, value in want.items():
        if not isinstance(value, float) or not math.isfinite(value) or _TOKEN_DETERMINED.match(key):
            assert got[key] == value, (want["step"], key)
            continue
        if key in _ENTROPY_ONLY:
            tol = ENTROPY_REL * max(abs(value), 1.0)
        elif key.removeprefix("entropy/") in _STATS:
            continue  # checked by _h_hat_noise
        elif key.startswith("diag/entropy_frac_"):  # shares of tokens below/above fixed edges
            tol = near_edge / h.numel()
        else:
            tol = gain * d_h * (abs(value) + float(adv.mean()))
            by_class = _BY_CLASS.search(key)
            if by_class:  # + what the movers can change: they leave or join the class
                in_class = (h > 0) if (by_class.group(1) or by_class.group(2)) == "high" else (h <= 0)
                worst = abs(value) + 1 + algo["adv_beta"]  # per-token terms lie in [0, 1 + beta]
                if "ratio_of_sums" in key:  # sum |A'| / sum |A| over the class: a mover weighs |A|
                    tol += movers_adv * worst / max(float(adv[in_class].sum()) - movers_adv, 1e-12)
                else:  # a mean, share or count over the class
                    tol += movers * worst / max(int(in_class.sum()) - movers, 1)
        assert abs(got[key] - value) <= tol, (want["step"], key, got[key], value, tol)


def _assert_tokens_close(got_rows, want_rows, d_h, algo, t_base):
    """Per token, where both runs saved the step: the same samples, rewards and advantages, the
    entropy within its rounding, h_hat / temperature / A' within what d_h allows, the same clips
    (no ratio is near an edge: checked in `_assert_step_close`)."""
    for key in ("uid", "response_ids", "reward", "adv_before", "clip_low", "clip_high", "clip_dual"):
        assert [r[key] for r in got_rows] == [r[key] for r in want_rows], key
    ent = _tokens(want_rows, "entropy")
    assert ((_tokens(got_rows, "entropy") - ent).abs() <= ENTROPY_REL * ent).all()
    assert ((_tokens(got_rows, "h_hat") - _tokens(want_rows, "h_hat")).abs() <= d_h).all()
    t_tol = algo["temperature_tau"] * t_base * d_h
    assert ((_tokens(got_rows, "temperatures") - _tokens(want_rows, "temperatures")).abs() <= t_tol).all()
    a_tol = algo["adv_beta"] * d_h * _tokens(want_rows, "adv_before").abs()
    assert ((_tokens(got_rows, "adv_after") - _tokens(want_rows, "adv_after")).abs() <= a_tol).all()


def test_resume_under_another_layout_continues_the_run(tiny, full_run, tmp_path):
    """The TP=2 (2 ranks) run's step-2 checkpoint resumed on 1 rank at TP=1: the saved and the new
    layout are logged, and steps 3-4 continue the uninterrupted run: the same sampled tokens, so the
    same rewards and every metric they decide; the rest within bounds derived from float32 rounding
    of the per-token entropy (another TP split regroups its sums) and how the entropy statistics
    amplify it (`tests/float_bounds.py`, docs/testing.md#numerical-tolerances)."""
    import shutil

    run_dir = str(tmp_path / "relayout")
    shutil.copytree(full_run[0], run_dir)
    shutil.rmtree(os.path.join(run_dir, "checkpoints", "step_000004"))
    with open(os.path.join(run_dir, "checkpoints", "latest"), "w") as f:
        f.write("step_000002\n")
    cmd = _cmd(tiny, run_dir, "parallel.tensor_model_parallel_size=1", "logging.save_rollouts_interval=1",
               "--resume", "auto")
    cmd[cmd.index("--nproc-per-node") + 1] = "1"
    out = _run(cmd)
    assert ("saved under TP=2 PP=1 CP=1 DP=1 (2 ranks), resuming under TP=1 PP=1 CP=1 DP=1 (1 rank)"
            in out), out[-3000:]
    _assert_continues(full_run[0], run_dir)


def _assert_continues(full_dir, run_dir):
    """`run_dir` (resumed from the step-2 checkpoint of `full_dir` under another layout, rollouts
    saved every step) continues the uninterrupted run `full_dir`."""
    import yaml

    from hapo_megatron.analysis import read_rollouts, rollout_path
    with open(os.path.join(full_dir, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    algo, t_base = cfg["algo"], cfg["rollout"]["temperature"]
    full = [strip_timing(r) for r in read_jsonl(os.path.join(full_dir, "metrics.jsonl"))]
    resumed = [strip_timing(r) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    d_h_before = None  # |d h_hat| bound of the last step (its statistics set this step's temperatures)
    for got, want in zip(resumed, full):
        assert got.keys() == want.keys()
        if want["step"] <= 2 or "entropy/std" not in want:
            # lines written before the checkpoint, and the end-of-run evaluation (eval/* only:
            # decided by its sampled tokens): the same
            assert got == want, want["step"]
            if "entropy/std" in want:
                d_h_before = _h_hat_noise(want, want)
            continue
        d_h = _h_hat_noise(got, want)
        step_d_h = max(d_h, d_h_before)
        rows = read_rollouts(rollout_path(run_dir, want["step"]))
        _assert_step_close(got, want, step_d_h, rows, algo)
        if os.path.exists(rollout_path(full_dir, want["step"])):  # saved every 2 steps there
            _assert_tokens_close(rows, read_rollouts(rollout_path(full_dir, want["step"])), step_d_h,
                                 algo, t_base)
        d_h_before = d_h


def _preempted_run(tiny, run_dir: str, stage: str, step: int, *extra: str):
    """The example under torchrun (``extra``: more arguments, e.g. ``--resume auto``) with ``stage``
    of ``step`` held on every rank until its SIGTERM arrives (tests/training/preempt_hook.py);
    SIGTERM goes to torchrun, which forwards it to the workers. Returns (each rank's exit code,
    torchrun's exit code, the run's output)."""
    markers, log = f"{run_dir}.{stage}.markers", f"{run_dir}.{stage}.log"
    os.makedirs(markers)
    cmd = _cmd(tiny, run_dir, *extra)
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
                kill_tree(proc)
    exits = [os.path.join(markers, f"exit.rank{r}") for r in (0, 1)]
    codes = [int(open(p).read()) if os.path.exists(p) else None for p in exits]  # None: the rank crashed
    return codes, torchrun_code, open(log).read()


@pytest.fixture(scope="module")
def preempted_runs(tiny, tmp_path_factory):
    """One run stopped twice: SIGTERM during step 2's rollout (a run from scratch), then, resumed,
    SIGTERM during step 3's update (after the resumed run's own periodic save of step 2), then
    resumed to the end. After each stop: (each rank's exit code, torchrun's, the output, the
    checkpoints listed, `latest`, whether it has its COMPLETE marker, its manifest's verification
    problems, the steps logged); and the run dir."""
    from hapo_megatron.training.checkpointing.manifest import verify
    run_dir = str(tmp_path_factory.mktemp("preempted") / "run")
    ckpts = os.path.join(run_dir, "checkpoints")
    stops = {}
    for stage, step, extra in (("rollout", 2, ()), ("update", 3, ("--resume", "auto"))):
        codes, torchrun_code, out = _preempted_run(tiny, run_dir, stage, step, *extra)
        logged = [r["step"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "rollout/reward_mean" in r]
        latest = open(os.path.join(ckpts, "latest")).read().strip()
        stops[stage] = (codes, torchrun_code, out, sorted(os.listdir(ckpts)), latest,
                        os.path.isfile(os.path.join(ckpts, latest, "COMPLETE")), verify(os.path.join(ckpts, latest)),
                        logged)
    _run(_cmd(tiny, run_dir, "--resume", "auto"))
    return stops, run_dir


@pytest.mark.parametrize("stage,step,saved,kept", [("rollout", 2, 1, [1]), ("update", 3, 3, [2, 3])])
def test_sigterm_saves_the_last_finished_step_and_resumes_to_identical_metrics(preempted_runs, full_run,
                                                                               stage, step, saved, kept):
    """SIGTERM during step 2's rollout abandons step 2 and saves step 1 (the state before the
    rollout); during step 3's update (of the run resumed from that step 1) the update finishes and
    step 3 is saved (after step 2's periodic save in the same process: dist_checkpointing's writer
    process outlives the signal). Every rank exits with EXIT_STOPPED; `--resume auto` then
    reproduces the uninterrupted run's metrics exactly (`preempted_runs`: one run, both stops)."""
    from hapo_megatron.training.checkpointing.preemption import EXIT_STOPPED
    stops, run_dir = preempted_runs
    codes, torchrun_code, out, listed, latest, complete, problems, logged = stops[stage]
    assert codes == [EXIT_STOPPED, EXIT_STOPPED], out[-3000:]
    assert torchrun_code != 0  # torchrun re-raises the signal it forwarded (docs/troubleshooting.md)
    name = f"step_{saved:06d}"
    assert latest == name
    # step 2: save_interval; step 1 went at step 3's save (keep_last_k: 2)
    assert listed == ["latest"] + [f"step_{k:06d}" for k in kept]
    assert complete and problems == []
    assert f"stopping: SIGTERM received; step {saved} is saved in" in out
    assert logged == list(range(1, saved + 1))
    full = [strip_timing(r) for r in read_jsonl(os.path.join(full_run[0], "metrics.jsonl"))]
    resumed = [strip_timing(r) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    assert resumed == full


def test_truncated_shard_in_newest_checkpoint_resumes_from_the_previous_one(killed_run, full_run):
    """A shard of step 4 cut short after its COMPLETE marker (`killed_run`): `--resume auto` says it
    skips step 4 and why, resumes from step 2 and reproduces the uninterrupted run's steps 3-4."""
    run_dir, after_kill, out, shard = killed_run
    assert after_kill == "step_000002", "the run never wrote its step-2 checkpoint"
    assert f"resume: skipping step_000004: checkpoint {os.path.join(run_dir, 'checkpoints', 'step_000004')} " \
           f"fails verification against its manifest.json: model/{shard}:" in out, out[-3000:]
    assert "resumed from " + os.path.join(run_dir, "checkpoints", "step_000002") in out
    full = [strip_timing(r) for r in read_jsonl(os.path.join(full_run[0], "metrics.jsonl"))]
    resumed = [strip_timing(r) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
    assert resumed == full
