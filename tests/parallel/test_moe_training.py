"""A tiny Qwen3-MoE policy trained with the HAPO loss through `forward_backward_func` at EP1 (as DP2),
EP2, TP2 x EP2 (with sequence parallelism, which MoE with TP needs in training) and TP2 x ETP2 on
two gloo ranks, against an independent single-process reference (transformers'
Qwen3MoeForCausalLM with the same weights, plain autograd, the same loss function). Every layout
runs the same 3 SGD steps on the same global batch; per-step losses, the global entropy statistics
of the policy before training and the final weights (hence the gradients) agree to float32
rounding. The router aux loss is off here (`moe_aux_loss_coeff=0`: it depends on how tokens are
split over ranks, HF leaves it out of the logits); the actor part (`MegatronActor` at EP2 with
`moe_aux_loss_coef`) checks the logged aux loss and per-expert load against a loop over HF's
router logits, and that the coefficient reaches the gradient.
"""

import numpy as np
import torch

from tests.convert.dist_checks import hf_state
from tests.convert.moe_checks import moe_model
from tests.distributed import run_distributed
from tests.parallel.test_gpt_training import LR, SEQ, STEPS, _batch, _loss_cfg
from hapo_megatron.algo.loss_config import PolicyLossConfig

# (tp, ep, etp, sequence parallel, fused output layer) on 2 ranks
LAYOUTS = {"ep1-dp2": (1, 1, 1, False, False), "ep2": (1, 2, 1, False, True),
           "tp2-ep2-sp": (2, 2, 1, True, False), "tp2-etp2-sp": (2, 1, 2, True, True)}


