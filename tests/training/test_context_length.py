"""Prompt + response against the model's context: a clear error at start naming both numbers and
the fields that change them, and model.max_position_embeddings applied the same way to the
Megatron/HF config, the SGLang server arguments and the HF export."""

import json
import os

import pytest

from hapo_megatron.config import HapoConfig
from hapo_megatron.train import main, preflight
from hapo_megatron.training.context_length import apply_context_override, check_sequence_fits, sglang_context_args
from tests.training.tiny_setup import ROOT, tiny_overrides

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")


def _cfg(prompt, response, override=None):
    return HapoConfig.from_dict({"data": {"max_prompt_length": prompt}, "rollout": {"max_response_length": response},
                                 "model": {"hf_model_path": "Qwen/Qwen2.5-Math-7B",
                                           "max_position_embeddings": override}})


class _HF:
    max_position_embeddings = 4096


def test_overflow_message_names_both_numbers_and_fields():
    with pytest.raises(ValueError) as e:
        check_sequence_fits(_HF(), _cfg(1024, 10240))
    msg = str(e.value)
    for part in ("11264", "4096", "data.max_prompt_length=1024", "rollout.max_response_length=10240",
                 "model.max_position_embeddings=11264", "Qwen/Qwen2.5-Math-7B"):
        assert part in msg, msg


def test_fits_and_override():
    check_sequence_fits(_HF(), _cfg(1024, 3072))  # exactly 4096
    check_sequence_fits(_HF(), _cfg(1024, 10240, override=11264))
    with pytest.raises(ValueError, match=r"model.max_position_embeddings=8192\)"):
        check_sequence_fits(_HF(), _cfg(1024, 10240, override=8192))
    hf = apply_context_override(_HF(), 11264)
    assert hf.max_position_embeddings == 11264
    assert apply_context_override(_HF(), None).max_position_embeddings == 4096


def test_sglang_servers_get_the_same_override():
    assert sglang_context_args(_cfg(1024, 10240), ["--x"]) == ["--x"]
    args = sglang_context_args(_cfg(1024, 10240, override=11264), ["--x"])
    assert args[:2] == ["--x", "--json-model-override-args"]
    assert json.loads(args[2]) == {"max_position_embeddings": 11264}
    assert args[3:] == ["--context-length", "11264"]
    with pytest.raises(ValueError, match="extra_server_args sets --context-length"):
        sglang_context_args(_cfg(1024, 10240, override=11264), ["--context-length=11264"])


def test_train_refuses_an_overflowing_config_at_start(tiny, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # one process: TP 1, so that the layout rules (checked first, validate_run) pass and the
    # context is what is refused
    rc = main(["--config", CONFIG, *tiny_overrides(tiny, str(run_dir)), "data.max_prompt_length=200",
               "rollout.max_response_length=100", "parallel.tensor_model_parallel_size=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "300 tokens" in err and "256 positions" in err, err
    assert "model.max_position_embeddings=300" in err and not run_dir.exists()


def test_override_reaches_the_model_config(tiny, tmp_path):
    from hapo_megatron.config import load_config
    from hapo_megatron.training.sources import load_hf_config
    cfg = load_config(CONFIG, tiny_overrides(tiny, str(tmp_path / "run")) + [
        "data.max_prompt_length=200", "rollout.max_response_length=100", "model.max_position_embeddings=300"])
    preflight(cfg, 2)  # passes with the override (the example runs TP=2)
    assert load_hf_config(cfg.model.hf_model_path, cfg.model.max_position_embeddings).max_position_embeddings == 300


def test_hf_export_flag_sets_the_override():
    from hapo_megatron.convert.cli import build_parser
    args = build_parser().parse_args(["megatron-to-hf", "--hf-model-path", "o", "--megatron-path", "m",
                                      "--max-position-embeddings", "11264"])
    assert args.max_position_embeddings == 11264
