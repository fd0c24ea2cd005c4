"""LoRA adapters on Megatron-Core's tensor-parallel linear layers (`hapo_megatron.models.lora`).

On two gloo ranks, a tiny Qwen2 (GQA with 2 query groups, q/k/v biases, tied output) with adapters
on every linear layer of attention and MLP, its B matrices set non-zero from one full (TP1)
layout: TP2 gives TP1's logits and adapter gradients; B = 0 (the initialisation) and the
adapters switched off give exactly the base model; the merged export loaded into the HF model
gives the LoRA model's logits; the optimizer (distributed, DP2) holds the adapters only. A
column-parallel + row-parallel pair (an MLP) runs under sequence parallelism at TP2 against TP1
(the GPT model cannot be built with sequence parallelism on CPU: Megatron's torch norms refuse it).

Tolerances: two float32 paths (another TP split; fused vs per-projection matmuls; merged
``W + s B A`` vs ``W x + s B (A x)``) regroup sums of at most 128 products, a few ulps
(``2^-23`` relative) of each sum, carried through two layers' norms and residuals: ``RTOL`` of the
compared quantity's scale bounds that with room, while a wrong layout (an adapter on another
query group, a missing scaling, an un-reduced gradient) moves them by O(scale).
"""

import zlib

import numpy as np
import pytest
import torch

from tests.convert.dist_checks import random_hf_model
from tests.distributed import run_distributed

RTOL = 1e-5  # of the compared quantity's max |value| (see the module docstring)
ARCH, SEQ, BATCH = "qwen2", 8, 2
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _settings(targets=ALL, rank=4):
    from hapo_megatron.models.lora import LoraSettings
    return LoraSettings(rank=rank, alpha=8.0, dropout=0.0, targets=targets, init="kaiming_uniform")