def _entropy_stats(ddp, micro, g, fused):
    """Global entropy statistics of the policy's per-token entropies over the whole batch."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hapo_megatron.models import forward_hidden_states
    from hapo_megatron.parallel.loss import logprobs_entropy_from_logits, zero_loss_like
    from hapo_megatron.parallel.stats import global_entropy_stats

    entropies = []

    def forward_step(data_iterator, module):
        mb = next(data_iterator)
        pos = torch.arange(SEQ).unsqueeze(0)
        out = (forward_hidden_states if fused else (lambda m, *a: m(*a)))(module, mb.input_ids, pos, None)

        def collect(output):
            _, entropy = logprobs_entropy_from_logits(output, mb.labels, tp_group=g.tp, temperature=1.0)
            entropies.append((entropy.detach(), mb.loss_mask))
            return zero_loss_like(output), {}
        return out, collect

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp],
                                    num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=1,
                                    forward_only=True)
    entropy = torch.cat([e for e, _ in entropies])
    mask = torch.cat([m for _, m in entropies])
    return global_entropy_stats(entropy, mask, group=g.dp_cp, entropy_pivot=PolicyLossConfig().entropy_pivot).to_dict()


def _megatron_run(tp, ep, etp, sp, fused):
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hapo_megatron.convert import export_hf_weights, load_hf_weights_into_mcore
    from hapo_megatron.models import build_gpt_model, forward_hidden_states
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel
    from hapo_megatron.parallel.loss import make_loss_func

    g = initialize_parallel(tp=tp, ep=ep, etp=etp, seed=1)
    assert (g.ep_size, g.etp_size) == (ep, etp)
    hf_cfg, hf = moe_model()
    model = build_gpt_model(hf_cfg, sequence_parallel=sp, moe_aux_loss_coeff=0.0, use_te=None)
    load_hf_weights_into_mcore(model, hf_state(hf_cfg, hf), hf_cfg, tp_rank=g.tp_rank, tp_size=tp,
                               etp_rank=g.etp_rank, etp_size=etp)
    model.config.calculate_per_token_loss = True
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(
        config=model.config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=False))
    batch, stats = _batch(hf_cfg.vocab_size)
    per_rank = batch.input_ids.shape[0] // g.dp_size
    local = batch.rows(slice(g.dp_rank * per_rank, (g.dp_rank + 1) * per_rank))
    micro = [local.rows(slice(i, i + 1)) for i in range(per_rank)]
    cfg = _loss_cfg()
    entropy_stats = _entropy_stats(ddp, micro, g, fused)

    def forward_step(data_iterator, module):
        mb = next(data_iterator)
        pos = torch.arange(SEQ).unsqueeze(0)
        out = (forward_hidden_states if fused else (lambda m, *a: m(*a)))(module, mb.input_ids, pos, None)
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
        tot = torch.tensor([sum(float(m["loss/objective_sum"]) for m in store),
                            sum(float(m["loss/normalizer"]) for m in store)], dtype=torch.float64)
        dist.all_reduce(tot, group=g.dp)
        losses.append((tot[0] / tot[1]).item())
    weights = {n: t.numpy().copy() for n, t in export_hf_weights(
        [model], hf_cfg, tp_group=g.tp, pp_group=g.pp, ep_group=g.ep, etp_group=g.etp)}
    destroy_parallel()
    return {"losses": losses, "weights": weights, "entropy_stats": entropy_stats}


AUX_COEF = 0.5


def _sequences():
    from hapo_megatron.training.batches.micro_batches import SequenceData

    gen = torch.Generator().manual_seed(5)
    return [SequenceData(torch.randint(4, 150, (4 + i,), generator=gen).tolist(),
                         torch.randint(4, 150, (3 + i,), generator=gen).tolist(), index=i) for i in range(4)]


def _actor_run(tmpdir, coef):
    """MegatronActor at EP2 (DP2 for the dense weights): one train step with the SFT loss; its
    MoE metrics and, for the gradient check, an expert weight after the step."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel
    from hapo_megatron.training.actor import MegatronActor
    from hapo_megatron.training.batches.micro_batches import build_rank_micro_batches
    from hapo_megatron.training.sft import cross_entropy_loss_factory

    g = initialize_parallel(tp=1, ep=2, seed=1)
    path = f"{tmpdir}/hf_moe"
    if dist.get_rank() == 0:
        moe_model()[1].save_pretrained(path)
    dist.barrier()
    actor = MegatronActor(AutoConfig.from_pretrained(path), groups=g, total_optimizer_steps=2, init_hf_path=path,
                          optim=OptimConfig(lr=1e-2, lr_warmup_steps=0, weight_decay=0.0),
                          moe_aux_loss_coef=coef,
                              dtype='fp32', use_te=None, sequence_parallel=False, recompute_activations=False,
                              use_distributed_optimizer=True, fused_output_layer=False)
    assert actor.config.moe_aux_loss_coeff == coef
    mbs = build_rank_micro_batches(_sequences(), dp_rank=g.dp_rank, dp_size=g.dp_size,
        micro_batch_size=1, max_tokens_per_micro_batch=None)
    actor.compute_logprobs_entropy(mbs, temperature=1.0)  # not counted: the metrics are the training steps'
    actor.train_step(mbs, cross_entropy_loss_factory(g.tp))
    metrics = actor.moe_step_metrics()
    weights = dict(actor.export_hf_weights())
    destroy_parallel()
    return {"metrics": metrics, "mbs": [mb.input_ids for mb in mbs],
            "expert": weights["model.layers.0.mlp.experts.1.up_proj.weight"].numpy().copy()}


def _train_ranks(rank, world_size, tmpdir):
    out = {name: _megatron_run(*layout) for name, layout in LAYOUTS.items()}
    out["actor"] = {coef: _actor_run(tmpdir, coef) for coef in (AUX_COEF, 0.0)}
    return out


def _hf_reference():
    from hapo_megatron.parallel.loss import hapo_loss_from_logits, logprobs_entropy_from_logits
    from hapo_megatron.parallel.stats import global_entropy_stats

    hf_cfg, hf = moe_model()
    hf.train()
    batch, stats = _batch(hf_cfg.vocab_size)
    with torch.no_grad():
        _, entropy = logprobs_entropy_from_logits(hf(batch.input_ids).logits, batch.labels, temperature=1.0)
    entropy_stats = global_entropy_stats(entropy, batch.loss_mask,
        entropy_pivot=PolicyLossConfig().entropy_pivot).to_dict()
    cfg, losses = _loss_cfg(), []
    for _ in range(STEPS):
        hf.zero_grad()
        loss_sum, n, _ = hapo_loss_from_logits(hf(batch.input_ids).logits, batch, cfg=cfg, stats=stats, temperature=1.0)
        (loss_sum / n).backward()
        losses.append((loss_sum / n).item())
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(p.grad, alpha=-LR)
    return losses, {k: v.detach().numpy() for k, v in hf_state(hf_cfg, hf).items()}, entropy_stats


