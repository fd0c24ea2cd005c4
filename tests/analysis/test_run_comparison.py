"""hapo_megatron.analysis.run_comparison (`hapo analyze compare`) on synthetic runs: the table's
numbers, the accuracy key, the paired comparison matched by seed, the determinism check, notes."""

import json
import os
import statistics

import pytest

from hapo_megatron.analysis import paired_stats, run_comparison, run_metrics
from hapo_megatron.analysis.cli import main as analyze
from tests.analysis.fake_runs import seeded_run, write_run


def compare(argv):
    return analyze(["compare", *argv])


def test_compare_table_numbers(tmp_path):
    runs = {"hapo": [write_run(tmp_path / "h1", acc0=0.2), write_run(tmp_path / "h2", acc0=0.4)],
            "dapo": [write_run(tmp_path / "d1", acc0=0.1, slope=0.0, eval_every=100)]}
    out = tmp_path / "cmp"
    argv = ["--variant", "hapo=" + ",".join(runs["hapo"]), "--variant", "dapo=" + runs["dapo"][0],
            "--out", str(out), "--last-n", "3"]
    assert compare(argv) == 0
    md = (out / "results.md").read_text()
    numbers = json.loads((out / "results.json").read_text())
    # dapo never evaluated -> the shared accuracy key falls back to rollout/acc
    assert numbers["acc_key"] == "rollout/acc"
    # hapo final acc: 0.2 + 0.2 and 0.4 + 0.2 -> mean 50.0 %, std of (0.4, 0.6) = 0.1414
    assert "| hapo | 2 | 10 | 50.0 ± 14.1 |" in md
    # last 3 steps (8, 9, 10): acc mean 0.2 + 0.18 = 0.38 and 0.58 -> 48.0 ± 14.1
    h = numbers["variants"]["hapo"]
    assert h["mean"]["acc"] == pytest.approx(0.48)
    assert h["std"]["acc"] == pytest.approx(statistics.stdev([0.38, 0.58]))
    assert h["mean"]["entropy"] == pytest.approx((1 / 8 + 1 / 9 + 1 / 10) / 3)
    assert h["mean"]["length"] == pytest.approx(39.0)
    assert "| dapo | 1 | 10 | 10.0 |" in md  # one seed: no std
    assert numbers["variants"]["dapo"]["std"]["acc"] is None
    for png in ("reward.png", "accuracy.png", "overview.png"):
        assert (out / png).exists() and f"({png})" in md


def test_compare_prefers_shared_eval_key_and_rejects_bad_specs(tmp_path):
    a = run_metrics.load_metrics(write_run(tmp_path / "a"))
    b = run_metrics.load_metrics(write_run(tmp_path / "b", acc0=0.0))
    table, numbers = run_comparison.compare({"x": [a, b]}, last_n=2)
    assert numbers["acc_key"] == "eval/all/avg@4"
    # final eval at step 10: 0.2 + 0.3 and 0.0 + 0.3
    assert numbers["variants"]["x"]["mean"]["final_acc"] == pytest.approx(0.4)
    assert "final acc (eval/all/avg@4)" in table
    assert compare(["--variant", "oops", "--out", str(tmp_path / "o")]) == 2
    assert compare(["--variant", f"x={tmp_path / 'nope'}", "--out", str(tmp_path / "o")]) == 2


def test_compare_pairs_by_seed_not_position(tmp_path):
    # final eval (step 10) = acc0 + 0.3; hapo - dapo per seed: seed 1 +0.10, seed 2 +0.05, seed 3 +0.09
    dapo = [seeded_run(tmp_path / f"d{s}", s, acc0=a) for s, a in ((1, 0.10), (2, 0.20), (3, 0.30))]
    hapo = [seeded_run(tmp_path / f"h{s}", s, acc0=a) for s, a in ((3, 0.39), (1, 0.20), (2, 0.25))]
    out = tmp_path / "cmp"
    argv = ["--variant", "dapo=" + ",".join(dapo), "--variant", "hapo=" + ",".join(hapo),
            "--baseline", "dapo", "--out", str(out), "--no-plots", "--command", "bash x.sh"]
    assert compare(argv) == 0
    numbers = json.loads((out / "results.json").read_text())
    row = next(r for r in numbers["paired"] if r["metric"] == "final_acc")
    assert row["seeds"] == [1, 2, 3]
    assert row["differences"] == [pytest.approx(0.10), pytest.approx(0.05), pytest.approx(0.09)]
    ci = paired_stats.paired_t_interval([0.10, 0.05, 0.09])
    assert (row["lower"], row["upper"]) == (pytest.approx(ci["lower"]), pytest.approx(ci["upper"]))
    md = (out / "results.md").read_text()
    assert "Made by `bash x.sh`." in md and "| hapo − dapo | held-out accuracy | 3 | +8.0 |" in md
    assert "| 3 | 60.0 | 69.0 |" in md  # per-seed table: dapo, hapo at seed 3


