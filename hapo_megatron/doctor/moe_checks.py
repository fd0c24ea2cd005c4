"""The GPU speed settings of MoE policies against their unfused paths (GPU with Transformer Engine
only; docs/moe.md, "GPU speed settings"): a tiny Qwen3-MoE with TE's layer spec, built once with
every fused path off and once with one of them on (grouped MLP, fused token permutation, fused
RoPE), the same HF weights in both; bf16 logits of a padded batch and of a packed (THD) row, and
the gradient norm of a padded batch, compared. The padded batch goes in with its padding mask, as
the trainer sends it (`MegatronActor`, `models/moe_padding.py`): TE's fused permute then sees pads
in every router call (a routing map that loses their rows failed there, docs/moe.md "Padding and
fillers")."""

from __future__ import annotations

import torch

from hapo_megatron.doctor.report import FAIL, PASS, SKIP, CheckResult

LOGIT_TOL = 5e-2  # bf16 kernels (grouped vs per-expert GEMMs, fused vs unfused RoPE) on logits of size ~1
GRAD_TOL = 5e-2  # relative difference of the gradient norms
UNFUSED = dict(moe_grouped_gemm=False, moe_permute_fusion=False, apply_rope_fusion=False)
# (check name, the one setting switched on against UNFUSED)
FUSED_PATHS = (("MoE grouped GEMM", "moe_grouped_gemm"), ("MoE permute fusion", "moe_permute_fusion"),
               ("RoPE fusion (THD too)", "apply_rope_fusion"))
FIX = ("the fused path disagrees with the unfused one: report the versions (hapo doctor --only env,imports) "
       "and train with model.use_te=false meanwhile")


def _build(hf_config, state, fused: dict):
    from hapo_megatron.convert import load_hf_weights_into_mcore
    from hapo_megatron.models import build_gpt_model
    m = build_gpt_model(hf_config, dtype=torch.bfloat16, use_te=True, sequence_parallel=False, **fused).cuda()
    load_hf_weights_into_mcore(m, state, hf_config, tp_rank=0, tp_size=1)
    return m


def _outputs(model, hf_config, device: str = "cuda"):
    """(padded logits, packed-row logits of the same sequences, gradient norm of the padded pass)."""
    from hapo_megatron.training.actor import packed_seq_params_of
    from hapo_megatron.training.batches.micro_batches import SequenceData, collate, collate_packed
    gen = torch.Generator().manual_seed(0)
    v = hf_config.vocab_size
    seqs = [SequenceData(torch.randint(0, v, (p,), generator=gen).tolist(),
                         torch.randint(0, v, (r,), generator=gen).tolist(), index=i)
            for i, (p, r) in enumerate([(7, 50), (3, 9), (12, 31)])]
    padded = collate(seqs).to(device)
    assert bool(padded.padding_mask.any()), "the padded batch has no pad"
    model.zero_grad(set_to_none=True)
    logits = model(padded.input_ids, padded.position_ids, None, padding_mask=padded.padding_mask)
    logits.float().logsumexp(-1).mean().backward()
    grad = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    packed = collate_packed(seqs, seq_multiple=8, row_multiple=8).to(device)  # TE's cuDNN THD likes multiples
    with torch.no_grad():
        row = model(packed.input_ids, packed.position_ids, None, packed_seq_params=packed_seq_params_of(packed),
                    padding_mask=packed.padding_mask)
    cu = packed.cu_seqlens.tolist()
    parts = [row[0, cu[i]:cu[i] + s.num_tokens, :v].float() for i, s in enumerate(seqs)]
    return logits.detach()[..., :v].float(), parts, float(grad)


def _compare(setting: str) -> tuple[float, float]:
    """(max |logit diff| over the padded batch and the packed row, grad-norm relative diff)."""
    from transformers import AutoModelForCausalLM

    from hapo_megatron.convert import per_expert_state
    from hapo_megatron.models.hf_config import tiny_hf_config
    from hapo_megatron.parallel.groups import initialize_parallel
    initialize_parallel(tp=1, seed=0)
    torch.manual_seed(0)
    hf_config = tiny_hf_config("qwen3_moe")
    state = per_expert_state(AutoModelForCausalLM.from_config(hf_config).state_dict())  # on-disk names
    ref = _outputs(_build(hf_config, state, UNFUSED), hf_config)
    got = _outputs(_build(hf_config, state, {**UNFUSED, setting: True}), hf_config)
    diff = float((got[0] - ref[0]).abs().max())
    diff = max([diff] + [float((a - b).abs().max()) for a, b in zip(got[1], ref[1])])
    return diff, abs(got[2] - ref[2]) / max(ref[2], 1e-12)


def _check(name: str, setting: str) -> CheckResult:
    if not torch.cuda.is_available():
        return CheckResult(name, SKIP, "needs a CUDA GPU (CPU runs use the unfused paths only)")
    from hapo_megatron.models.gpt import te_available
    if not te_available():
        return CheckResult(name, SKIP, "needs Transformer Engine (without it the unfused paths run)")
    diff, gdiff = _compare(setting)
    fig = f"tiny qwen3_moe bf16, {setting} on vs off: max |logit diff| {diff:.2e}, grad-norm rel diff {gdiff:.2e}"
    if diff > LOGIT_TOL or gdiff > GRAD_TOL:
        return CheckResult(name, FAIL, fig, FIX)
    return CheckResult(name, PASS, fig)


def moe_fused_checks() -> list:
    """[(name, check)] for `hapo doctor`'s "moe" group."""
    return [(name, (lambda n=name, s=setting: _check(n, s))) for name, setting in FUSED_PATHS]
