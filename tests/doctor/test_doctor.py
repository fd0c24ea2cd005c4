"""`hapo doctor` on CPU: its CPU subset prints the table (every check a line with its figure),
exits 0 when nothing failed, and a failing check prints its fix and makes the exit status 1."""

import importlib.util
import os
import re

import pytest

from hapo_megatron.cli import main as hapo
from hapo_megatron.doctor import FAIL, PASS, CheckResult, format_table
from hapo_megatron.doctor.report import run_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "examples", "qwen2.5-math-7b", "config.yaml")


@pytest.fixture(scope="module")
def qwen7b_config_dir(tmp_path_factory):
    """Only config.json of a Qwen2.5-Math-7B-shaped model (no weights, no download)."""
    from transformers import Qwen2Config
    out = str(tmp_path_factory.mktemp("qwen7b"))
    Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, max_position_embeddings=4096,
                tie_word_embeddings=False).save_pretrained(out)
    return out


def _rows(out: str) -> dict:
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}(PASS|FAIL|SKIP)\s+\d+s\s+(.*)$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_cpu_subset_prints_its_table(capsys, qwen7b_config_dir):
    rc = hapo(["doctor", "--config", RECIPE, f"model.hf_model_path={qwen7b_config_dir}"])
    out = capsys.readouterr().out
    with capsys.disabled():  # the CPU table in the CI log
        print("\n" + out)
    rows = _rows(out)
    assert rc == 0, out
    for name in ("torch", "cuda devices", "import megatron.core", "import transformer_engine.pytorch",
                 "import sgl_kernel", "import flashinfer", "TE spec vs local", "logprob+entropy", "TP=2", "CP=2",
                 "SGLang server", "SGLang colocated sync (TP=2)", "memory plan"):
        assert name in rows, f"{name} missing from\n{out}"
    assert rows["torch"][0] == PASS and "torch 2." in rows["torch"][1]
    assert rows["import megatron.core"][0] == PASS
    for name in ("logprob+entropy", "TP=2", "CP=2"):  # measured on CPU
        assert rows[name][0] == PASS and "max |err|" in rows[name][1], rows[name]
    assert "gloo" in rows["TP=2"][1]
    assert rows["TE spec vs local"][0] == "SKIP"
    assert rows["packed == padded (TE THD)"][0] == "SKIP"
    assert rows["update TFLOP/s"][0] == "SKIP"  # GPU only (tests/doctor/test_throughput_check.py)
    if importlib.util.find_spec("sglang") is not None:  # a real CPU server, both CPU weight-sync modes
        assert rows["SGLang server"][0] == PASS, rows["SGLang server"]
        assert "tensor: generate" in rows["SGLang server"][1] and "disk: generate" in rows["SGLang server"][1]
        # what the asynchronous and over-sampling loops ask of a server (tests/doctor/test_sglang_plan.py)
        sglang_row = rows["SGLang server"][1]
        assert "async: in-place pause" in sglang_row and "abort/resume: abort at" in sglang_row
    assert rows["SGLang colocated sync (TP=2)"][0] == "SKIP"  # GPU only (tests/doctor/test_colocated.py)
    assert rows["memory plan"][0] == PASS and "GiB" in rows["memory plan"][1]
    assert "trainer state offloaded during generation: yes" in out  # the plan itself is printed
    assert re.search(r"\d+ passed, 0 failed, \d+ skipped", out)


def test_failing_checks_print_their_fix(capsys, qwen7b_config_dir):
    rc = hapo(["doctor", "--only", "memory", "--config", RECIPE, f"model.hf_model_path={qwen7b_config_dir}",
               "--device-memory-gb", "40"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert _rows(out)["memory plan"][0] == FAIL
    fix = [line for line in out.splitlines() if line.strip().startswith("fix:")]
    assert fix and "needs" in fix[0] and "GiB" in fix[0], out


def test_strict_imports_fail_with_the_image_fix(capsys):
    pytest.importorskip("megatron.core")
    try:
        import transformer_engine.pytorch  # noqa: F401
        pytest.skip("Transformer Engine is installed here: nothing fails")
    except ImportError:
        pass
    rc = hapo(["doctor", "--only", "imports", "--strict"])
    out = capsys.readouterr().out
    assert rc == 1
    assert _rows(out)["import transformer_engine.pytorch"][0] == FAIL
    assert "fix:" in out and "docs/docker.md" in out
    assert _rows(out)["import apex"][0] == "SKIP"  # optional: never a failure


def test_crashing_check_is_a_failure_with_the_default_fix():
    def boom():
        raise KeyError("x")
    r = run_check("boom", boom, "do this")
    assert r.status == FAIL and r.figure.startswith("KeyError: 'x'") and r.fix == "do this"
    table = format_table([r, CheckResult("ok", PASS, "1.0 TB/s")])
    assert "fix: do this" in table and "1 passed, 1 failed, 0 skipped" in table


def test_unknown_group_is_an_error(capsys):
    assert hapo(["doctor", "--only", "nope"]) == 2
    assert "unknown group" in capsys.readouterr().err
