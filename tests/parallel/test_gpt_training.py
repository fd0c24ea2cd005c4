"""A tiny Megatron GPTModel trained with the HAPO loss through `forward_backward_func`.

TP1/PP1 (as DP2), TP2 and PP2 on two gloo ranks, plus an independent single-process reference
(the same weights in the Hugging Face model, plain autograd, the same loss function), all run
the same 3 SGD steps on the same global batch: per-step losses and the final weights agree to
float32 rounding. The same holds with the fused output layer (`models.forward_hidden_states` +
`parallel.linear_logprobs_entropy`: no logits) at TP2 and at PP2, for Llama (untied output
layer) and Qwen2 (output tied to the embedding; at PP2 the last stage's copy), and at TP2 with
sequence parallelism (the local spec's norms, `models/local_norm.py`, whose weight gradients
`finalize_model_grads` all-reduces over TP; unfused Llama, fused Qwen2). Megatron's pieces in the
loop: DDP (grad buffers, DP all-reduce), `finalize_model_grads` (the per-token normalisation by the
global `num_tokens`) and the no-pipelining / 1F1B schedules.
"""

import numpy as np
import torch

from tests.convert.dist_checks import hf_state, random_hf_model
from tests.distributed import run_distributed
from tests.float_bounds import near_loss_discontinuity
from hapo_megatron.algo.loss_config import PolicyLossConfig

ARCH = "llama"
# Each layout regroups float32 sums (row-parallel matmuls over H = 32..64, the vocab-parallel
# log-sum-exp, the DP / embedding all-reduces), so per-step losses differ by a few ulps of their
# sums (LOSS_RTOL); an SGD step of lr 0.5 carries the gradients' rounding into the weights, and 3
# such steps compound it (WEIGHT_RTOL; atol for weights near 0). That holds while the loss is
# continuous in every token's ratio: no reference ratio within RATIO_REL of a clip / neutral-zone
# edge (checked), else one token could take another branch in one layout and move the run by far more.
LOSS_RTOL, WEIGHT_RTOL, RATIO_REL = 2e-5, 1e-4, 1e-4
STEPS, LR = 3, 0.5
NUM_SEQ, SEQ = 4, 16
# (arch, tp, pp, fused output layer, sequence parallel) on 2 ranks; tp = pp = 1 runs as DP2
LAYOUTS = (("llama", 1, 1, False, False), ("llama", 2, 1, False, False), ("llama", 1, 2, False, False),
           ("llama", 2, 1, True, False), ("llama", 1, 2, True, False),
           ("qwen2", 1, 2, False, False), ("qwen2", 1, 2, True, False), ("qwen2", 2, 1, True, False),
           ("llama", 2, 1, False, True), ("qwen2", 2, 1, True, True))


def _name(arch, tp, pp, fused, sp):
    return f"{arch}-tp{tp}pp{pp}" + ("-fused" if fused else "") + ("-sp" if sp else "")


def _hf_model(arch=ARCH, seed=0):
    return random_hf_model(arch, seed)


def _batch(vocab):
    """Global RL batch `[NUM_SEQ, SEQ]` with prompt positions masked out and uneven lengths."""
    from hapo_megatron.algo import compute_entropy_stats
    from hapo_megatron.parallel.micro_batch import MicroBatch

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (NUM_SEQ, SEQ + 1), generator=g)
    mask = torch.zeros(NUM_SEQ, SEQ)
    for i, (start, end) in enumerate([(3, 16), (5, 9), (2, 14), (6, 16)]):
        mask[i, start:end] = 1
    batch = MicroBatch(
        input_ids=tokens[:, :-1], position_ids=torch.arange(SEQ).expand(NUM_SEQ, SEQ), labels=tokens[:, 1:],
        loss_mask=mask, old_logprobs=-torch.rand(NUM_SEQ, SEQ, generator=g) * 5 - 2.0,
        advantages=torch.randn(NUM_SEQ, 1, generator=g).expand(NUM_SEQ, SEQ).contiguous(),
        old_entropy=torch.rand(NUM_SEQ, SEQ, generator=g) * 4,
    )
    return batch, compute_entropy_stats(batch.old_entropy, mask, entropy_pivot=PolicyLossConfig().entropy_pivot)


def _loss_cfg():
    from hapo_megatron.algo import PolicyLossConfig

    return PolicyLossConfig(clip_ratio_high=0.28, loss_agg_mode="token-mean")


