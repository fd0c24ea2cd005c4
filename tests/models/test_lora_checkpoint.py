"""The base-model record of LoRA checkpoints (`models.lora_checkpoint`): the weights hash and the
refusals of a resume under another base or other adapter settings."""

from __future__ import annotations

import os

import pytest
import torch

from hapo_megatron.models.lora import LoraSettings
from hapo_megatron.models.lora_checkpoint import (base_weights_hash, check_resume, lora_record, read_record,
                                                  write_record)

TARGETS = ("q_proj", "v_proj")


def _model(path, *, shard: str = "5GB", nudge: bool = False):
    from transformers import AutoModelForCausalLM

    from hapo_megatron.models import tiny_hf_config
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(tiny_hf_config("llama", num_hidden_layers=2))
    if nudge:  # one value of one tensor
        with torch.no_grad():
            m.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    m.save_pretrained(path, max_shard_size=shard)
    return str(path)


def _settings(rank=4, alpha=8.0, targets=TARGETS):
    return LoraSettings(rank=rank, alpha=alpha, dropout=0.0, targets=targets, init="kaiming_uniform")


def test_hash_is_the_tensors_not_the_files(tmp_path):
    one = _model(tmp_path / "one")
    sharded = _model(tmp_path / "sharded", shard="20KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert base_weights_hash(one) == base_weights_hash(sharded)
    assert base_weights_hash(_model(tmp_path / "nudged", nudge=True)) != base_weights_hash(one)


@pytest.fixture
def checkpoint(tmp_path):
    base = _model(tmp_path / "base")
    ckpt = tmp_path / "step_000002"
    os.makedirs(ckpt / "model")
    write_record(str(ckpt / "model"), lora_record(_settings(), base, base_weights_hash(base)))
    return str(ckpt), base


def test_resume_on_the_same_base_and_settings_passes(checkpoint, tmp_path):
    ckpt, base = checkpoint
    check_resume(ckpt, _settings(), base)
    check_resume(ckpt, _settings(), _model(tmp_path / "copy", shard="20KB"))  # the same weights, other files
    assert read_record(os.path.join(ckpt, "model"))["base_model_path"] == os.path.abspath(base)


@pytest.mark.parametrize("settings,field", [(_settings(rank=2), "model.lora.rank=2"),
                                            (_settings(alpha=16.0), "model.lora.alpha=16.0"),
                                            (_settings(targets=("q_proj",)), "model.lora.target_modules"),
                                            (None, "model.lora.rank=0")])
def test_other_adapter_settings_are_refused(checkpoint, settings, field):
    ckpt, base = checkpoint
    with pytest.raises(ValueError) as e:
        check_resume(ckpt, settings, base)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_another_base_is_refused_in_one_line(checkpoint, tmp_path):
    ckpt, _ = checkpoint
    other = _model(tmp_path / "other", nudge=True)
    with pytest.raises(ValueError) as e:
        check_resume(ckpt, _settings(), other)
    msg = str(e.value)
    assert msg.startswith(f"model.hf_model_path={other}: its weights") and "\n" not in msg
    assert "not the base the LoRA checkpoint" in msg


def test_full_checkpoint_with_lora_on_is_refused(tmp_path):
    ckpt = tmp_path / "step_000002"
    os.makedirs(ckpt / "model")
    with pytest.raises(ValueError, match=r"^model.lora.rank=4: .* without LoRA"):
        check_resume(str(ckpt), _settings(), None)
    check_resume(str(ckpt), None, None)  # full fine-tuning resumes its own checkpoints
