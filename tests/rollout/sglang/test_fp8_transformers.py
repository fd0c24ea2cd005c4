"""A disk-sync FP8 checkpoint loads, dequantised, in transformers, and its logits stay within a
bound derived from E4M3 rounding of the bf16 model's (docs/fp8.md, docs/testing.md).

transformers 5.24's own FP8 loader (``FineGrainedFP8Config(dequantize=True)``) needs
``accelerate``, which the stack does not install, so the checkpoint is dequantised by
``fp8_weights.dequantized_state_dict`` and loaded with ``load_state_dict(strict=True)``; the
dequantisation is cross-checked against transformers' own ``Fp8Dequantize`` op, bit for bit.

The bound. Let ``z(W)`` be the float32 logits as a function of the FP8-quantised weights ``W``
(attention, MLP and expert matrices; everything else is identical in both models), ``W' =
dequant(quant(W))``. Per weight, ``|W'_ij - W_ij| <= e_ij = max(2^-4 |W_ij|, 2^-10 s_ij)`` (half an
E4M3 ulp: 3 mantissa bits for normal values, the subnormal spacing 2^-9 times the block scale
``s`` below; tests/rollout/test_fp8.py checks it). Taylor at ``W``:
``z_k(W') - z_k(W) = sum_ij dz_k/dW_ij (W'_ij - W_ij) + R_k``, so the first-order part is at most
``B_k = sum_ij |dz_k/dW_ij| e_ij`` whatever the rounding signs, computed here exactly with
autograd. ``R_k`` is second order: relative to the first-order term it is about the relative
weight error (2^-4) times the number of quantised matrices a path through the network multiplies
(4 per layer, 2 layers: 8), i.e. <= 1/2, so ``|dz_k| <= 1.5 B_k``, plus the float32 rounding of
two forward passes (1e-5 of the largest logit). The bound can fail: a scale transposed or applied
to the wrong blocks, or a wrong dequantisation, moves logits by far more."""

import json

import pytest
import torch

from hapo_megatron.models.hf_config import write_tiny_char_model
from hapo_megatron.rollout.sglang import engine as se
from hapo_megatron.rollout.fp8 import dequantize_blockwise
from hapo_megatron.rollout.fp8_weights import dequantized_state_dict, is_fp8_weight, scale_name

from .fake_sglang import FakeSession

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=128)


def disk_sync_fp8(tmp_path, arch: str, **overrides):
    """The bf16 model dir and the dir an FP8 engine's disk sync writes from its weights."""
    from transformers import AutoModelForCausalLM

    from hapo_megatron.convert import per_expert_state

    src = tmp_path / "bf16"
    write_tiny_char_model(str(src), arch, seed=0, dtype=torch.bfloat16, **SHAPE, **overrides)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
    state = per_expert_state(model.state_dict())  # the trainer's export: HF on-disk names
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    eng = se.SGLangEngine(session=FakeSession(), launch=False, server_urls=["http://a:1"], colocate=False,
                          weight_sync="disk", disk_sync_dir=str(tmp_path / "sync"), model_path=str(src),
                          quantization="fp8")
    eng.update_weights(iter(state.items()))
    return src, tmp_path / "sync"


