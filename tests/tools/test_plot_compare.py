"""tools/plot_run.py and tools/compare_runs.py on synthetic metrics.jsonl files."""

import json
import math
import os
import statistics

import pytest

from tests.tools._load import load_tool

plot_run = load_tool("plot_run")
compare_runs = load_tool("compare_runs")


def write_run(path, steps=10, acc0=0.2, slope=0.02, eval_every=5, extra_lines=()):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for s in range(1, steps + 1):
            rec = {"step": s, "rollout/acc": acc0 + slope * s,
                   "rollout/reward_mean": 2 * (acc0 + slope * s) - 1,
                   "rollout/response_length_mean": 30.0 + s, "entropy/mean": 1.0 / s,
                   "loss/clipfrac_low": 0.01 * s, "loss/clipfrac_high": 0.02,
                   "timing/step_s": 1.0}
            if s % eval_every == 0:
                rec["eval/arith/avg@4"] = acc0 + 0.03 * s
                rec["eval/all/avg@4"] = acc0 + 0.03 * s
                rec["eval/all/avg@2"] = acc0
            f.write(json.dumps(rec) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def test_load_metrics_handles_torn_lines_nulls_and_repeated_steps(tmp_path):
    run = write_run(tmp_path / "r", steps=3, extra_lines=[
        json.dumps({"step": 2, "rollout/acc": 0.9, "entropy/mean": None}), '{"step": 4, "rollo'])
    rows = plot_run.load_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["rollout/acc"] == 0.9 and math.isnan(rows[1]["entropy/mean"])
    assert plot_run.series(rows, "entropy/mean") == ([1, 3], [1.0, 1 / 3])
    with pytest.raises(ValueError, match="no metrics file"):
        plot_run.load_metrics(str(tmp_path / "missing"))


def test_eval_line_with_the_same_step_merges_into_the_training_record(tmp_path):
    # the trainer logs the final evaluation as its own line carrying the last training step
    run = write_run(tmp_path / "r", steps=3, eval_every=99,
                    extra_lines=[json.dumps({"step": 3, "eval/all/avg@4": 0.5})])
    rows = plot_run.load_metrics(run)
    assert rows[-1]["eval/all/avg@4"] == 0.5
    assert rows[-1]["rollout/acc"] == pytest.approx(0.2 + 0.02 * 3)
    assert compare_runs.last_n_mean(rows, "rollout/acc", 3) == pytest.approx(0.2 + 0.02 * 2)


def test_helpers():
    assert plot_run.smooth([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    rows_a = [{"step": 1, "x": 1.0}, {"step": 2, "x": 3.0}]
    rows_b = [{"step": 2, "x": 5.0}, {"step": 3, "x": 0.0}]
    assert plot_run.mean_band([rows_a, rows_b], "x") == ([2], [4.0], [3.0], [5.0])
    assert plot_run.matching_keys([{"step": 1, "eval/a/avg@4": 1, "eval/all/avg@4": 1}],
                                  "eval/all/avg@*") == ["eval/all/avg@4"]
    assert plot_run.parse_run_spec("runs/hapo_s1/") == ("hapo_s1", ["runs/hapo_s1/"])
    assert plot_run.parse_run_spec("h=a,b") == ("h", ["a", "b"])
    with pytest.raises(ValueError):
        plot_run.parse_run_spec("h=")


def test_plot_run_cli_writes_pngs(tmp_path):
    a = write_run(tmp_path / "hapo_s1")
    b = write_run(tmp_path / "hapo_s2", acc0=0.3)
    c = write_run(tmp_path / "dapo", slope=0.0)
    out = tmp_path / "plots"
    assert plot_run.main([f"hapo={a},{b}", c, "--out", str(out), "--smooth", "2"]) == 0
    names = sorted(os.listdir(out))
    assert names == sorted(["reward.png", "accuracy.png", "response_length.png", "entropy.png",
                            "clip_fractions.png", "eval_accuracy.png", "overview.png"])
    for n in names:
        with open(out / n, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_skips_panels_without_data(tmp_path):
    run = tmp_path / "r"
    os.makedirs(run)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "entropy/mean": 0.5}) + "\n")
    paths = plot_run.plot_runs({"r": [plot_run.load_metrics(str(run))]}, str(tmp_path / "o"))
    assert [os.path.basename(p) for p in paths] == ["entropy.png", "overview.png"]


def test_compare_table_numbers(tmp_path):
    runs = {"hapo": [write_run(tmp_path / "h1", acc0=0.2), write_run(tmp_path / "h2", acc0=0.4)],
            "dapo": [write_run(tmp_path / "d1", acc0=0.1, slope=0.0, eval_every=100)]}
    out = tmp_path / "cmp"
    argv = ["--variant", "hapo=" + ",".join(runs["hapo"]), "--variant", "dapo=" + runs["dapo"][0],
            "--out", str(out), "--last-n", "3"]
    assert compare_runs.main(argv) == 0
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
    a = plot_run.load_metrics(write_run(tmp_path / "a"))
    b = plot_run.load_metrics(write_run(tmp_path / "b", acc0=0.0))
    table, numbers = compare_runs.compare({"x": [a, b]}, last_n=2)
    assert numbers["acc_key"] == "eval/all/avg@4"
    # final eval at step 10: 0.2 + 0.3 and 0.0 + 0.3
    assert numbers["variants"]["x"]["mean"]["final_acc"] == pytest.approx(0.4)
    assert "final acc (eval/all/avg@4)" in table
    assert compare_runs.main(["--variant", "oops", "--out", str(tmp_path / "o")]) == 2
    assert compare_runs.main(["--variant", f"x={tmp_path / 'nope'}", "--out",
                              str(tmp_path / "o")]) == 2
