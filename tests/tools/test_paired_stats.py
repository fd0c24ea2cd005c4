"""tools/paired_stats.py (t quantiles, paired t-intervals, bootstrap) and the paired comparison,
seed matching and determinism check of tools/compare_runs.py, on hand-computed cases."""

import json
import math
import os

import pytest

from tests.tools._load import load_tool
from tests.tools.test_plot_compare import write_run

paired_stats = load_tool("paired_stats")
compare_runs = load_tool("compare_runs")


@pytest.mark.parametrize("df, t975", [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)])
def test_t_quantile_matches_the_table(df, t975):  # two-sided 95% = the 0.975 quantile of the tables
    assert paired_stats.t_quantile(0.95, df) == pytest.approx(t975, abs=1e-4)


def test_t_distribution_function_hand_values():
    assert paired_stats.t_two_sided_prob(0.0, 3) == 0.0
    assert paired_stats.t_two_sided_prob(1.0, 1) == pytest.approx(0.5)  # Cauchy: 2 atan(1) / pi
    # df = 2: P(|T| <= t) = t / sqrt(2 + t^2)
    assert paired_stats.t_two_sided_prob(1.5, 2) == pytest.approx(1.5 / math.sqrt(2 + 1.5 ** 2))
    with pytest.raises(ValueError):
        paired_stats.t_two_sided_prob(1.0, 0)


def test_paired_t_interval_hand_case():
    # diffs 0.1 0.2 0.0 0.3 -0.1: mean 0.1, squares of deviations 0 .01 .01 .04 .04 -> sd sqrt(.1/4)
    ci = paired_stats.paired_t_interval([0.1, 0.2, 0.0, 0.3, -0.1])
    half = 2.7764451 * math.sqrt(0.025) / math.sqrt(5)
    assert ci["mean"] == pytest.approx(0.1) and ci["sd"] == pytest.approx(math.sqrt(0.025))
    assert (ci["lower"], ci["upper"]) == (pytest.approx(0.1 - half), pytest.approx(0.1 + half))
    assert paired_stats.verdict(ci["lower"], ci["upper"]) == "no measurable difference"
    # 0.05 0.07 0.06: mean 0.06, sd 0.01, t(2) = 4.302653 -> +-0.024841
    ci = paired_stats.paired_t_interval([0.05, 0.07, 0.06])
    assert (ci["lower"], ci["upper"]) == (pytest.approx(0.035159, abs=1e-6), pytest.approx(0.084841, abs=1e-6))
    assert paired_stats.verdict(ci["lower"], ci["upper"]) == "higher (by 3.5 to 8.5 points)"
    assert paired_stats.verdict(-0.08, -0.03) == "lower (by 3.0 to 8.0 points)"
    with pytest.raises(ValueError, match="at least 2"):
        paired_stats.paired_t_interval([0.1])


def test_paired_differences_and_bootstrap():
    d = paired_stats.paired_differences({1: 0.6, 2: 0.7, 3: math.nan, 4: 0.1}, {2: 0.5, 1: 0.4, 3: 0.2})
    assert d == {1: pytest.approx(0.2), 2: pytest.approx(0.2)}
    assert paired_stats.bootstrap_mean_interval([0.3, 0.3, 0.3]) == (pytest.approx(0.3), pytest.approx(0.3))
    vals = [0.1, 0.2, 0.0, 0.3, -0.1]
    lo, hi = paired_stats.bootstrap_mean_interval(vals, seed=1)
    assert (lo, hi) == paired_stats.bootstrap_mean_interval(vals, seed=1)
    assert -0.1 <= lo < 0.1 < hi <= 0.3


def seeded_run(path, seed, **kw):
    run = write_run(path, **kw)
    with open(os.path.join(run, "config.yaml"), "w") as f:
        f.write(f"trainer:\n  seed: {seed}\n")
    return run


def test_compare_pairs_by_seed_not_position(tmp_path):
    # final eval (step 10) = acc0 + 0.3; hapo - dapo per seed: seed 1 +0.10, seed 2 +0.05, seed 3 +0.09
    dapo = [seeded_run(tmp_path / f"d{s}", s, acc0=a) for s, a in ((1, 0.10), (2, 0.20), (3, 0.30))]
    hapo = [seeded_run(tmp_path / f"h{s}", s, acc0=a) for s, a in ((3, 0.39), (1, 0.20), (2, 0.25))]
    out = tmp_path / "cmp"
    argv = ["--variant", "dapo=" + ",".join(dapo), "--variant", "hapo=" + ",".join(hapo),
            "--baseline", "dapo", "--out", str(out), "--no-plots", "--command", "bash x.sh"]
    assert compare_runs.main(argv) == 0
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
    assert compare_runs.main(["--variant", f"x={a},{b}", "--out", str(tmp_path / "o"), "--no-plots"]) == 2
    assert compare_runs.main(["--variant", f"x={a}", "--baseline", "y", "--out", str(tmp_path / "o"),
                              "--no-plots"]) == 2


def test_determinism_check(tmp_path):
    a = write_run(tmp_path / "a")
    same = write_run(tmp_path / "same")
    with open(os.path.join(same, "metrics.jsonl"), "a") as f:  # a timing differs: still identical
        f.write(json.dumps({"step": 3, "timing/step_s": 7.0, "perf/tokens_per_s": 1.0}) + "\n")
    other = write_run(tmp_path / "other", extra_lines=[json.dumps({"step": 4, "rollout/acc": 0.5})])
    rows = compare_runs.plot_run.load_metrics
    assert compare_runs.metric_mismatches(rows(a), rows(same)) == []
    assert compare_runs.metric_mismatches(rows(a), rows(other)) == ["step 4 rollout/acc: 0.28 != 0.5"]
    out = tmp_path / "cmp"
    base = ["--variant", f"x={a}", "--out", str(out), "--no-plots"]
    assert compare_runs.main(base + ["--rerun", f"{a}={same}"]) == 0
    assert "reproduced every logged metric exactly" in (out / "results.md").read_text()
    assert compare_runs.main(base + ["--rerun", f"{a}={other}"]) == 1
    assert "DIFFERED: step 4 rollout/acc" in (out / "results.md").read_text()


def test_notes_are_appended(tmp_path):
    out = tmp_path / "cmp"
    os.makedirs(out)
    (out / "notes.md").write_text("## Context\n\nkept across reruns\n")
    assert compare_runs.main(["--variant", f"x={write_run(tmp_path / 'a')}", "--out", str(out), "--no-plots"]) == 0
    assert (out / "results.md").read_text().endswith("## Context\n\nkept across reruns\n")
