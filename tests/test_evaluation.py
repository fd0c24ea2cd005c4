"""Tests of hapo_megatron.training.benchmark_accuracy: pass@k / avg@k math and evaluate() end to end."""

import itertools
import math
from fractions import Fraction
from types import SimpleNamespace

import pytest

from hapo_megatron.training.benchmark_accuracy import (PromptResult, aggregate_results, avg_at_k,
                                                       default_k_values, evaluate, format_results_table,
                                                       generate_and_score, pass_at_k)
from tests.rollout.standin_engine import StandInEngine


def brute_pass_at_k(correct, k):
    """Fraction of k-subsets of the samples that hold at least one correct sample."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    hits = sum(any(correct[i] for i in s) for s in subsets)
    return Fraction(hits, len(subsets))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_pass_at_k_matches_subset_enumeration(n):
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            expected = float(brute_pass_at_k(correct, k))
            assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_stable():
    # C(1000, 500) overflows floats; the product form does not. Exact value via Fractions.
    n, c, k = 1000, 3, 500
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(1000, 0, 10) == 0.0
    assert pass_at_k(1000, 991, 10) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)


@pytest.mark.parametrize("args", [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_bad_input(args):
    with pytest.raises(ValueError):
        pass_at_k(*args)


def test_avg_at_k_hand_cases():
    acc = [True, False, True, True, False, False, False, True]
    assert avg_at_k(acc, 1) == 1.0
    assert avg_at_k(acc, 2) == 0.5
    assert avg_at_k(acc, 4) == 0.75
    assert avg_at_k(acc, 8) == 0.5
    assert avg_at_k([0.0, 1.0, 1.0], 3) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="k"):
        avg_at_k(acc, 9)


def test_default_k_values():
    assert default_k_values(8) == (1, 2, 4, 8)
    assert default_k_values(1) == (1,)
    assert default_k_values(6) == (1, 2, 4, 6)
    assert default_k_values(16) == (1, 2, 4, 8, 16)


def _pr(source, acc, lengths=None, uid="u"):
    lengths = lengths or [10] * len(acc)
    return PromptResult(uid=uid, data_source=source, ground_truth="1", acc=list(acc),
                        scores=[1.0 if a else -1.0 for a in acc], response_lengths=lengths,
                        truncated=[False] * len(acc))


def test_aggregate_results_per_source_and_macro_average():
    results = [
        _pr("math", [1, 1, 0, 0], [4, 6, 8, 10], uid="a"),
        _pr("math", [0, 0, 0, 1], [2, 2, 2, 2], uid="b"),
        _pr("aime", [0, 0, 0, 0], [100, 100, 100, 100], uid="c"),
    ]
    m = aggregate_results(results, k_values=[1, 2, 4])
    # avg@1: first samples 1 and 0 -> 0.5; avg@4: (0.5 + 0.25) / 2.
    assert m["eval/math/avg@1"] == 0.5
    assert m["eval/math/avg@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert m["eval/math/avg@4"] == pytest.approx(0.375)
    # pass@2 for (n=4, c=2): 1 - C(2,2)/C(4,2) = 5/6; (n=4, c=1): 1 - C(3,2)/C(4,2) = 1/2.
    assert m["eval/math/pass@2"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    assert m["eval/math/pass@4"] == 1.0
    assert m["eval/aime/pass@4"] == 0.0
    assert m["eval/math/response_length_mean"] == pytest.approx(36 / 8)
    assert m["eval/math/response_length_max"] == 10
    assert m["eval/math/num_prompts"] == 2
    assert m["eval/math/reward_mean"] == pytest.approx((3 - 5) / 8)
    assert m["eval/all/avg@4"] == pytest.approx((0.375 + 0.0) / 2)
    assert m["eval/all/response_length_mean"] == pytest.approx((4.5 + 100) / 2)
    table = format_results_table(m)
    assert "math" in table and "aime" in table and "avg@4" in table
    assert table.splitlines()[-1].startswith("all")


def test_aggregate_results_skips_k_beyond_n_and_rejects_empty():
    m = aggregate_results([_pr("s", [1, 0])], k_values=[1, 2, 8])
    assert "eval/s/pass@8" not in m and "eval/s/pass@2" in m
    with pytest.raises(ValueError):
        aggregate_results([])


# ---------------------------------------------------------------- evaluate() with a fake engine
class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


class FakeEngine(StandInEngine):
    """Returns canned responses per prompt (keyed by the prompt's text)."""

    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def generate(self, prompt_ids, params, on_samples=None):
        self.calls.append((len(prompt_ids), params))
        out = []
        for i, ids in enumerate(prompt_ids):
            texts = self.answers["".join(map(chr, ids))][: params.n]
            out.append([SimpleNamespace(prompt_ids=ids, response_ids=[ord(c) for c in t] + [0],
                                        rollout_logprobs=[], temperatures=[],
                                        finish_reason="stop" if t.endswith("}") else "length",
                                        prompt_index=i) for t in texts])
        return out


class ListDataset:
    def __init__(self, rows):
        self.rows = rows
        self.tokenizer = CharTokenizer()

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        text, gt, source = self.rows[i]
        return SimpleNamespace(uid=f"p{i}", prompt_ids=[ord(c) for c in text], prompt_text=text,
                               ground_truth=gt, data_source=source)


def _sampling(n, **kw):
    from hapo_megatron.rollout.engine import SamplingParams

    return SamplingParams(n=n, temperature=0.5, top_p=0.7, top_k=-1, max_new_tokens=32, **kw)


def _real_reward():
    from hapo_megatron.rewards import compute_score

    return compute_score


def test_evaluate_with_fake_engine_and_real_reward():
    reward = _real_reward()
    answers = {
        "1+1": ["The answer is \\boxed{2}", "\\boxed{3}", "\\boxed{2}", "so \\boxed{2}"],
        "2*3": ["\\boxed{6}", "\\boxed{5}", "\\boxed{7}", "\\boxed{8"],
        "half": ["\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{1/3}", "\\boxed{2}"],
    }
    data = ListDataset([("1+1", "2", "arith"), ("2*3", "6", "arith"), ("half", "1/2", "frac")])
    engine = FakeEngine(answers)
    m = evaluate(engine, data, reward, _sampling(4), k_values=[1, 2, 4], batch_size=2,
                 reward_kwargs={"score_format": "pm1"})
    assert [c[0] for c in engine.calls] == [2, 1]
    # arith: accs [1,0,1,1] and [1,0,0,0]; frac: 0.5 == 1/2 by math equivalence -> [1,1,0,0].
    assert m["eval/arith/avg@4"] == pytest.approx((0.75 + 0.25) / 2)
    assert m["eval/arith/avg@1"] == 1.0
    assert m["eval/arith/pass@2"] == pytest.approx((1 - 0 / 6 + 1 - 3 / 6) / 2)
    assert m["eval/frac/avg@4"] == pytest.approx(0.5)
    assert m["eval/frac/pass@1"] == pytest.approx(0.5)
    assert m["eval/arith/truncated_ratio"] == pytest.approx(1 / 8)
    assert m["eval/all/avg@4"] == pytest.approx((0.5 + 0.5) / 2)
    lens = [len(t) + 1 for k in ("1+1", "2*3") for t in answers[k]]
    assert m["eval/arith/response_length_mean"] == pytest.approx(sum(lens) / len(lens))


def test_generate_and_score_keeps_text_and_normalises_reward_types():
    data = ListDataset([("q", "x", "s")])
    engine = FakeEngine({"q": ["x}", "y}"]})

    def reward(text, gt):  # dict form
        return {"score": float(text.startswith(gt)), "acc": text.startswith(gt)}

    res = generate_and_score(engine, data, reward, _sampling(2), keep_text=True)
    assert res[0].acc == [True, False] and res[0].responses == ["x}", "y}"]
    res = generate_and_score(engine, data, lambda t, g: 1.0 if t[0] == g else -1.0, _sampling(2))
    assert res[0].acc == [True, False] and res[0].scores == [1.0, -1.0]


def test_generate_and_score_forces_fixed_temperature_and_checks_input():
    from hapo_megatron.rollout.engine import SamplingParams

    data = ListDataset([("q", "x", "s")])
    engine = FakeEngine({"q": ["x}"]})
    params = SamplingParams(n=1, temperature=0.5, top_p=0.7, top_k=-1, max_new_tokens=8, adaptive=True,
                            temperature_tau=0.05, h_hat_mode="signed")
    generate_and_score(engine, data, lambda t, g: 1.0, params)
    assert engine.calls[0][1].adaptive is False
    with pytest.raises(ValueError, match="batch_size"):
        generate_and_score(engine, data, lambda t, g: 1.0, params, batch_size=0)


# ---------------------------------------------------------------- hapo eval (evaluate.py)
@pytest.fixture(scope="module")
def tiny_model_and_data(tmp_path_factory):
    import torch
    import transformers

    from hapo_megatron.data import build_char_tokenizer, write_arithmetic_dataset
    from hapo_megatron.models import tiny_hf_config

    root = tmp_path_factory.mktemp("eval_cli")
    model_dir = str(root / "model")
    tok = build_char_tokenizer(model_dir)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(
        tiny_hf_config("llama", vocab_size=len(tok))).save_pretrained(model_dir)
    a = write_arithmetic_dataset(str(root / "a.jsonl"), 3, 0)
    b = write_arithmetic_dataset(str(root / "b.parquet"), 2, 1, data_source="arith_b")
    return root, model_dir, [a, b]


def test_hapo_eval_cli_tiny_model(tiny_model_and_data, capsys):
    import json

    from hapo_megatron.cli import main as hapo_main

    root, model_dir, data = tiny_model_and_data
    out = root / "res.json"
    rc = hapo_main(["eval", "--model", model_dir, "--data", *data, "--n", "2",
                    "--max-new-tokens", "4", "--out", str(out), "--save-responses",
                    "--device", "cpu"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "arith_b" in table and "pass@2" in table
    res = json.loads(out.read_text())
    s = res["sampling"]
    assert (s["n"], s["temperature"], s["top_p"], s["adaptive"]) == (2, 0.5, 0.7, False)
    assert res["metrics"]["eval/arithmetic/num_prompts"] == 3
    assert res["metrics"]["eval/arith_b/num_prompts"] == 2
    assert all(len(p["responses"]) == 2 for p in res["per_prompt"])
    assert all(max(p["response_lengths"]) <= 4 for p in res["per_prompt"])


class OracleEngine(StandInEngine):
    """Answers sample 0 correctly (from the prompt's expression), the others wrongly."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def generate(self, prompt_ids, params, on_samples=None):
        import re

        from hapo_megatron.rollout.engine import Sample

        out = []
        for i, ids in enumerate(prompt_ids):
            text = self.tok.decode(ids, skip_special_tokens=True)
            expr = re.search(r"Compute (.+?)\. End", text).group(1)
            value = eval(expr, {"__builtins__": {}})  # digits and + - * only
            group = []
            for j in range(params.n):
                ans = value if j == 0 else value + 1
                resp = self.tok.encode(f"Answer: {ans}", add_special_tokens=False)
                group.append(Sample(prompt_ids=ids, response_ids=resp,
                                    rollout_logprobs=[0.0] * len(resp), temperatures=[],
                                    finish_reason="stop", prompt_index=i, sample_index=j))
            out.append(group)
        return out


def test_hapo_eval_cli_scores_with_real_reward(tiny_model_and_data, monkeypatch):
    import json

    import hapo_megatron.rollout.factory as engine_mod
    from hapo_megatron.evaluate import main

    root, model_dir, data = tiny_model_and_data
    monkeypatch.setattr(engine_mod, "make_engine",
                        lambda cfg, *, tokenizer, **kw: OracleEngine(tokenizer))
    out = root / "oracle.json"
    assert main(["--model", model_dir, "--data", *data, "--n", "4", "--k", "1", "2", "4",
                 "--out", str(out), "--batch-size", "2"]) == 0
    m = json.loads(out.read_text())["metrics"]
    assert m["eval/arithmetic/avg@1"] == 1.0 and m["eval/arithmetic/avg@4"] == 0.25
    assert m["eval/arith_b/pass@2"] == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert m["eval/all/pass@4"] == 1.0 and m["eval/all/avg@4"] == 0.25


def test_hapo_eval_rejects_bad_model_paths(tmp_path, capsys):
    from hapo_megatron.evaluate import main

    data = str(tmp_path / "x.jsonl")
    assert main(["--model", str(tmp_path / "nope"), "--data", data, "--out", "o.json"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["--model", str(tmp_path / "empty"), "--data", data, "--out", "o.json"]) == 2
    assert "neither an HF model directory" in capsys.readouterr().err


_MEGATRON_EVAL_SCRIPT = r"""
import json, sys
from hapo_megatron.convert.cli import main as convert
from hapo_megatron.evaluate import main as evaluate
model, data, root = sys.argv[1], sys.argv[2:-1], sys.argv[-1]
assert convert(["hf-to-megatron", "--hf-model-path", model, "--megatron-path", root + "/mg"]) == 0
common = ["--data", *data, "--n", "2", "--max-new-tokens", "5", "--seed", "3", "--save-responses"]
assert evaluate(["--model", root + "/mg", "--convert-dir", root + "/mg_hf",
                 "--out", root + "/mg.json", *common]) == 0
assert evaluate(["--model", model, "--out", root + "/hf.json", *common]) == 0
# without --convert-dir: converted into a temporary directory, removed after success and after an error
assert evaluate(["--model", root + "/mg", "--out", root + "/mg2.json", *common]) == 0
try:
    evaluate(["--model", root + "/mg", "--out", root + "/mg3.json", "--data", root + "/no_such.jsonl"])
except Exception as e:
    print("failed as expected:", type(e).__name__, e)
"""


def test_hapo_eval_megatron_checkpoint_matches_hf(tiny_model_and_data, tmp_path):
    """A Megatron checkpoint is converted and evaluated like the HF model it came from (fp32,
    same seed -> the same sampled responses). Runs in a subprocess: conversion initialises
    torch.distributed and Megatron's parallel state."""
    import json
    import os
    import subprocess
    import sys

    _, model_dir, data = tiny_model_and_data
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.run([sys.executable, "-c", _MEGATRON_EVAL_SCRIPT, model_dir, *data,
                           str(tmp_path)], env=env, capture_output=True, text=True, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "failed as expected" in proc.stdout, proc.stdout[-2000:]
    # the conversions without --convert-dir left nothing in the temp dir (mutation: mkdtemp, as
    # before, leaves a hapo_eval_hf_* directory per evaluation)
    assert [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("hapo_eval_hf_")] == []
    mg = json.loads((tmp_path / "mg.json").read_text())
    hf = json.loads((tmp_path / "hf.json").read_text())
    assert mg["model_source"].startswith("megatron:") and hf["model_source"] == "hf"
    assert [p["responses"] for p in mg["per_prompt"]] == [p["responses"] for p in hf["per_prompt"]]
    assert mg["metrics"] == hf["metrics"]


def test_hapo_eval_sglang_settings_reach_make_engine(tiny_model_and_data, monkeypatch):
    """--engine/--sglang-url/--set become the RolloutConfig handed to make_engine (no server)."""
    import hapo_megatron.rollout.factory as engine_mod
    from hapo_megatron.evaluate import main

    root, model_dir, data = tiny_model_and_data
    seen = {}

    def fake_make_engine(cfg, *, hf_config_or_path, tokenizer, device, dtype, **kw):
        seen.update(cfg=cfg, path=hf_config_or_path, device=device, dtype=dtype, kw=kw)
        return OracleEngine(tokenizer)

    monkeypatch.setattr(engine_mod, "make_engine", fake_make_engine)
    assert main(["--model", model_dir, "--data", data[0], "--n", "1", "--out",
                 str(root / "sg.json"), "--sglang-url", "http://10.0.0.1:30000",
                 "--set", "rollout.sglang.request_timeout_s=7", "--device", "cpu",
                 "--dtype", "bf16", "--api-key-file", "/run/rollout_api_key"]) == 0
    cfg = seen["cfg"]
    assert cfg.engine == "sglang" and cfg.sglang.server_urls == ["http://10.0.0.1:30000"]
    assert seen["kw"] == {"key_file": "/run/rollout_api_key"}  # the engine reads the servers' key there
    assert cfg.sglang.request_timeout_s == 7
    assert seen["path"] == model_dir and str(seen["dtype"]) == "torch.bfloat16"


def test_find_megatron_checkpoint_layouts(tmp_path):
    """Run dir, checkpoints dir, step dir and dist-ckpt dir all resolve to the newest model/."""
    from hapo_megatron.evaluate import find_megatron_checkpoint

    root = tmp_path / "run" / "checkpoints"
    for step, complete in ((1, True), (2, True), (3, False)):
        model = root / f"step_{step:06d}" / "model"
        model.mkdir(parents=True)
        (model / "metadata.json").write_text("{}")
        if complete:
            (root / f"step_{step:06d}" / "COMPLETE").write_text("")
    (root / "latest").write_text("step_000002")
    want = str(root / "step_000002" / "model")
    with pytest.warns(UserWarning, match="half-written"):
        assert find_megatron_checkpoint(str(tmp_path / "run")) == want
        assert find_megatron_checkpoint(str(root)) == want
    assert find_megatron_checkpoint(str(root / "step_000001")) == str(root / "step_000001" / "model")
    assert find_megatron_checkpoint(want) == want
    with pytest.raises(ValueError, match="neither"):
        find_megatron_checkpoint(str(tmp_path))


def test_hf_config_found_in_saved_run_config(tmp_path):
    from hapo_megatron.config import load_config, save_config
    from hapo_megatron.evaluate import _hf_config_from_run

    save_config(load_config(None, ["model.hf_model_path=/models/qwen"]),
                str(tmp_path / "run" / "config.yaml"))
    step = tmp_path / "run" / "checkpoints" / "step_000004" / "model"
    step.mkdir(parents=True)
    assert _hf_config_from_run(str(step)) == "/models/qwen"
    assert _hf_config_from_run(str(tmp_path / "run")) == "/models/qwen"


def test_hapo_eval_launches_sglang_at_the_trained_context(tiny_model_and_data, monkeypatch):
    """`model.max_position_embeddings` (here from --set) reaches the servers hapo eval launches as
    --context-length and the model override (training/context_length.py), so prompts past the base
    model's context are served (mutation: without the sglang_context_args line in evaluate.run the
    servers get no --context-length). Attached servers (--sglang-url) are left as they are."""
    import hapo_megatron.rollout.factory as engine_mod
    from hapo_megatron.evaluate import main

    root, model_dir, data = tiny_model_and_data
    seen = {}

    def fake_make_engine(cfg, *, hf_config_or_path, tokenizer, device, dtype, **kw):
        seen["cfg"] = cfg
        return OracleEngine(tokenizer)

    monkeypatch.setattr(engine_mod, "make_engine", fake_make_engine)
    common = ["--model", model_dir, "--data", data[0], "--n", "1", "--out", str(root / "ctx.json"), "--device", "cpu",
              "--set", "model.max_position_embeddings=1024"]
    assert main([*common, "--engine", "sglang"]) == 0
    args = seen["cfg"].sglang.extra_server_args
    assert args[args.index("--context-length") + 1] == "1024"
    assert '{"max_position_embeddings": 1024}' in args
    assert main([*common, "--sglang-url", "http://10.0.0.1:30000"]) == 0
    assert "--context-length" not in seen["cfg"].sglang.extra_server_args


def test_eval_context_comes_from_the_run_of_a_megatron_checkpoint(tmp_path):
    from hapo_megatron.config import load_config, save_config
    from hapo_megatron.evaluate import eval_context_length

    save_config(load_config(None, ["model.max_position_embeddings=16384"]), str(tmp_path / "run" / "config.yaml"))
    step = tmp_path / "run" / "checkpoints" / "step_000004" / "model"
    step.mkdir(parents=True)
    assert eval_context_length(load_config(None, []), str(tmp_path / "run")) == 16384
    assert eval_context_length(load_config(None, []), str(step)) == 16384
    assert eval_context_length(load_config(None, ["model.max_position_embeddings=8192"]), str(step)) == 8192
    hf_export = tmp_path / "run" / "export"  # an HF directory declares its own context in config.json
    hf_export.mkdir()
    (hf_export / "config.json").write_text("{}")
    assert eval_context_length(load_config(None, []), str(hf_export)) is None


_SIGTERM_EVAL_SCRIPT = r"""
import os, sys
from hapo_megatron import evaluate

def held(args, convert_dir):  # the conversion has started in the temporary directory; hold there
    os.makedirs(convert_dir)
    print("converting in", convert_dir, flush=True)
    sys.stdin.read()  # until the test's SIGTERM
evaluate._run = held
evaluate.run(evaluate.build_parser().parse_args(["--model", "/some/megatron/run", "--data", "x.jsonl",
                                               "--out", "x.json"]))
"""


def test_sigterm_during_hapo_eval_removes_its_temporary_conversion(tmp_path):
    """SIGTERM while a Megatron checkpoint is converted into the temporary directory: the
    directory is removed and the process exits 143 (without the handler it stays behind)."""
    import os
    import signal
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TMPDIR": str(tmp_path / "tmp")}
    proc = subprocess.Popen([sys.executable, "-c", _SIGTERM_EVAL_SCRIPT], env=env, cwd=repo, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline()
    assert line.startswith("converting in"), (line, proc.stderr.read() if proc.poll() is not None else "")
    assert os.path.isdir(line.split()[-1])
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith("hapo_eval_hf_")] == []


# ---------------------------------------------------------------- --protocol hapo-paper
class _SpyEngine(OracleEngine):
    """OracleEngine that records the sampling parameters of every call."""

    calls: list = []

    def generate(self, prompt_ids, params, on_samples=None):
        _SpyEngine.calls.append(params)
        return super().generate(prompt_ids, params, on_samples)


# config values unlike every protocol setting, so that a setting the protocol drops shows
OTHER_CONFIG = ["--set", "rollout.val_n=3", "--set", "rollout.val_temperature=0.9", "--set", "rollout.val_top_p=0.95",
                "--set", "rollout.max_response_length=64", "--set", "data.max_prompt_length=300"]


def _spy_run(tiny_model_and_data, monkeypatch, name, *extra):
    import json

    import hapo_megatron.data as data_mod
    import hapo_megatron.rollout.factory as engine_mod
    from hapo_megatron.evaluate import main

    root, model_dir, data = tiny_model_and_data
    _SpyEngine.calls = []
    monkeypatch.setattr(engine_mod, "make_engine", lambda cfg, *, tokenizer, **kw: _SpyEngine(tokenizer))
    seen = {}
    real = data_mod.PromptDataset

    def dataset(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)
    monkeypatch.setattr(data_mod, "PromptDataset", dataset)
    out = root / f"{name}.json"
    assert main(["--model", model_dir, "--data", *data, "--out", str(out), *OTHER_CONFIG, *extra]) == 0
    return json.loads(out.read_text()), _SpyEngine.calls, seen


def test_hapo_paper_protocol_reaches_the_engine(tiny_model_and_data, monkeypatch):
    res, calls, seen = _spy_run(tiny_model_and_data, monkeypatch, "paper", "--protocol", "hapo-paper")
    assert calls and all((p.n, p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.adaptive) ==
                         (8, 0.5, 0.7, -1, 10240, False) for p in calls)
    assert seen["max_prompt_length"] == 1024 and res["protocol"] == "hapo-paper"
    m = res["metrics"]
    # avg@8 (the paper's number) and pass@8 only; the oracle answers 1 of 8 samples correctly
    assert {k.rsplit("/", 1)[1] for k in m if "@" in k} == {"avg@8", "pass@8"}
    assert m["eval/all/avg@8"] == 1 / 8 and m["eval/all/pass@8"] == 1.0
    # without the protocol the config's validation sampling applies; an explicit option beats both
    _, calls, seen = _spy_run(tiny_model_and_data, monkeypatch, "config")
    assert (calls[0].n, calls[0].temperature, calls[0].top_p, calls[0].max_new_tokens) == (3, 0.9, 0.95, 64)
    assert seen["max_prompt_length"] == 300
    _, calls, seen = _spy_run(tiny_model_and_data, monkeypatch, "explicit", "--protocol", "hapo-paper", "--n", "2",
                              "--top-k", "5", "--max-new-tokens", "12", "--max-prompt-length", "200")
    assert (calls[0].n, calls[0].temperature, calls[0].top_k, calls[0].max_new_tokens) == (2, 0.5, 5, 12)
    assert seen["max_prompt_length"] == 200


def test_hapo_paper_protocol_on_the_tiny_model(tiny_model_and_data, capsys):
    """The real HF engine on CPU under the protocol (the length cut for speed)."""
    import json

    from hapo_megatron.evaluate import main

    root, model_dir, data = tiny_model_and_data
    out = root / "paper_tiny.json"
    assert main(["--model", model_dir, "--data", data[0], "--protocol", "hapo-paper", "--max-new-tokens", "3",
                 "--limit", "2", "--device", "cpu", "--save-responses", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    s = res["sampling"]
    assert (s["n"], s["temperature"], s["top_p"], s["top_k"], s["max_new_tokens"]) == (8, 0.5, 0.7, -1, 3)
    assert all(len(p["responses"]) == 8 for p in res["per_prompt"]) and len(res["per_prompt"]) == 2
    assert "avg@8" in capsys.readouterr().out


def test_unknown_protocol_refused_in_one_line(capsys):
    from hapo_megatron.evaluate import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--data", "d", "--out", "o", "--protocol", "paper"])
    err = capsys.readouterr().err.strip()
    assert "--protocol" in err and "hapo-paper" in err and len(err.splitlines()) == 1
