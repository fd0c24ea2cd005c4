"""A hub model name (model.hf_model_path=org/name) trains from the real weights of its local
snapshot, exactly like the same model given as a directory; a model without weights refuses to
start unless model.random_init=true (models/hub.py, training/sources.initial_hf_weights)."""

import os
import shutil

import pytest

from hapo_megatron.training.metrics.sinks import read_jsonl, strip_timing
from tests.distributed import run_distributed
from tests.training.tiny_setup import ROOT, tiny_overrides, train_main

CONFIG = os.path.join(ROOT, "examples", "cpu_tiny", "config.yaml")
REPO = "tiny-org/tiny-math"
REVISION = "0123456789abcdef0123456789abcdef01234567"


def _offline_hub_cache(hf_home, model_dir):
    """The HF cache layout snapshot_download reads: hub/models--org--name/{refs/main, snapshots/<rev>/}."""
    repo = os.path.join(hf_home, "hub", "models--" + REPO.replace("/", "--"))
    shutil.copytree(model_dir, os.path.join(repo, "snapshots", REVISION))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(REVISION)
    return os.path.join(repo, "snapshots", REVISION)


def _step1(run_dir):
    recs = [strip_timing(r) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "rollout/reward_mean" in r]
    assert [r["step"] for r in recs] == [1], recs
    return recs[0]


def _argv(tiny, run_dir, model):
    kv = {"parallel.tensor_model_parallel_size": 1, "trainer.total_steps": 1, "trainer.sft_warmup_steps": 0,
          "model.hf_model_path": model, "data.tokenizer_path": "null"}
    return ["--config", CONFIG, *tiny_overrides(tiny, run_dir, **kv)]


def test_hub_name_trains_like_the_directory(tiny, tmp_path, monkeypatch):
    hf_home = str(tmp_path / "hf_home")
    snapshot = _offline_hub_cache(hf_home, os.path.join(tiny, "model"))
    # the spawned ranks import huggingface_hub afresh and read these
    monkeypatch.setenv("HF_HOME", hf_home)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    by_dir, by_name = str(tmp_path / "by_dir"), str(tmp_path / "by_name")
    assert run_distributed(train_main, 1, _argv(tiny, by_dir, snapshot), timeout=400) == [0]
    assert run_distributed(train_main, 1, _argv(tiny, by_name, REPO), timeout=400) == [0]
    first = _step1(by_dir)
    assert _step1(by_name) == first
    from hapo_megatron.config import load_config
    saved = load_config(os.path.join(by_name, "config.yaml"), [])
    assert saved.model.hf_model_path == snapshot and saved.data.tokenizer_path == snapshot


def test_hub_name_resolves_to_the_cached_snapshot(tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from hapo_megatron.models.hub import resolve_model_path
    hf_home = str(tmp_path / "hf_home")
    snapshot = _offline_hub_cache(hf_home, os.path.join(tiny, "model"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", os.path.join(hf_home, "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve_model_path(REPO) == snapshot
    assert resolve_model_path(tiny) == tiny  # a directory is itself
    with pytest.raises(ValueError, match=r"data.tokenizer_path: 'tiny-org/absent' is not a local directory "
                                         r"and is not in the HF cache"):
        resolve_model_path("tiny-org/absent", "data.tokenizer_path")
    with pytest.raises(FileNotFoundError, match="model.hf_model_path: '/no/such/dir' does not exist"):
        resolve_model_path("/no/such/dir")


def _config_only(tiny, tmp_path):
    """The tiny model's config and tokenizer without its weights."""
    out = tmp_path / "config_only"
    shutil.copytree(os.path.join(tiny, "model"), out,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.safetensors.index.json"))
    return str(out)


def test_model_without_weights_refuses_to_start(tiny, tmp_path, capsys):
    from hapo_megatron.train import main
    run_dir = tmp_path / "run"
    rc = main(_argv(tiny, str(run_dir), _config_only(tiny, tmp_path)))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "holds no weights" in err and "model.megatron_load_path" in err and "model.random_init=true" in err, err
    assert not run_dir.exists(), "work started before the error"


def test_random_init_is_a_choice(tiny, tmp_path):
    from hapo_megatron.config import load_config
    from hapo_megatron.train import preflight
    from hapo_megatron.training.sources import initial_hf_weights
    no_weights = _config_only(tiny, tmp_path)
    cfg = load_config(CONFIG, tiny_overrides(tiny, str(tmp_path / "run"), **{
        "parallel.tensor_model_parallel_size": 1, "model.hf_model_path": no_weights, "model.random_init": "true"}))
    preflight(cfg, 1)  # no error: asked for
    assert initial_hf_weights(cfg.model) is None
    cfg.model.random_init = False
    cfg.model.hf_model_path = os.path.join(tiny, "model")
    assert initial_hf_weights(cfg.model) == os.path.join(tiny, "model")
    with pytest.raises(ValueError, match="model.random_init=true and model.megatron_load_path"):
        load_config(CONFIG, tiny_overrides(tiny, str(tmp_path / "run"), **{
            "model.random_init": "true", "model.megatron_load_path": str(tmp_path)}))