def load_dequantized(src, fp8_dir):
    """A float32 transformers model from the FP8 dir: its config (the quantization_config taken
    out: dequantised weights are plain tensors) and its dequantised tensors, strictly."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hapo_megatron.convert import fused_expert_state

    config = AutoConfig.from_pretrained(str(fp8_dir))
    assert config.quantization_config["quant_method"] == "fp8"
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = fused_expert_state(dequantized_state_dict(str(fp8_dir)))
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


def test_dequantisation_matches_transformers_own_fp8_op(tmp_path):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from hapo_megatron.convert import load_hf_state_dict

    _, fp8_dir = disk_sync_fp8(tmp_path, "qwen3")
    raw = load_hf_state_dict(str(fp8_dir))
    op = Fp8Dequantize(None)
    pairs = [n for n in raw if is_fp8_weight(n)]
    assert len(pairs) == 2 * 7
    for n in pairs:
        ours = dequantize_blockwise(raw[n], raw[scale_name(n)])
        assert torch.equal(op._dequantize_one(raw[n], raw[scale_name(n)], torch.float32), ours), n


@pytest.mark.parametrize("arch, overrides", [("qwen3", {}), ("qwen2", {}),
                                             ("qwen3_moe", {"moe_intermediate_size": 128})])
def test_fp8_disk_checkpoint_loads_in_transformers(tmp_path, arch, overrides):
    """Every family (Qwen3-MoE experts, Qwen2's tied embeddings and biases) loads strictly; the
    router, norms and embeddings are the bf16 ones exactly, every FP8 weight within E4M3 rounding."""
    from transformers import AutoModelForCausalLM

    src, fp8_dir = disk_sync_fp8(tmp_path, arch, **overrides)
    assert json.loads((fp8_dir / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    fp8 = load_dequantized(src, fp8_dir).state_dict()
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).state_dict()
    assert set(fp8) == set(ref)
    changed = [n for n in ref if not torch.equal(fp8[n], ref[n])]
    assert changed and all(".self_attn." in n and n.endswith("proj.weight") or ".mlp." in n for n in changed)
    for n in ref:
        if "norm" in n or "embed" in n or "lm_head" in n or n.endswith(("mlp.gate.weight", ".bias")):
            assert torch.equal(fp8[n], ref[n]), n
        else:
            assert torch.allclose(fp8[n], ref[n], rtol=2 ** -4, atol=float(ref[n].abs().max()) / 448 * 2 ** -10), n


def first_order_bound(model, ids: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, z)``: ``B_k = sum_ij |dz_k/dW_ij| e_ij`` for every logit of the last ``positions``
    positions of ``ids`` (module docstring), ``e`` from the block scales of the quantised weights
    (amax / 448 per 128 x 128 block), and those logits ``z``."""
    from hapo_megatron.rollout.fp8 import quantize_blockwise

    def half_ulp(w):
        _, s = quantize_blockwise(w)
        s_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        return torch.maximum(w.abs() * 2.0 ** -4, s_full * 2.0 ** -10)

    # transformers fuses the experts ([E, 2I, H] gate|up, [E, H, I] down); with I a multiple of
    # 128 the blocks of each expert's fused gate|up are those of its gate and up
    params = {n: p for n, p in model.named_parameters()
              if is_fp8_weight(n) or n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))}
    err = {n: torch.stack([half_ulp(e) for e in w.detach()]) if w.dim() == 3 else half_ulp(w.detach())
           for n, w in params.items()}
    logits = model(input_ids=ids).logits[0, -positions:]  # [positions, V]
    flat = logits.reshape(-1)
    bound = torch.empty_like(flat)
    for k in range(flat.numel()):
        grads = torch.autograd.grad(flat[k], list(params.values()), retain_graph=True)
        bound[k] = sum((g.abs() * err[n]).sum() for g, n in zip(grads, params))
    return bound.reshape(logits.shape).detach(), logits.detach()


@pytest.mark.parametrize("arch, overrides", [("qwen3", {}), ("llama", {}),
                                             ("qwen3_moe", {"moe_intermediate_size": 128})])
def test_fp8_logits_within_the_e4m3_rounding_bound(tmp_path, arch, overrides):
    """Qwen3-MoE: the bound holds while both models route every token to the same experts (the
    top-k is not differentiable); the bf16 routers make that so here, and it is checked."""
    from transformers import AutoModelForCausalLM

    src, fp8_dir = disk_sync_fp8(tmp_path, arch, **overrides)
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    fp8 = load_dequantized(src, fp8_dir)
    ids = torch.tensor([[1, 17, 5, 42, 9, 33]])
    if arch == "qwen3_moe":
        with torch.no_grad():
            routes = [[r.topk(ref.config.num_experts_per_tok, dim=-1).indices.sort(dim=-1).values
                       for r in m(input_ids=ids, output_router_logits=True).router_logits] for m in (ref, fp8)]
        assert len(routes[0]) == ref.config.num_hidden_layers
        assert all(torch.equal(a, b) for a, b in zip(*routes))
    bound, z = first_order_bound(ref, ids, positions=1)  # the sampled position; each costs V backward passes
    with torch.no_grad():
        dz = (fp8(input_ids=ids).logits[0, -1:] - z).abs()
    print(f"{arch}: max |dz| {float(dz.max()):.3g}, max |dz| / B {float((dz / bound).max()):.3g}")
    slack = 1e-5 * float(z.abs().max())
    assert (dz <= 1.5 * bound + slack).all(), float((dz - 1.5 * bound).max())
    assert float(dz.max()) > 0  # the weights did change: the comparison is not vacuous
