"""One line for every refusal (hapo_megatron/refusal.py; docs/troubleshooting.md, "Refusals"): every
entry point given a wrong path or a wrong key prints one line naming it and exits 2, without a
traceback. Nothing here builds a model: the refusals come before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hapo_megatron.cli import main as hapo
from tests.training.tiny_setup import ROOT

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")
MISSING = "/nonexistent/hapo-refusal-test"


def _commands(tmp):
    """(name, argv of `hapo`, what the line must name): a wrong path and a wrong key per command."""
    quiet_run = os.path.join(tmp, "run_without_rollouts")  # a run that saved no rollouts (the default)
    os.makedirs(quiet_run)
    with open(os.path.join(quiet_run, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "rollout/reward_mean": 0.1}) + "\n")
    with open(os.path.join(quiet_run, "config.yaml"), "w") as f:
        f.write("logging:\n  save_rollouts_interval: 0\n")
    out = os.path.join(tmp, "out")
    return [
        ("train path", ["train", "--config", MISSING + ".yaml"], MISSING),
        ("train key", ["train", "--config", CONFIG, "algo.adaptive_clp=true"], "algo.adaptive_clp"),
        ("train model path", ["train", "--config", CONFIG, f"model.hf_model_path={MISSING}"], MISSING),
        ("train option", ["train", "--config", CONFIG, "--resume-from", "x"], "--resume-from"),
        ("eval path", ["eval", "--model", MISSING, "--data", MISSING, "--out", out + ".json"], MISSING),
        ("eval option", ["eval", "--model", MISSING, "--data", MISSING, "--out", out, "--bogus"], "--bogus"),
        ("convert path", ["convert", "megatron-to-hf", "--megatron-path", MISSING, "--hf-model-path", out], MISSING),
        ("convert option", ["convert", "hf-to-megatron", "--hf-model-path", MISSING, "--megatron-path", out, "--bogus"],
         "--bogus"),
        ("analyze rollouts path", ["analyze", "rollouts", MISSING + ".jsonl"], MISSING),
        ("analyze rollouts dir", ["analyze", "rollouts", tmp], tmp),
        ("analyze plot-run path", ["analyze", "plot-run", MISSING, "--out", out], MISSING),
        ("analyze plot-tokens path", ["analyze", "plot-tokens", MISSING, "--out", out], MISSING),
        ("analyze plot-tokens no rollouts", ["analyze", "plot-tokens", quiet_run, "--out", out],
         "logging.save_rollouts_interval is 0"),
        ("analyze option", ["analyze", "rollouts", "--bogus", MISSING], "--bogus"),
        ("config show path", ["config", "show", "--config", MISSING + ".yaml"], MISSING),
        ("config show key", ["config", "show", "--config", CONFIG, "algo.adaptive_clp=true"], "algo.adaptive_clp"),
        ("data tokenizer path", ["data", "make-char-tokenizer", "--out", "/proc/nonexistent/tok"], "/proc/nonexistent"),
        ("data prepare path", ["data", "prepare", "math-500", "--out", out, "--from", MISSING, "--tokenizer", "none"],
         MISSING),
        ("data option", ["data", "make-arithmetic", "--out", out, "--n", "2", "--bogus"], "--bogus"),
    ]


def _one_line_refusal(rc, out, err, names, code=2):
    text = out + err
    assert "Traceback" not in text, text[-3000:]
    assert rc == code, (rc, text[-3000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and names in lines[0], lines


def test_every_hapo_command_refuses_in_one_line(tmp_path, capsys):
    """Mutations: `hapo analyze rollouts` without the path catch in analysis/cli.py (a
    FileNotFoundError traceback); run_tokens.load_records without the empty-rollouts check (exit 0
    with empty tables); a parser that is not refusal.OneLineParser (argparse's usage block)."""
    for name, argv, names in _commands(str(tmp_path)):
        try:
            rc = hapo(argv)
        except SystemExit as e:  # argparse errors exit
            rc = e.code
        captured = capsys.readouterr()
        try:
            # `hapo convert` refuses its inputs with 1 (convert/cli.py, tests/convert/test_cli.py)
            code = 1 if argv[0] == "convert" and "--bogus" not in argv else 2
            _one_line_refusal(rc, captured.out, captured.err, names, code)
        except AssertionError as e:
            raise AssertionError(f"{name}: hapo {' '.join(argv)}: {e}") from None
    assert not os.path.exists(os.path.join(str(tmp_path), "out"))  # a refusal writes nothing
    # `python -m hapo_megatron.analysis FILE` (= hapo analyze rollouts, without the hapo dispatcher)
    from hapo_megatron.analysis.cli import rollouts_main
    for path in (MISSING + ".jsonl", str(tmp_path)):
        rc = rollouts_main([path])
        captured = capsys.readouterr()
        _one_line_refusal(rc, captured.out, captured.err, path)


def _run(cmd, **env):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("bad, names", [("algo.adaptive_clp=true", "algo.adaptive_clp"),
                                        (f"model.hf_model_path={MISSING}", MISSING)])
def test_the_cpu_launcher_refuses_before_torchrun(bad, names, tmp_path):
    """examples/lib/train_cpu_example.sh (what examples/*/run.sh run after preparing their data)
    checks before torchrun: one line, exit 2, no rank started (mutation: without its `--check`
    step, torchrun's ChildFailedError report follows the line and the exit code is 1)."""
    rc, out, err = _run(["bash", "examples/lib/train_cpu_example.sh", "cpu_tiny", f"trainer.run_dir={tmp_path}", bad])
    _one_line_refusal(rc, out, err, names)
    assert "torch.distributed" not in out + err
    assert not os.listdir(tmp_path)


def test_a_rank_refusal_under_torchrun_names_itself(tmp_path):
    """`torchrun -m hapo_megatron.train` started by hand: rank 0 prints the one line (once, not
    per rank), no rank prints a traceback of ours, and the report torchrun adds gives that line as
    the root cause. torchrun itself still prints its ChildFailedError report and exits 1: torch
    2.13 raises it for any worker that exits non-zero (docs/troubleshooting.md, "Refusals")."""
    rc, out, err = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "-m", "hapo_megatron.train", "--config", CONFIG, f"trainer.run_dir={tmp_path}",
                         "algo.adaptive_clp=true"])
    text = out + err
    assert rc != 0
    ours = [line for line in text.splitlines() if line.startswith("hapo train: error: unknown config key")]
    assert len(ours) == 1, text[-3000:]
    assert "hapo_megatron" not in "".join(line for line in text.splitlines() if line.lstrip().startswith("File "))
    root_cause = text[text.index("Root Cause"):]
    assert "hapo train: error: unknown config key 'algo.adaptive_clp'" in root_cause, root_cause