def _full(name: str, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return 0.2 * torch.randn(*shape, generator=gen)


def _set_adapters(model, tp_rank: int, tp_size: int, prefix: str = "") -> None:
    """Every adapter matrix from one full layout (TP1 shapes), this rank's slice of it."""
    from hapo_megatron.models.lora import LoraAdapter
    for name, adapter in model.named_modules():
        if not isinstance(adapter, LoraAdapter):
            continue
        for n, p in adapter.named_parameters():
            axis = adapter.tp_axis(n)
            shape = list(p.shape)
            if axis is not None:
                shape[axis] *= tp_size
            full = _full(f"{prefix}{name}.{n}", shape)
            with torch.no_grad():
                p.copy_(full if axis is None else full.chunk(tp_size, dim=axis)[tp_rank])


def _adapter_grads(model) -> dict[str, np.ndarray]:
    """Every adapter gradient gathered to the full (TP1) layout, by parameter name."""
    import torch.distributed as dist
    out = {}
    for name, p in model.named_parameters():
        if ".lora." not in f".{name}":
            assert p.grad is None, name
            continue
        owner, _, pname = name.rpartition(".")
        adapter = model.get_submodule(owner)
        axis, g = adapter.tp_axis(pname), p.grad
        if axis is not None and adapter.tp_size > 1:
            parts = [torch.empty_like(g) for _ in range(adapter.tp_size)]
            dist.all_gather(parts, g.contiguous(), group=adapter.tp_group)
            g = torch.cat(parts, dim=axis)
        out[name] = g.numpy().copy()
    return out


def _logits(model, ids, g):
    """Full-vocab logits ``[b, s, V]`` (gathered over TP) and the model's output."""
    import torch.distributed as dist
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    out = model(ids, pos, None)
    parts = [torch.empty_like(out) for _ in range(g.tp_size)]
    dist.all_gather(parts, out.detach().contiguous(), group=g.tp)
    return torch.cat(parts, dim=-1), out


def _gpt_layout(tp: int) -> dict:
    import torch.distributed as dist

    from hapo_megatron.convert import gather_hf_state_dict, load_hf_weights_into_mcore
    from hapo_megatron.models import build_gpt_model
    from hapo_megatron.models.lora import adapters_disabled, freeze_base
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel

    g = initialize_parallel(tp=tp, seed=5)
    cfg, hf = random_hf_model(ARCH)
    models = {}
    for kind in ("base", "init", "lora"):
        m = build_gpt_model(cfg, sequence_parallel=False, use_te=False, lora=None if kind == "base" else _settings())
        load_hf_weights_into_mcore(m, hf.state_dict(), cfg, tp_rank=g.tp_rank, tp_size=tp)
        models[kind] = m
    trainable = freeze_base(models["lora"])
    _set_adapters(models["lora"], g.tp_rank, tp)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base, _ = _logits(models["base"], ids, g)
        init, _ = _logits(models["init"], ids, g)
        with adapters_disabled(models["lora"]):
            off, _ = _logits(models["lora"], ids, g)
    lora, out = _logits(models["lora"], ids, g)
    # a loss that is a sum over the vocab shards: each rank backpropagates its own part
    weights = _full("loss", lora.shape).chunk(tp, dim=-1)[g.tp_rank]
    (out * weights).sum().backward()
    grads = _adapter_grads(models["lora"])
    exported = {k: v.numpy().copy() for k, v in gather_hf_state_dict(models["lora"], cfg, tp_group=g.tp).items()}
    destroy_parallel()
    return dict(exact_init=torch.equal(init, base), exact_off=torch.equal(off, base), lora=lora.numpy(),
                base=base.numpy(), grads=grads, exported=exported if dist.get_rank() == 0 else None,
                ids=ids, trainable=trainable)


def _mlp_layout(tp: int, sp: bool) -> dict:
    """A LoRA column-parallel fc1 (gate/up) + row-parallel fc2 (down) under TP (and SP)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from hapo_megatron.models.lora import _lora_class, lora_layers
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel

    g = initialize_parallel(tp=tp, seed=5)
    H, FF, S = 32, 48, 8
    config = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=FF, num_attention_heads=4,
                               tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True,
                               add_bias_linear=False, gated_linear_unit=True)
    s = _settings(("gate_proj", "up_proj", "down_proj"))
    init = torch.nn.init.zeros_
    fc1 = _lora_class(ColumnParallelLinear, s, "linear_fc1")(H, 2 * FF, config=config, init_method=init,
                                                             gather_output=False, bias=False, skip_bias_add=True,
                                                             is_expert=False, tp_group=g.tp)
    fc2 = _lora_class(RowParallelLinear, s, "linear_fc2")(FF, H, config=config, init_method=init, bias=False,
                                                         input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                                         tp_group=g.tp)
    with torch.no_grad():  # base weights from full tensors in Megatron's layouts (fc1: cat(gate_r, up_r))
        gate, up = _full("gate", (FF, H)), _full("up", (FF, H))
        fc1.weight.copy_(torch.cat([gate.chunk(tp)[g.tp_rank], up.chunk(tp)[g.tp_rank]]))
        fc2.weight.copy_(_full("down", (H, FF)).chunk(tp, dim=1)[g.tp_rank])
    for m in (fc1, fc2):
        m.weight.requires_grad_(False)
        _set_adapters(m, g.tp_rank, tp, prefix=m.lora.role)
    x = _full("x", (S, 2, H))
    x_local = x.chunk(tp)[g.tp_rank] if sp else x
    h, _ = fc1(x_local)
    a, b = h.chunk(2, dim=-1)
    y, _ = fc2(F.silu(a) * b)
    w = _full("w", (S, 2, H))
    (y * (w.chunk(tp)[g.tp_rank] if sp else w)).sum().backward()
    for layer in lora_layers([fc1, fc2]):  # finalize_model_grads' TP all-reduce of sequence-parallel params
        for p in layer.lora.parameters():
            if sp and getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=g.tp)
    parts = [torch.empty_like(y) for _ in range(tp if sp else 1)]
    if sp:
        dist.all_gather(parts, y.detach().contiguous(), group=g.tp)
    y_full = torch.cat(parts) if sp else y.detach()
    grads = {}
    for prefix, m in (("fc1", fc1), ("fc2", fc2)):
        grads.update({f"{prefix}.{k}": v for k, v in _adapter_grads(m).items()})
    destroy_parallel()
    return dict(y=y_full.numpy(), grads=grads)


def _ranks(rank, world_size):
    return {"gpt": {tp: _gpt_layout(tp) for tp in (1, 2)},
            "mlp": {name: _mlp_layout(tp, sp) for name, tp, sp in (("tp1", 1, False), ("tp2", 2, False),
                                                                   ("tp2-sp", 2, True))}}


def _close(got, want, what):
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert err <= RTOL * scale, f"{what}: max |diff| {err:.3g} > {RTOL} * {scale:.3g}"


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_ranks, 2, timeout=600)


def test_tp2_gives_tp1_logits_and_adapter_gradients(runs):
    one, two = runs[0]["gpt"][1], runs[0]["gpt"][2]
    assert not np.allclose(one["lora"], one["base"], atol=1e-3)  # the adapters change the model
    _close(two["lora"], one["lora"], "logits TP2 vs TP1")
    assert one["grads"].keys() == two["grads"].keys() and len(one["grads"]) == 2 * 2 * 7  # layers x (A, B) x parts
    for name, g in one["grads"].items():
        assert np.abs(g).max() > 0, name
        _close(two["grads"][name], g, f"gradient of {name} TP2 vs TP1")
    for rank in runs:  # both TP ranks agree on the replicated gradients
        for name, g in rank["gpt"][2]["grads"].items():
            np.testing.assert_array_equal(g, runs[0]["gpt"][2]["grads"][name])


def test_zero_b_and_disabled_adapters_give_exactly_the_base_model(runs):
    for rank in runs:
        for tp, r in rank["gpt"].items():
            assert r["exact_init"], f"B = 0 at init changes the output at TP{tp}"
            assert r["exact_off"], f"adapters_disabled is not the base model at TP{tp}"
    assert runs[0]["gpt"][1]["trainable"] == ADAPTER_VALUES


# A and B of 7 projections in 2 layers, r * (in + out) each (hidden 64, FFN 128, q 64, k/v 32, rank 4)
ADAPTER_VALUES = 2 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))


def _actor(rank, world_size):
    """A LoRA actor at DP2 with the distributed optimizer: what its buffers and optimizer hold, and
    its adapters-off reference against a base actor."""
    from hapo_megatron.config.training_sections import OptimConfig
    from hapo_megatron.models import tiny_hf_config
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel
    from hapo_megatron.training.actor import MegatronActor

    g = initialize_parallel(tp=1, seed=5)
    actor = MegatronActor(tiny_hf_config(ARCH), groups=g, optim=OptimConfig(lr=1e-2, lr_warmup_steps=0),
                          total_optimizer_steps=2, dtype="fp32", use_te=False, sequence_parallel=False,
                          recompute_activations=False, use_distributed_optimizer=True, fused_output_layer=True,
                          moe_aux_loss_coef=None, lora=_settings())
    ddp = actor.model[0]
    in_buffers = [n for n, p in ddp.module.named_parameters() if p in ddp.param_to_bucket_group]
    trainable = [n for n, p in ddp.module.named_parameters() if p.requires_grad]
    held = sum(p.numel() for group in actor.optimizer.param_groups for p in group["params"])
    out = dict(in_buffers=sorted(in_buffers), trainable=sorted(trainable), held=held,
               metrics=actor.step_metrics(), reference=type(actor.base_reference()).__name__)
    # the KL reference's log-probs (adapters off) are exactly a base actor's with the same weights
    base = MegatronActor(tiny_hf_config(ARCH), groups=g, optim=OptimConfig(lr=1e-2, lr_warmup_steps=0),
                         total_optimizer_steps=2, dtype="fp32", use_te=False, sequence_parallel=False,
                         recompute_activations=False, use_distributed_optimizer=True, fused_output_layer=True,
                         moe_aux_loss_coef=None)
    base.model[0].module.load_state_dict({k: v for k, v in ddp.module.state_dict().items() if ".lora." not in k})
    _set_adapters(ddp.module, 0, 1)
    mbs = _micro_batches(tiny_hf_config(ARCH).vocab_size)
    lp = {name: [x[0] for x in a.compute_logprobs_entropy(mbs, temperature=1.0, model=model)]
          for name, a, model in (("policy", actor, None), ("reference", actor, actor.base_reference()),
                                 ("base", base, None))}
    out["reference_is_base"] = all(torch.equal(r, b) for r, b in zip(lp["reference"], lp["base"]))
    out["policy_moved"] = min(float((p - b).abs().max()) for p, b in zip(lp["policy"], lp["base"]))
    destroy_parallel()
    return out


def _micro_batches(vocab: int) -> list:
    """Two unequal micro-batches of response tokens."""
    from hapo_megatron.training.batches.micro_batches import SequenceData, build_rank_micro_batches
    gen = torch.Generator().manual_seed(0)
    seqs = [SequenceData(torch.randint(4, vocab, (5 + i,), generator=gen).tolist(),
                         torch.randint(4, vocab, (3 + 2 * i,), generator=gen).tolist(), index=i) for i in range(3)]
    return build_rank_micro_batches(seqs, dp_rank=0, dp_size=1, micro_batch_size=2, max_tokens_per_micro_batch=None)


def test_only_the_adapters_train_and_the_reference_is_the_base_model():
    from hapo_megatron.models import tiny_hf_config

    ranks = run_distributed(_actor, 2, timeout=300)
    cfg = tiny_hf_config(ARCH)
    # Megatron's embedding holds the vocab padded to a multiple of 128 (models.gpt.padded_vocab_size)
    total = sum(p.numel() for p in random_hf_model(ARCH)[1].parameters()) + (256 - 160) * cfg.hidden_size
    for r in ranks:
        assert r["trainable"] == r["in_buffers"] and r["trainable"]
        assert all(".lora." in n for n in r["trainable"]), r["trainable"]
        assert len(r["trainable"]) == 2 * cfg.num_hidden_layers * 7  # A and B of 7 projections per layer
        assert 0 < r["held"] < ADAPTER_VALUES  # each DP rank holds its shard only
        assert r["metrics"] == {"actor/trainable_params": ADAPTER_VALUES,
                                "actor/total_params": total + ADAPTER_VALUES}
        assert r["reference"] == "AdaptersOff"
        assert r["reference_is_base"] and r["policy_moved"] > 1e-3, r["policy_moved"]
    assert sum(r["held"] for r in ranks) == ADAPTER_VALUES


def test_merged_export_gives_the_lora_model_in_transformers(runs):
    cfg, hf = random_hf_model(ARCH)
    for tp in (1, 2):
        r = runs[0]["gpt"][tp]
        exported = r["exported"]
        base = {k: v for k, v in hf.state_dict().items() if k in exported}
        changed = [k for k in exported if not np.array_equal(exported[k], base[k].numpy())]
        assert sorted(changed) == sorted(k for k in exported if k.endswith("_proj.weight")), tp
        model = random_hf_model(ARCH)[1]
        model.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()}, strict=False)
        with torch.no_grad():
            logits = model(r["ids"]).logits.numpy()
        _close(r["lora"][..., :cfg.vocab_size], logits, f"HF logits of the merged export, TP{tp}")


HF_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
MEGATRON_OF = {"q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
               "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
               "gate_proj": "mlp.linear_fc1", "up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2"}


def test_each_adapter_lands_on_its_own_hf_projection(runs):
    """The exported q_proj is W_q + (alpha / r) B_q A_q with the full (TP1) adapter of q, and so on
    for every projection: the per-group interleaving of q/k/v and the gate/up halves of every TP
    shard put each adapter's rows where HF has them."""
    cfg, hf = random_hf_model(ARCH)
    base, s = hf.state_dict(), _settings()
    for tp in (1, 2):
        exported = runs[0]["gpt"][tp]["exported"]
        for layer in range(cfg.num_hidden_layers):
            for proj, w in ((p, base[f"model.layers.{layer}.{HF_OF[p]}.{p}.weight"]) for p in ALL):
                owner = f"decoder.layers.{layer}.{MEGATRON_OF[proj]}.lora"
                a = _full(f"{owner}.a_{proj}", (s.rank, w.shape[1]))
                b = _full(f"{owner}.b_{proj}", (w.shape[0], s.rank))
                want = (w + s.scaling * b @ a).numpy()
                _close(exported[f"model.layers.{layer}.{HF_OF[proj]}.{proj}.weight"], want, f"TP{tp} {proj}")


def test_sequence_parallel_adapters_match_one_rank(runs):
    mlp = runs[0]["mlp"]
    for layout in ("tp2", "tp2-sp"):
        _close(mlp[layout]["y"], mlp["tp1"]["y"], f"MLP output {layout}")
        assert mlp[layout]["grads"].keys() == mlp["tp1"]["grads"].keys()
        for name, g in mlp["tp1"]["grads"].items():
            _close(mlp[layout]["grads"][name], g, f"{layout} gradient of {name}")