def test_compare_rejects_duplicate_seeds_and_unknown_baseline(tmp_path):
    a, b = seeded_run(tmp_path / "a", 1), seeded_run(tmp_path / "b", 1)
    assert compare(["--variant", f"x={a},{b}", "--out", str(tmp_path / "o"), "--no-plots"]) == 2
    assert compare(["--variant", f"x={a}", "--baseline", "y", "--out", str(tmp_path / "o"), "--no-plots"]) == 2


def test_determinism_check(tmp_path):
    a = write_run(tmp_path / "a")
    same = write_run(tmp_path / "same")
    with open(os.path.join(same, "metrics.jsonl"), "a") as f:  # a timing differs: still identical
        f.write(json.dumps({"step": 3, "timing/step_s": 7.0, "perf/tokens_per_s": 1.0}) + "\n")
    other = write_run(tmp_path / "other", extra_lines=[json.dumps({"step": 4, "rollout/acc": 0.5})])
    rows = run_metrics.load_metrics
    assert run_comparison.metric_mismatches(rows(a), rows(same)) == []
    assert run_comparison.metric_mismatches(rows(a), rows(other)) == ["step 4 rollout/acc: 0.28 != 0.5"]
    out = tmp_path / "cmp"
    base = ["--variant", f"x={a}", "--out", str(out), "--no-plots"]
    assert compare(base + ["--rerun", f"{a}={same}"]) == 0
    assert "reproduced every logged metric exactly" in (out / "results.md").read_text()
    assert compare(base + ["--rerun", f"{a}={other}"]) == 1
    assert "DIFFERED: step 4 rollout/acc" in (out / "results.md").read_text()


def test_notes_are_appended(tmp_path):
    out = tmp_path / "cmp"
    os.makedirs(out)
    (out / "notes.md").write_text("## Context\n\nkept across reruns\n")
    assert compare(["--variant", f"x={write_run(tmp_path / 'a')}", "--out", str(out), "--no-plots"]) == 0
    assert (out / "results.md").read_text().endswith("## Context\n\nkept across reruns\n")


def test_method_table_shows_what_some_variant_logged(tmp_path):
    """`What each method did`: a row per method metric that some variant logged (each run's mean
    over its steps, then mean ± std over seeds), `—` for the variants without it."""
    forking = [[{"step": 1, "loss/selected_frac": 0.2, "loss/clipfrac": 0.01},
                {"step": 2, "loss/selected_frac": 0.4, "loss/clipfrac": 0.03}],
               [{"step": 1, "loss/selected_frac": 0.1, "loss/clipfrac": 0.02}]]
    dapo = [[{"step": 1, "loss/clipfrac": 0.04}], [{"step": 1, "loss/clipfrac": 0.06}]]
    table, numbers = run_comparison.method_table({"forking-tokens": forking, "dapo": dapo})
    assert "| forking tokens: selected (`loss/selected_frac`) | 20.0 ± 14.1 | — |" in table
    assert "| tokens clipped (any bound) (`loss/clipfrac`) | 2.0 ± 0.0 | 5.0 ± 1.4 |" in table
    assert set(numbers) == {"loss/selected_frac", "loss/clipfrac"} and "archer" not in table.lower()
    assert numbers["loss/selected_frac"]["forking-tokens"]["runs"] == pytest.approx([0.3, 0.1])
    assert run_comparison.method_table({"dapo": [[{"step": 1, "rollout/acc": 0.5}]]}) == (None, {})
    # on the results page, and only when something was logged
    plain = write_run(tmp_path / "p")
    selected = write_run(tmp_path / "s", extra_lines=[json.dumps({"step": 3, "loss/selected_frac": 0.25})])
    for runs, shown in (([plain], False), ([selected], True)):
        out = tmp_path / f"cmp{shown}"
        assert compare(["--variant", "v=" + runs[0], "--out", str(out), "--no-plots"]) == 0
        assert ("## What each method did" in (out / "results.md").read_text()) is shown


def test_training_accuracy_is_the_policys_own_before_the_correction():
    """EDGE-GRPO's correction rewrites wrong responses before `rollout/acc` counts them, so a run
    that logged `gec/wrong_frac` is compared on 1 - it (the share right before the correction)."""
    corrected = [{"step": s, "rollout/acc": 0.5, "gec/wrong_frac": w} for s, w in ((1, 0.7), (2, 0.8), (3, 1.0))]
    plain = [{"step": s, "rollout/acc": a} for s, a in ((1, 0.4), (2, 0.5), (3, 0.6))]
    assert run_comparison.policy_acc_last_n(corrected, 2) == pytest.approx(0.1)  # 1 - (0.8 + 1.0) / 2
    assert run_comparison.policy_acc_last_n(plain, 2) == pytest.approx(0.55)
    _, numbers = run_comparison.compare({"edge": [corrected], "dapo": [plain]}, last_n=2)
    assert numbers["variants"]["edge"]["mean"]["acc"] == pytest.approx(0.1)
    assert numbers["variants"]["dapo"]["mean"]["acc"] == pytest.approx(0.55)