def _routing_reference(micro_batches):
    """Loop over HF's router logits of every micro-batch (of every rank): the mean over micro-batches
    and MoE layers of E/k * sum_e f_e P_e (f_e: share of top-k slots, P_e: mean softmax
    probability; Megatron's switch load-balancing loss) and per layer the routed-token counts."""
    cfg, hf = moe_model()
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    aux, counts = [], {}
    for ids in micro_batches:
        with torch.no_grad():
            router_logits = hf(ids, output_router_logits=True).router_logits
        for layer, logits in enumerate(router_logits):
            probs = torch.softmax(logits.double(), -1)
            chosen = torch.topk(probs, k, -1).indices
            count = torch.zeros(E, dtype=torch.float64)
            for row in chosen:
                for e in row:
                    count[e] += 1
            f, P = count / probs.shape[0], probs.mean(0)
            aux.append(E / k * float((f * P).sum()))
            counts[layer] = counts.get(layer, 0) + count
    share = torch.stack([c / c.sum() * E for c in counts.values()])
    return {"actor/moe_aux_loss": sum(aux) / len(aux),
            "actor/moe_expert_load_max": float(share.max(1).values.mean()),
            "actor/moe_expert_load_min": float(share.min(1).values.mean()),
            "actor/moe_expert_load_cv": float(share.std(1, unbiased=False).mean())}


def test_moe_training_matches_across_expert_layouts(tmp_path):
    results = run_distributed(_train_ranks, 2, str(tmp_path), timeout=900)
    ref_losses, ref_weights, ref_stats = _hf_reference()
    assert max(ref_losses) - min(ref_losses) > 1e-3  # the steps really change the model
    start = hf_state(*moe_model())
    assert all(not np.array_equal(ref_weights[k], start[k].numpy()) for k in ref_weights if ".experts." in k)
    for name in LAYOUTS:
        for r in results:
            np.testing.assert_allclose(r[name]["losses"], ref_losses, rtol=2e-5, atol=1e-6, err_msg=name)
            got = r[name]["entropy_stats"]
            # Float32 logits agree to ~5e-7 (test_convert_moe), so each entropy (~5) to ~1e-6 and its
            # log to ~2e-7; allow 1e-6 on log-entropies. pivot and std are in log-entropy units;
            # pos_max / neg_min are deviations divided by std (~2e-3 for this random model, whose
            # entropies are all near log V), so their error is that over std, plus |z| times std's.
            tol_log = 1e-6
            for key in ("pivot", "std"):
                np.testing.assert_allclose(got[key], ref_stats[key], rtol=0, atol=tol_log, err_msg=f"{name} {key}")
            for key in ("pos_max", "neg_min"):
                atol = tol_log / ref_stats["std"] * (2 + abs(ref_stats[key]))
                np.testing.assert_allclose(got[key], ref_stats[key], rtol=0, atol=atol, err_msg=f"{name} {key}")
            w = r[name]["weights"]
            assert sorted(w) == sorted(ref_weights), name
            for k, v in w.items():
                np.testing.assert_allclose(v, ref_weights[k], rtol=1e-4, atol=2e-6, err_msg=f"{name} {k}")

    # The actor: metrics equal on both ranks and to the loop reference over both ranks' micro-batches
    actor = [r["actor"] for r in results]
    expected = _routing_reference([ids for r in actor for ids in r[AUX_COEF]["mbs"]])
    assert 0.9 < expected["actor/moe_aux_loss"] and expected["actor/moe_expert_load_max"] > 1.0
    for r in actor:
        for key, value in expected.items():  # float32 router softmax vs float64: ~1e-7 relative
            np.testing.assert_allclose(r[AUX_COEF]["metrics"][key], value, rtol=1e-5, err_msg=key)
    # the coefficient reaches the gradient: the same step without it moves the experts differently
    assert not np.allclose(actor[0][AUX_COEF]["expert"], actor[0][0.0]["expert"], rtol=0, atol=1e-7)
