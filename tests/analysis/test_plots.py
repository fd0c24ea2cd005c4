"""hapo_megatron.analysis.plots (`hapo analyze plot-run`) on synthetic metrics.jsonl files: the
PNGs written, panels without data skipped."""

import json
import os

from hapo_megatron.analysis import plots, run_metrics
from hapo_megatron.analysis.cli import main as analyze
from tests.analysis.fake_runs import write_run


def test_plot_run_cli_writes_pngs(tmp_path):
    a = write_run(tmp_path / "hapo_s1")
    b = write_run(tmp_path / "hapo_s2", acc0=0.3)
    c = write_run(tmp_path / "dapo", slope=0.0)
    out = tmp_path / "plots"
    assert analyze(["plot-run", f"hapo={a},{b}", c, "--out", str(out), "--smooth", "2"]) == 0
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
    paths = plots.plot_runs({"r": [run_metrics.load_metrics(str(run))]}, str(tmp_path / "o"))
    assert [os.path.basename(p) for p in paths] == ["entropy.png", "overview.png"]
