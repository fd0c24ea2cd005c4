"""Routing replay (`models/routing_replay.py`) through `MegatronActor` on a tiny Qwen3-MoE (4 experts,
top-2; layer 1 dense), on two gloo ranks at EP1 (DP2), EP2 and TP2 x EP2 with sequence parallelism.

The engine routes are half the model's own top-k and half other experts, with positions the engine
gave none (each sequence's last token, padding). The slow obviously-correct version is
transformers' model with each router forced to those experts (its own softmax probabilities of
them, renormalised like the model's own top-k). Checked against it, in every layout:

- the log-probs of the old-log-prob pass with replay;
- one optimizer step with replay (Adam with eps = 1, so the first update is lr * g / (|g| + 1):
  the weights give the gradient, router and experts included); with activation recomputation
  too (the recomputed forward must replay the same experts);
- without replay ("measure"): the model's own routing, and the mismatch count, which equals the
  share of (token, MoE layer) pairs whose expert set differs from the model's own.
"""

import contextlib

import numpy as np
import torch

from tests.convert.dist_checks import hf_state
from tests.convert.moe_checks import moe_model, own_top_k
from tests.distributed import run_distributed

LR = 1.0  # one step; large so the weights carry the update to float32 precision (norms are ~1)
# (tp, ep, sequence parallel, recompute, routing) on 2 ranks
LAYOUTS = {"ep1-dp2": (1, 1, False, False, "replay"), "ep2": (1, 2, False, False, "replay"),
           "tp2-ep2-sp": (2, 2, True, False, "replay"), "ep2-recompute": (1, 2, False, True, "replay"),
           "ep2-measure": (1, 2, False, False, "measure")}


def _sequences():
    """4 sequences whose routes ([n - 1, L * k]) are the model's own at even positions, random
    other experts at odd ones."""
    from hapo_megatron.training.batches.micro_batches import SequenceData

    cfg, hf = moe_model()
    gen = torch.Generator().manual_seed(5)
    seqs = []
    for i in range(4):
        prompt = torch.randint(4, 150, (4 + i,), generator=gen).tolist()
        response = torch.randint(4, 150, (3 + i,), generator=gen).tolist()
        routes = own_top_k(hf, prompt + response)[:-1].clone()
        for t in range(1, len(routes), 2):
            for layer in range(cfg.num_hidden_layers):
                routes[t, layer] = torch.randperm(cfg.num_experts, generator=gen)[:cfg.num_experts_per_tok]
        routes[:, 1] = 0  # the dense layer, as SGLang reports it
        seqs.append(SequenceData(prompt, response, routed_experts=routes.reshape(len(routes), -1).numpy(), index=i))
    return seqs


@contextlib.contextmanager
def _forced(hf, routes):
    """Every MoE router of ``hf`` takes ``routes`` ``[n - 1, L, k]`` (its own top-k beyond them),
    weighting them with its own softmax probabilities (renormalised like its own top-k)."""
    import torch.nn.functional as F

    def forced_forward(layer, gate):
        def forward(hidden):
            logits = F.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            chosen = torch.topk(probs, gate.top_k, dim=-1).indices
            chosen[: len(routes)] = routes[:, layer]
            weights = probs.gather(1, chosen)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen
        return forward

    gates = [(layer, block.mlp.gate) for layer, block in enumerate(hf.model.layers) if hasattr(block.mlp, "gate")]
    for layer, gate in gates:
        gate.forward = forced_forward(layer, gate)
    try:
        yield hf
    finally:
        for _, gate in gates:
            del gate.forward  # back to the class's own


def _hf_reference(replay: bool):
    """Per sequence its response log-probs (engine routes forced with ``replay``), and the gradient
    of the mean token cross-entropy over all sequences, by exported name."""
    cfg, hf = moe_model()
    hf.train()
    total, count, logprobs = 0.0, 0, []
    for seq in _sequences():
        ids = seq.prompt_ids + seq.response_ids
        routes = torch.from_numpy(seq.routed_experts).long().view(len(ids) - 1, cfg.num_hidden_layers, -1)
        with _forced(hf, routes) if replay else contextlib.nullcontext():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits.float(), -1)[0, :-1]
        lp = lp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)[len(seq.prompt_ids) - 1:]
        logprobs.append(lp.detach().numpy())
        total, count = total - lp.sum(), count + len(lp)
    (total / count).backward()
    with torch.no_grad():  # the gradients in the parameters' place, to name them like the export
        for p in hf.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
    return logprobs, hf_state(cfg, hf)


