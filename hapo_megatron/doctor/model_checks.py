"""Transformer Engine's layer spec against Megatron's local spec on a tiny GPTModel (GPU only):
the same HF weights loaded into both, bf16 forward logits and backward gradients compared."""

from __future__ import annotations

import torch

from hapo_megatron.doctor.report import FAIL, PASS, SKIP, CheckResult

LOGIT_TOL = 5e-2  # bf16 kernels (fused vs unfused norms/linears) on logits of size ~1
GRAD_TOL = 5e-2  # relative difference of the gradient norms


def _tiny_gpt_pair():
    from transformers import AutoModelForCausalLM

    from hapo_megatron.convert import load_hf_weights_into_mcore
    from hapo_megatron.models import build_gpt_model
    from hapo_megatron.models.hf_config import tiny_hf_config
    torch.manual_seed(0)
    hf_config = tiny_hf_config("qwen2")
    state = AutoModelForCausalLM.from_config(hf_config).state_dict()
    models = {}
    for use_te in (True, False):
        m = build_gpt_model(hf_config, dtype=torch.bfloat16, use_te=use_te, sequence_parallel=False).cuda()
        load_hf_weights_into_mcore(m, state, hf_config, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        models[use_te] = m
    return hf_config, models


def _fwd_bwd(model, ids):
    model.zero_grad(set_to_none=True)
    pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    logits = model(input_ids=ids, position_ids=pos, attention_mask=None)
    logits.float().logsumexp(-1).mean().backward()
    grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return logits.detach().float(), float(grad_norm)


TE_MISSING = "needs Transformer Engine (see the row `import transformer_engine.pytorch`)"


def check_te_vs_local() -> CheckResult:
    if not torch.cuda.is_available():
        return CheckResult("TE spec vs local", SKIP, "needs a CUDA GPU")
    from hapo_megatron.models.gpt import te_available
    if not te_available():  # one failure per cause: the import row is it, with its fix
        return CheckResult("TE spec vs local", SKIP, TE_MISSING)
    from hapo_megatron.parallel.groups import initialize_parallel
    initialize_parallel(tp=1, seed=0)
    hf_config, models = _tiny_gpt_pair()
    ids = torch.randint(0, hf_config.vocab_size, (2, 64), device="cuda")
    (te_logits, te_grad), (loc_logits, loc_grad) = _fwd_bwd(models[True], ids), _fwd_bwd(models[False], ids)
    v = hf_config.vocab_size
    diff = float((te_logits[..., :v] - loc_logits[..., :v]).abs().max())
    gdiff = abs(te_grad - loc_grad) / max(loc_grad, 1e-12)
    fig = f"tiny qwen2 bf16: max |logit diff| {diff:.2e}, grad-norm rel diff {gdiff:.2e}"
    if diff > LOGIT_TOL or gdiff > GRAD_TOL:
        return CheckResult("TE spec vs local", FAIL, fig, "Transformer Engine and megatron-core disagree: use the "
                           "image's pinned pair (megatron-core declares its transformer-engine range) or set "
                           "model.use_te=false")
    return CheckResult("TE spec vs local", PASS, fig)


def check_packed_vs_padded() -> CheckResult:
    """A packed row (THD, megatron-core `PackedSeqParams` into TE's attention) against each of its
    sequences alone in a padded row: the logits of every real position (the packed GPU path, docs/architecture.md)."""
    name = "packed == padded (TE THD)"
    if not torch.cuda.is_available():
        return CheckResult(name, SKIP, "needs a CUDA GPU (the CPU path is tested by tests/training/test_packing_*)")
    from hapo_megatron.models.gpt import te_available
    if not te_available():
        return CheckResult(name, SKIP, TE_MISSING)
    from hapo_megatron.parallel.groups import initialize_parallel
    from hapo_megatron.training.actor import packed_seq_params_of
    from hapo_megatron.training.batches.micro_batches import SequenceData, collate, collate_packed
    initialize_parallel(tp=1, seed=0)
    hf_config, models = _tiny_gpt_pair()
    model = models[True]
    gen = torch.Generator().manual_seed(0)
    seqs = [SequenceData(torch.randint(0, hf_config.vocab_size, (p,), generator=gen).tolist(),
                         torch.randint(0, hf_config.vocab_size, (r,), generator=gen).tolist(), index=i)
            for i, (p, r) in enumerate([(7, 50), (3, 9), (12, 31)])]
    packed = collate_packed(seqs, seq_multiple=8, row_multiple=8).to("cuda")  # TE's cuDNN THD likes multiples
    v, diff = hf_config.vocab_size, 0.0
    with torch.no_grad():
        row = model(packed.input_ids, packed.position_ids, None, packed_seq_params=packed_seq_params_of(packed))
        cu = packed.cu_seqlens.tolist()
        for i, s in enumerate(seqs):
            alone = collate([s]).to("cuda")
            ref = model(alone.input_ids, alone.position_ids, None)[0, :s.num_tokens, :v].float()
            diff = max(diff, float((row[0, cu[i]:cu[i] + s.num_tokens, :v].float() - ref).abs().max()))
    fig = f"tiny qwen2 bf16, 3 sequences in one row: max |logit diff| {diff:.2e} vs each alone"
    if diff > LOGIT_TOL:
        return CheckResult(name, FAIL, fig, "Transformer Engine's THD attention disagrees with padded rows: "
                           "set parallel.pack_sequences=false and report the versions (hapo doctor)")
    return CheckResult(name, PASS, fig)
