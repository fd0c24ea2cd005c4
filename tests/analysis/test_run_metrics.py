"""hapo_megatron.analysis.run_metrics on synthetic metrics.jsonl files: torn lines, nulls,
repeated steps, series, seed bands, smoothing, run specs."""

import json
import math

import pytest

from hapo_megatron.analysis import run_comparison, run_metrics
from tests.analysis.fake_runs import write_run


def test_load_metrics_handles_torn_lines_nulls_and_repeated_steps(tmp_path):
    run = write_run(tmp_path / "r", steps=3, extra_lines=[
        json.dumps({"step": 2, "rollout/acc": 0.9, "entropy/mean": None}), '{"step": 4, "rollo'])
    rows = run_metrics.load_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["rollout/acc"] == 0.9 and math.isnan(rows[1]["entropy/mean"])
    assert run_metrics.series(rows, "entropy/mean") == ([1, 3], [1.0, 1 / 3])
    with pytest.raises(ValueError, match="no metrics file"):
        run_metrics.load_metrics(str(tmp_path / "missing"))


def test_eval_line_with_the_same_step_merges_into_the_training_record(tmp_path):
    # the trainer logs the final evaluation as its own line carrying the last training step
    run = write_run(tmp_path / "r", steps=3, eval_every=99,
                    extra_lines=[json.dumps({"step": 3, "eval/all/avg@4": 0.5})])
    rows = run_metrics.load_metrics(run)
    assert rows[-1]["eval/all/avg@4"] == 0.5
    assert rows[-1]["rollout/acc"] == pytest.approx(0.2 + 0.02 * 3)
    assert run_comparison.last_n_mean(rows, "rollout/acc", 3) == pytest.approx(0.2 + 0.02 * 2)


def test_helpers():
    assert run_metrics.smooth([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    rows_a = [{"step": 1, "x": 1.0}, {"step": 2, "x": 3.0}]
    rows_b = [{"step": 2, "x": 5.0}, {"step": 3, "x": 0.0}]
    assert run_metrics.mean_band([rows_a, rows_b], "x") == ([2], [4.0], [3.0], [5.0])
    assert run_metrics.matching_keys([{"step": 1, "eval/a/avg@4": 1, "eval/all/avg@4": 1}],
                                     "eval/all/avg@*") == ["eval/all/avg@4"]
    assert run_metrics.parse_run_spec("runs/hapo_s1/") == ("hapo_s1", ["runs/hapo_s1/"])
    assert run_metrics.parse_run_spec("h=a,b") == ("h", ["a", "b"])
    with pytest.raises(ValueError):
        run_metrics.parse_run_spec("h=")


def test_group_run_specs_gathers_a_label_given_twice():
    assert run_metrics.group_run_specs(["h=a,b", "runs/d", "h=c"]) == {"h": ["a", "b", "c"], "d": ["runs/d"]}
    with pytest.raises(ValueError, match="expected DIR or LABEL"):
        run_metrics.group_run_specs(["=a"])
