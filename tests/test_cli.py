"""The `hapo` command: help, config show/presets/docs, data commands, lazy dispatch."""

import os
import subprocess
import sys
import types

import pytest
import yaml

from hapo_megatron import cli
from hapo_megatron.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_hapo(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "hapo_megatron.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_help_lists_subcommands():
    res = run_hapo("--help")
    assert res.returncode == 0, res.stderr
    for name in ("train", "eval", "convert", "config", "data"):
        assert name in res.stdout


def test_config_show_prints_resolved_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  n: 4\n")
    res = run_hapo("config", "show", "--config", str(path), "--preset", "dapo", "algo.clip_ratio_high=0.3")
    assert res.returncode == 0, res.stderr
    shown = yaml.safe_load(res.stdout)
    assert shown == load_config(str(path), ["algo.clip_ratio_high=0.3"], preset="dapo").to_dict()
    assert shown["rollout"]["n"] == 4 and shown["algo"]["adv_estimator"] == "grpo"
    assert run_hapo("config", "show").returncode == 0


def test_config_show_bad_key_exits_2(capsys):
    assert cli.main(["config", "show", "algo.clip_ratio_hi=0.3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'algo.clip_ratio_hi'" in err and "clip_ratio_high" in err


def test_config_presets_and_docs(capsys):
    assert cli.main(["config", "presets", "-v"]) == 0
    out = capsys.readouterr().out
    assert "dapo+redistribution" in out and "algo.clip_ratio_high=0.28" in out
    assert cli.main(["config", "docs", "algo"]) == 0
    out = capsys.readouterr().out
    assert "algo.entropy_pivot = 0.8" in out
    fields = [line.split(" = ")[0] for line in out.splitlines() if " = " in line and not line.startswith(" ")]
    assert fields and all(f.startswith("algo.") for f in fields), fields  # the section's fields only
    assert cli.main(["config", "docs", "nosuch"]) == 2


def test_data_commands(tmp_path, capsys):
    out = tmp_path / "arith.jsonl"
    assert cli.main(["data", "make-arithmetic", "--out", str(out), "--n", "5", "--seed", "3", "--ops", "+"]) == 0
    lines = out.read_text().strip().splitlines()
    assert len(lines) == 5 and all("*" not in yaml.safe_load(l)["extra_info"]["expression"] for l in lines)
    tok_dir = tmp_path / "tok"
    assert cli.main(["data", "make-char-tokenizer", "--out", str(tok_dir)]) == 0
    assert (tok_dir / "tokenizer.json").exists()


def test_missing_module_is_an_error_not_a_skip(monkeypatch):
    monkeypatch.setitem(cli.DISPATCH, "train", ("hapo_megatron._no_such_module", "x"))
    with pytest.raises(ModuleNotFoundError, match="_no_such_module"):
        cli.main(["train", "--config", "x.yaml"])


def test_dispatch_passes_argv_untouched(monkeypatch):
    seen = {}
    fake = types.ModuleType("hapo_megatron._fake_convert")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "hapo_megatron._fake_convert", fake)
    monkeypatch.setitem(cli.DISPATCH, "convert", ("hapo_megatron._fake_convert", "x"))
    assert cli.main(["convert", "hf-to-megatron", "--hf", "a", "--help"]) == 0
    assert seen["argv"] == ["hf-to-megatron", "--hf", "a", "--help"]


def test_dependency_import_errors_are_not_hidden(monkeypatch):
    # a dispatched module that exists but fails to import a dependency must raise, not say "not available"
    def boom(name):
        raise ModuleNotFoundError("No module named 'some_dep'", name="some_dep")

    monkeypatch.setattr(cli.importlib, "import_module", boom)
    with pytest.raises(ModuleNotFoundError, match="some_dep"):
        cli.main(["eval"])
