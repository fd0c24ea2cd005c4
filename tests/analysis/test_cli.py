"""`hapo analyze` wiring: every subcommand is reachable through the `hapo` command, takes the
options its docs give (docs/evaluation.md), and runs on tiny inputs; `python -m
hapo_megatron.analysis FILE` still gives the rollouts report."""

import json
import os
import subprocess
import sys

import pytest

from hapo_megatron import cli
from hapo_megatron.analysis import rollout_path, write_rollouts
from tests.analysis.fake_runs import seeded_run, write_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTIONS = {
    "rollouts": ["--tokenizer", "--top-k", "--pivot", "--json"],
    "compare": ["--variant", "--out", "--last-n", "--acc-key", "--baseline", "--rerun", "--command", "--tokens",
                "--roles", "--tokenizer", "--title", "--no-plots"],
    "paired-stats": ["--treatment", "--baseline", "--confidence", "--n-boot", "--seed", "--scale", "--json"],
    "plot-run": ["--out", "--smooth", "--dpi"],
    "plot-tokens": ["--out", "--roles", "--tokenizer", "--pivot"],
}


def _python(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)


def hapo(*args):
    return cli.main(["analyze", *map(str, args)])


def tiny_rollouts(run_dir, step=2):
    """One step's saved rollouts of two responses, with the per-token fields the reports read."""
    recs = [{"step": step, "uid": u, "response_ids": ids, "entropy": ent, "h_hat": h,
             "adv_before": [1.0] * len(ids), "adv_after": [1.0 + min(x, 0.0) for x in h],
             "temperatures": [1.0 + 0.05 * x for x in h]}
            for u, ids, ent, h in (("a", [5, 6, 7], [0.01, 0.9, 0.2], [-1.0, 1.0, 0.1]),
                                   ("b", [5, 8], [0.02, 0.5], [-0.5, 0.4]))]
    path = rollout_path(str(run_dir), step)
    write_rollouts(path, recs)
    return path


def test_hapo_lists_analyze_and_its_subcommands():
    res = _python("-m", "hapo_megatron.cli", "analyze", "--help")
    assert res.returncode == 0, res.stderr
    assert "usage: hapo analyze" in res.stdout
    for name in OPTIONS:
        assert name in res.stdout
    assert "analyze" in _python("-m", "hapo_megatron.cli", "--help").stdout


@pytest.mark.parametrize("name", list(OPTIONS))
def test_subcommand_help_gives_the_options(name, capsys):
    with pytest.raises(SystemExit) as exc:
        hapo(name, "--help")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: hapo analyze {name}" in out
    for option in OPTIONS[name]:
        assert option in out, (name, option)


def test_rollouts_report_and_the_module_entry(tmp_path, capsys):
    path = tiny_rollouts(tmp_path)
    assert hapo("rollouts", path, "--top-k", "2", "--json", tmp_path / "r.json") == 0
    assert "entropy histogram" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["metrics"]["diag/response_length_mean"] == 2.5
    res = _python("-m", "hapo_megatron.analysis", path, "--top-k", "2")
    assert res.returncode == 0, res.stderr
    assert "entropy histogram" in res.stdout


def test_compare_runs_from_the_command(tmp_path, capsys):
    a, b = seeded_run(tmp_path / "h1", 1, acc0=0.3), seeded_run(tmp_path / "d1", 1)
    a2, b2 = seeded_run(tmp_path / "h2", 2, acc0=0.35), seeded_run(tmp_path / "d2", 2, acc0=0.25)
    out = tmp_path / "cmp"
    assert hapo("compare", "--variant", f"hapo={a},{a2}", "--variant", f"dapo={b},{b2}", "--baseline", "dapo",
                "--out", out, "--no-plots", "--title", "T") == 0
    printed = capsys.readouterr().out
    assert "| hapo | 2 | 10 | 62.5 ± 3.5 |" in printed and "| hapo − dapo | held-out accuracy | 2 | +10.0 |" in printed
    assert (out / "results.md").read_text().startswith("# T\n") and not list(out.glob("*.png"))


def test_paired_stats_from_the_command(tmp_path, capsys):
    assert hapo("paired-stats", "0.05", "0.07", "0.06", "--json", tmp_path / "p.json") == 0
    out = capsys.readouterr().out
    assert "95% t-interval: [+0.0351586, +0.0848414] (t = 4.3027, df = 2)" in out
    assert "verdict: higher (by 3.5 to 8.5 points)" in out
    assert json.loads((tmp_path / "p.json").read_text())["seeds"] == [1, 2, 3]
    # paired by seed, not position; seed 3 has no baseline
    assert hapo("paired-stats", "--treatment", "2=0.7,1=0.6,3=0.9", "--baseline", "0.5,0.65", "--json",
                tmp_path / "q.json") == 0
    q = json.loads((tmp_path / "q.json").read_text())
    assert q["seeds"] == [1, 2] and q["differences"] == [pytest.approx(0.1), pytest.approx(0.05)]
    assert hapo("paired-stats", "--treatment", "0.6,0.7") == 2
    assert hapo("paired-stats", "--treatment", "0.6,x", "--baseline", "0.5,0.6") == 2
    assert hapo("paired-stats", "0.1") == 2  # one difference: no interval
    assert "at least 2 paired differences" in capsys.readouterr().err


def test_plot_run_from_the_command(tmp_path, capsys):
    run = write_run(tmp_path / "r", steps=3)
    assert hapo("plot-run", run, "--out", tmp_path / "plots", "--dpi", "40") == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1] == str(tmp_path / "plots" / "overview.png") and all(os.path.exists(p) for p in printed)
    assert hapo("plot-run", tmp_path / "none", "--out", tmp_path / "plots") == 2


def test_plot_tokens_from_the_command(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run, steps=2)
    tiny_rollouts(run)
    assert hapo("plot-tokens", f"hapo={run}", "--out", tmp_path / "tok") == 0
    out = capsys.readouterr().out
    assert "| hapo | 5 | " in out and str(tmp_path / "tok" / "entropy_hist.png") in out
    assert json.loads((tmp_path / "tok" / "tokens.json").read_text())["tokens"]["hapo"]["num_tokens"] == 5
    assert hapo("plot-tokens", str(run), "--out", tmp_path / "tok", "--roles", "steps") == 2  # needs --tokenizer
