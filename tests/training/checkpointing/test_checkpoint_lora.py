"""A LoRA run's checkpoints: adapter-only, resumed exactly, resharded across layouts.

Saved at TP=2 (2 ranks) after 2 optimizer steps, then 2 more steps; resumed from the checkpoint
- at TP=2 again: the adapters, their Adam state and the next 2 steps' loss, grad norm and merged
  weights equal the uninterrupted run's bit for bit;
- at TP=1 (1 rank) and at DP=2: the adapters and their Adam state load exactly (resharding only
  moves numbers), the next 2 steps match to float32 rounding (`RTOL`/`ATOL` of the full-model
  reshard test, whose reasoning holds here: same loss, same Adam eps).
The checkpoint holds no tensor of the frozen base, and records the base's path and weights hash.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.training.checkpointing.test_checkpoint_reshard import (ADAM_EPS, ATOL, RTOL, _manager, _portable,
                                                                  _train, _weights)
from tests.training.tiny_setup import prepare_tiny

STEPS = 2
LORA_STATE = ("param", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return prepare_tiny(str(tmp_path_factory.mktemp("tiny")), n_train=8, n_val=2)


def _build(data: str, *, tp: int = 1):
    from transformers import AutoConfig

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.models.lora import LoraSettings
    from hapo_megatron.parallel.groups import initialize_parallel
    from hapo_megatron.training.actor import MegatronActor

    g = initialize_parallel(tp=tp, seed=5)
    path = os.path.join(data, "model")
    optim = OptimConfig(lr=1e-2, lr_warmup_steps=0, weight_decay=0.01, adam_eps=ADAM_EPS)
    lora = LoraSettings(rank=4, alpha=8.0, dropout=0.0, init="kaiming_uniform",
                        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    return g, MegatronActor(AutoConfig.from_pretrained(path), groups=g, optim=optim, total_optimizer_steps=10,
                            init_hf_path=path, dtype="fp32", use_te=None, sequence_parallel=False,
                            recompute_activations=False, use_distributed_optimizer=True, fused_output_layer=False,
                            moe_aux_loss_coef=None, lora=lora)


def _adapter_state(g, actor) -> dict:
    """Every adapter matrix and its Adam moments, whole (gathered over DP and TP), by name."""
    import torch.distributed as dist

    from hapo_megatron.models.lora import lora_layers
    (opt,) = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    ranges = {p: r["param"] for maps in opt.gbuf_ranges for per_dtype in maps.values()
              for bucket in per_dtype for p, r in bucket["param_map"].items()}
    out: dict[str, np.ndarray] = {}
    names = {id(layer): n for n, layer in actor.model[0].named_modules()}
    for layer in lora_layers(actor.model):
        for name, p in layer.lora.named_parameters():
            flat = {k: torch.zeros(p.numel()) for k in LORA_STATE}
            if p in ranges:  # this DP rank's share of the state
                st, r = opt._get_main_param_and_optimizer_states(p), ranges[p]
                for k in LORA_STATE:
                    flat[k][r.start:r.end] = st[k].detach().float()
            axis = layer.lora.tp_axis(name)
            for k in LORA_STATE:
                dist.all_reduce(flat[k], group=opt.data_parallel_group)
                local = flat[k].view(p.shape)
                if axis is not None and g.tp_size > 1:
                    parts = [torch.empty_like(local) for _ in range(g.tp_size)]
                    dist.all_gather(parts, local.contiguous(), group=g.tp)
                    local = torch.cat(parts, dim=axis)
                out[f"{names[id(layer)].split('decoder.', 1)[1]}.{name}.{k}"] = local.numpy().copy()
    out["step"] = sorted({float(st["step"]) for st in opt.optimizer.state.values()})
    return out


def _save_at_tp2(rank, world, data, root):
    g, actor = _build(data, tp=2)
    _train(g, actor, STEPS)
    saved = _adapter_state(g, actor)
    path = _manager(root, g).save(STEPS, rl_state={}, save_model=actor.save)
    after = _train(g, actor, STEPS)
    return _portable(dict(saved=saved, after=after, final=_weights(g, actor), path=path))


def _resume(rank, world, data, root, tp):
    from hapo_megatron.training.checkpointing.checkpoint import find_latest
    g, actor = _build(data, tp=tp)
    _manager(root, g).load(find_latest(root), load_model=actor.load)
    loaded = _adapter_state(g, actor)
    after = _train(g, actor, STEPS)
    return _portable(dict(loaded=loaded, after=after, final=_weights(g, actor)))


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    return root, run_distributed(_save_at_tp2, 2, tiny, root, timeout=400)[0]


def test_checkpoint_holds_the_adapters_only_and_records_the_base(tiny, saved):
    from megatron.core.dist_checkpointing import load_tensors_metadata

    from hapo_megatron.models.lora_checkpoint import base_weights_hash, read_record
    _, ref = saved
    model_dir = os.path.join(ref["path"], "model")
    keys = list(load_tensors_metadata(model_dir))
    assert keys and all(".lora." in k for k in keys), [k for k in keys if ".lora." not in k][:5]
    assert any(k.startswith("optimizer") for k in keys) and any(not k.startswith("optimizer") for k in keys)
    record = read_record(model_dir)
    base = os.path.join(tiny, "model")
    assert record["base_model_path"] == os.path.abspath(base)
    assert record["base_weights_hash"] == base_weights_hash(base)
    assert (record["rank"], record["alpha"], len(record["target_modules"])) == (4, 8.0, 7)


@pytest.mark.parametrize("world,tp", [(2, 2), (1, 1), (2, 1)], ids=["same-layout", "tp1", "dp2"])
def test_lora_resume_exact_and_across_layouts(tiny, saved, world, tp):
    root, ref = saved
    out = run_distributed(_resume, world, tiny, root, tp, timeout=400)[0]
    assert out["loaded"]["step"] == ref["saved"]["step"] == [float(STEPS)]
    assert out["loaded"].keys() == ref["saved"].keys()
    for name in ref["saved"]:
        if name != "step":  # resharding only moves numbers
            assert np.array_equal(out["loaded"][name], ref["saved"][name]), name
    assert any(np.abs(ref["saved"][n]).max() > 0 for n in ref["saved"] if n.endswith("b_q_proj.param"))
    if (world, tp) == (2, 2):  # the same layout: the uninterrupted run, bit for bit
        assert out["after"] == ref["after"]
        for name in ref["final"]:
            assert np.array_equal(out["final"][name], ref["final"][name]), name
        return
    np.testing.assert_allclose(np.array(out["after"]), np.array(ref["after"]), rtol=RTOL, atol=ATOL)
    for name in ref["final"]:
        np.testing.assert_allclose(out["final"][name], ref["final"][name], rtol=RTOL, atol=ATOL, err_msg=name)

