"""`hapo convert megatron-to-hf` of a LoRA run's (adapter-only) checkpoint: the merged HF model and
the PEFT adapter directory (loaded with peft onto the base) both compute the trained policy.

The policy: a tiny model with rank-4 adapters on every linear layer, trained 2 steps at TP=2 (so B
is no longer zero), saved by the trainer's checkpoint manager. Its logits come from the Megatron
model itself (adapters applied in the forward pass, gathered over TP); the exports are converted
at TP=1 (merged) and TP=2 (peft) and run with transformers / peft. Float32 throughout: merged
``W + s B A`` vs ``W x + s B (A x)`` differ by summation order only, `LOGIT_ATOL`.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.training.checkpointing.test_checkpoint_lora import _build
from tests.training.checkpointing.test_checkpoint_reshard import _manager, _train
from tests.training.tiny_setup import prepare_tiny

LOGIT_ATOL = 1e-4  # float32 logits of magnitude ~1 after 2 layers of hidden 32: rounding is ~1e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return prepare_tiny(str(tmp_path_factory.mktemp("tiny")), n_train=8, n_val=2)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def _train_save_and_logits(rank, world, data, root):
    import torch.distributed as dist

    from hapo_megatron.convert import unwrap_model
    g, actor = _build(data, tp=2)
    _train(g, actor, 2)
    path = _manager(root, g).save(2, rl_state={}, save_model=actor.save)
    model = unwrap_model(actor.model[0]).eval()
    ids = _ids(actor.hf_config.vocab_size)
    with torch.no_grad():
        local = model(ids, torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids), None)
    parts = [torch.empty_like(local) for _ in range(g.tp_size)]
    dist.all_gather(parts, local.contiguous(), group=g.tp)
    logits = torch.cat(parts, dim=-1)[..., : actor.hf_config.vocab_size]
    return {"path": path, "logits": logits.numpy()}


def _convert(rank, world, argv):
    from hapo_megatron.convert.cli import main
    return main(argv)


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return run_distributed(_train_save_and_logits, 2, tiny, root, timeout=400)[0]


def _hf_logits(model, vocab: int) -> np.ndarray:
    with torch.no_grad():
        return model(_ids(vocab)).logits.float().numpy()


def test_merged_export_computes_the_trained_policy(tiny, trained, tmp_path):
    from transformers import AutoModelForCausalLM
    out = str(tmp_path / "merged")
    argv = ["megatron-to-hf", "--megatron-path", os.path.join(trained["path"], "model"), "--hf-model-path", out]
    assert run_distributed(_convert, 1, argv, timeout=400) == [0]
    hf = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    got = _hf_logits(hf, hf.config.vocab_size)
    np.testing.assert_allclose(got, trained["logits"], atol=LOGIT_ATOL, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(os.path.join(tiny, "model"), torch_dtype=torch.float32).eval()
    assert np.abs(_hf_logits(base, hf.config.vocab_size) - trained["logits"]).max() > 100 * LOGIT_ATOL


def test_peft_adapter_on_the_base_computes_the_trained_policy(tiny, trained, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    out = str(tmp_path / "peft")
    argv = ["megatron-to-hf", "--megatron-path", os.path.join(trained["path"], "model"), "--hf-model-path", out,
            "--lora-format", "peft", "--tp", "2"]
    assert run_distributed(_convert, 2, argv, timeout=400) == [0, 0]
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(os.path.join(out, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", 4, 8.0)
    keys = load_file(os.path.join(out, "adapter_model.safetensors"))
    assert len(keys) == 2 * 7 * 2  # layers x projections x (A, B)
    base = AutoModelForCausalLM.from_pretrained(os.path.join(tiny, "model"), torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out).eval()
    got = _hf_logits(model, base.config.vocab_size)
    np.testing.assert_allclose(got, trained["logits"], atol=LOGIT_ATOL, rtol=0)


def test_another_base_is_refused(tiny, trained, tmp_path, capsys):
    from hapo_megatron.convert.cli import main
    from transformers import AutoModelForCausalLM
    other = str(tmp_path / "other")
    m = AutoModelForCausalLM.from_pretrained(os.path.join(tiny, "model"))
    with torch.no_grad():
        m.lm_head.weight[0, 0] += 1.0
    m.save_pretrained(other)
    capsys.readouterr()
    argv = ["megatron-to-hf", "--megatron-path", os.path.join(trained["path"], "model"),
            "--hf-model-path", str(tmp_path / "out"), "--lora-base", other]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: --lora-base: the weights in") and "not the base" in err and "\n" not in err