def _mismatch_reference() -> float:
    cfg, hf = moe_model()
    differ = compared = 0
    for seq in _sequences():
        ids = seq.prompt_ids + seq.response_ids
        own = own_top_k(hf, ids)[:-1]
        given = torch.from_numpy(seq.routed_experts).long().view(len(own), cfg.num_hidden_layers, -1)
        for layer in range(cfg.num_hidden_layers):
            if layer in (cfg.mlp_only_layers or []):
                continue
            same = (own[:, layer].sort(-1).values == given[:, layer].sort(-1).values).all(-1)
            differ += int((~same).sum())
            compared += len(same)
    return differ / compared


def _actor_run(tmpdir, tp, ep, sp, recompute, routing):
    import torch.distributed as dist
    from transformers import AutoConfig

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel
    from hapo_megatron.training.actor import MegatronActor
    from hapo_megatron.training.batches.micro_batches import build_rank_micro_batches
    from hapo_megatron.training.sft import cross_entropy_loss_factory

    g = initialize_parallel(tp=tp, ep=ep, etp=1, seed=1)
    path = f"{tmpdir}/hf_moe"
    if dist.get_rank() == 0 and not __import__("os").path.exists(path):
        moe_model()[1].save_pretrained(path)
    dist.barrier()
    actor = MegatronActor(AutoConfig.from_pretrained(path), groups=g, total_optimizer_steps=2, init_hf_path=path,
                          optim=OptimConfig(lr=LR, lr_warmup_steps=0, weight_decay=0.0, adam_eps=1.0, clip_grad=0.0),
                          moe_aux_loss_coef=0.0, sequence_parallel=sp, recompute_activations=recompute,
                          routing=routing,
                              dtype='fp32', use_te=None, use_distributed_optimizer=True, fused_output_layer=False)
    before = dict(actor.export_hf_weights())
    mbs = build_rank_micro_batches(_sequences(), dp_rank=g.dp_rank, dp_size=g.dp_size, micro_batch_size=2,
                                   pad_multiple=tp if sp else 1,
                                       max_tokens_per_micro_batch=None)  # 2 rows: the token order matters
    with actor.counting_routing_mismatch():
        lps = actor.compute_logprobs_entropy(mbs, temperature=1.0)
    counts = actor.take_routing_mismatch()
    logprobs = {int(i): lp[r][mb.loss_mask[r] > 0].numpy() for mb, (lp, _) in zip(mbs, lps)
                for r, i in enumerate(mb.seq_index.tolist()) if i >= 0}
    actor.train_step(mbs, cross_entropy_loss_factory(g.tp))
    after = dict(actor.export_hf_weights())
    destroy_parallel()
    grads = {k: ((before[k] - after[k]) / LR).numpy() for k in before}  # = g / (|g| + 1)
    return {"logprobs": logprobs, "grads": grads, "counts": counts}


def _ranks(rank, world_size, tmpdir):
    return {name: _actor_run(tmpdir, *layout) for name, layout in LAYOUTS.items()}


def test_routing_replay_matches_forced_routing_in_every_layout(tmp_path):
    results = run_distributed(_ranks, 2, str(tmp_path), timeout=900)
    want = {True: _hf_reference(replay=True), False: _hf_reference(replay=False)}
    own_lp = want[False][0]
    # not vacuous: the forced experts change the log-probs
    assert max(np.abs(a - b).max() for a, b in zip(want[True][0], own_lp)) > 1e-3
    mismatch = _mismatch_reference()
    assert 0.2 < mismatch < 0.8
    for name, (_, _, _, _, routing) in LAYOUTS.items():
        ref_lp, ref_grad_state = want[routing == "replay"]
        got = {}
        for r in results:
            got.update(r[name]["logprobs"])
        assert sorted(got) == [0, 1, 2, 3], name
        for i, lp in got.items():
            np.testing.assert_allclose(lp, ref_lp[i], rtol=0, atol=2e-5, err_msg=f"{name} seq {i}")
        for r in results:
            for k, g in r[name]["grads"].items():
                ref = ref_grad_state[k].numpy()
                np.testing.assert_allclose(g, ref / (np.abs(ref) + 1.0), rtol=1e-3, atol=2e-6, err_msg=f"{name} {k}")
        differing = sum(r[name]["counts"][0] for r in results)
        compared = sum(r[name]["counts"][1] for r in results)
        assert compared > 0, name
        assert differing / compared == mismatch, name  # exact: the same sets, counted by the actor