def _megatron_run(arch, tp, pp, fused, sp):
    """One layout on this rank: per-step losses (last stage) and the final HF-named weights."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hapo_megatron.convert import export_hf_weights, load_hf_weights_into_mcore
    from hapo_megatron.models import build_gpt_model, forward_hidden_states
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel
    from hapo_megatron.parallel.linear import HiddenStates
    from hapo_megatron.parallel.loss import make_loss_func

    g = initialize_parallel(tp=tp, pp=pp, seed=1)
    _check_groups(g, tp, pp)
    hf_cfg, hf = _hf_model(arch)
    model = build_gpt_model(hf_cfg, sequence_parallel=sp, use_te=None)
    load_hf_weights_into_mcore(model, hf.state_dict(), hf_cfg, tp_rank=g.tp_rank, tp_size=tp,
                               pp_rank=g.pp_rank, pp_size=pp)
    model.config.calculate_per_token_loss = True
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(
        config=model.config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=False))
    batch, stats = _batch(hf_cfg.vocab_size)
    per_rank = NUM_SEQ // g.dp_size
    local = batch.rows(slice(g.dp_rank * per_rank, (g.dp_rank + 1) * per_rank))
    micro = [local.rows(slice(i, i + 1)) for i in range(per_rank)]  # micro-batches of one sequence
    cfg = _loss_cfg()

    def forward_step(data_iterator, module):
        mb = next(data_iterator)
        pos = torch.arange(SEQ).unsqueeze(0)
        out = (forward_hidden_states if fused else (lambda m, *a: m(*a)))(module, mb.input_ids, pos, None)
        assert isinstance(out, HiddenStates) == (fused and g.is_pipeline_last)
        return out, make_loss_func(mb, cfg=cfg, stats=stats, tp_group=g.tp, temperature=1.0)

    losses = []
    for _ in range(STEPS):
        ddp.zero_grad_buffer()
        store = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp],
            num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=1, forward_only=False)
        with torch.no_grad():
            for p in ddp.parameters():
                p.add_(p.main_grad, alpha=-LR)
        if g.is_pipeline_last:
            tot = torch.tensor([sum(float(m["loss/objective_sum"]) for m in store),
                                sum(float(m["loss/normalizer"]) for m in store)], dtype=torch.float64)
            dist.all_reduce(tot, group=g.dp)
            losses.append((tot[0] / tot[1]).item())
    weights = {n: t.numpy().copy() for n, t in export_hf_weights([model], hf_cfg, tp_group=g.tp, pp_group=g.pp)}
    destroy_parallel()
    return {"losses": losses or None, "weights": weights}


def _check_groups(g, tp, pp):
    """ParallelGroups agrees with the layout; re-initialising is idempotent or refused."""
    import pytest
    import torch.distributed as dist

    from hapo_megatron.parallel.groups import get_parallel_groups, initialize_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    assert (g.tp_size, g.pp_size, g.cp_size, g.dp_size) == (tp, pp, 1, world // (tp * pp))
    assert g.dp_cp_size == g.dp_size and g.dp_cp_rank == g.dp_rank
    assert g.tp_rank == (rank % tp) and g.pp_rank == rank // (tp * (world // (tp * pp)))
    assert g.is_pipeline_first == (g.pp_rank == 0) and g.is_pipeline_last == (g.pp_rank == pp - 1)
    assert dist.get_world_size(g.tp) == tp and dist.get_world_size(g.dp_cp) == g.dp_size
    assert initialize_parallel(tp=tp, pp=pp) is get_parallel_groups()
    with pytest.raises(ValueError, match="already initialised"):
        initialize_parallel(tp=world // tp, pp=pp)
    with pytest.raises(ValueError, match="tp"):
        initialize_parallel(tp=0)


def _train_ranks(rank, world_size):
    return {_name(*layout): _megatron_run(*layout) for layout in LAYOUTS}


def _hf_reference(arch):
    """Plain single-process training of the HF model with the same loss function."""
    from hapo_megatron.algo import normalize_entropy
    from hapo_megatron.parallel.loss import hapo_loss_from_logits

    hf_cfg, hf = _hf_model(arch)
    batch, stats = _batch(hf_cfg.vocab_size)
    cfg = _loss_cfg()
    h_hat = normalize_entropy(batch.old_entropy, stats, cfg.h_hat_mode)
    losses, near_edges = [], 0
    for _ in range(STEPS):
        hf.zero_grad()
        fields = []
        loss_sum, n, _ = hapo_loss_from_logits(hf(batch.input_ids).logits, batch, cfg=cfg, stats=stats,
                                               on_token_fields=fields.append, temperature=1.0)
        near_edges += int(near_loss_discontinuity(fields[0].ratio, h_hat, batch.loss_mask, cfg, RATIO_REL).sum())
        (loss_sum / n).backward()
        losses.append((loss_sum / n).item())
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(p.grad, alpha=-LR)
    return losses, {k: v.detach().numpy() for k, v in hf_state(hf_cfg, hf).items()}, near_edges


def test_gpt_model_training_matches_across_tp_pp():
    results = run_distributed(_train_ranks, 2, timeout=600)
    refs = {arch: _hf_reference(arch) for arch in {layout[0] for layout in LAYOUTS}}
    for arch, (_, _, near_edges) in refs.items():
        assert near_edges == 0, (arch, "ratios within rounding of a clip / neutral-zone edge")
    for layout in LAYOUTS:
        name = _name(*layout)
        ref_losses, ref_weights, _ = refs[layout[0]]
        assert max(ref_losses) - min(ref_losses) > 1e-3  # the steps really change the model
        losses = [r[name]["losses"] for r in results if r[name]["losses"] is not None]
        assert losses, name
        for ls in losses:
            np.testing.assert_allclose(ls, ref_losses, rtol=LOSS_RTOL, atol=1e-6, err_msg=name)
        for r in results:
            w = r[name]["weights"]
            assert sorted(w) == sorted(ref_weights), name
            for k, v in w.items():
                np.testing.assert_allclose(v, ref_weights[k], rtol=WEIGHT_RTOL, atol=2e-6, err_msg=f"{name} {k}")
