"""Padding in a MoE micro-batch keeps the routing map whole (docs/moe.md, "Padding and fillers").

megatron-core's dropless alltoall dispatcher sizes the permuted tokens as ``tokens x topk``
(``num_out_tokens``, what TE's fused permute allocates) while its split sizes come from
``routing_map.sum()``: a routing map with cleared pad rows makes the two disagree, and on a GPU
with TE's fused permute every micro-batch with a pad fails (EP>1: the all-to-all's split sizes;
EP=1: the grouped GEMM's ``torch.split``). The CPU path (unfused permute) ignores
``num_out_tokens``, so the test checks the fused path's invariant at megatron-core's own
``permute`` call: ``num_out_tokens == routing_map.sum()``.

A tiny Qwen3-MoE (both layers sparse) on one gloo rank: two sequences of unequal length, right
padded, against each sequence alone without padding. Real tokens' logits and every gradient of a
loss over real tokens equal the unpadded runs (float32 rounding of other batch shapes); pads reach
the MoE layer's output as exact zeros (weight 0); every router call's map has tokens x topk
entries; the expert-load counts (`ExpertLoadMonitor`) equal the unpadded runs' counts exactly.

Mutations tried: the old hook that clears the pad rows of the routing map (the invariant and the
tokens x topk count fail); pads' probabilities left as routed (their MoE output is not 0); the
monitor counting the whole map (the counts include pads).
"""

from __future__ import annotations

import numpy as np
import torch

from tests.convert.dist_checks import random_hf_model
from tests.distributed import run_distributed

TOP_K, EXPERTS, LAYERS = 2, 4, 2
LENGTHS = (9, 5)
PAD_ID = 3
#: other batch shapes sum the same float32 products in another order: a few ulps of O(1) terms
#: through 2 layers of hidden 64; 1e-5 relative plus 1e-6 of each tensor's scale.
RTOL, SCALE_ATOL = 1e-5, 1e-6


def _rank(rank, world, path):
    from transformers import AutoConfig
    from megatron.core.transformer.moe import token_dispatcher

    from hapo_megatron.models import build_gpt_model
    from hapo_megatron.models.moe import ExpertLoadMonitor
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel

    initialize_parallel(seed=7)
    cfg = AutoConfig.from_pretrained(path)
    model = build_gpt_model(cfg, use_te=False, sequence_parallel=False, moe_aux_loss_coeff=0.0)
    model.train()
    monitor = ExpertLoadMonitor([model], num_layers=LAYERS, num_experts=EXPERTS)
    monitor.recording = True

    maps, permutes, moe_out = [], [], []
    original_permute = token_dispatcher.permute

    def checked_permute(tokens, routing_map, *a, num_out_tokens=None, **kw):
        permutes.append((None if num_out_tokens is None else int(num_out_tokens), int(routing_map.sum())))
        return original_permute(tokens, routing_map, *a, num_out_tokens=num_out_tokens, **kw)

    token_dispatcher.permute = checked_permute
    routers, layers = [], []
    for m in model.modules():
        if type(m).__name__ == "TopKRouter":
            routers.append(m.register_forward_hook(lambda r, i, o: maps.append((o[1].shape[0], int(o[1].sum())))))
        if type(m).__name__ == "MoELayer":
            layers.append(m.register_forward_hook(lambda mod, i, o: moe_out.append(o[0].detach().clone())))

    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(4, 150, (n,), generator=g) for n in LENGTHS]
    weights = [torch.randn(n, model.vocab_size, generator=g) for n in LENGTHS]

    def run(ids, pad):
        model.zero_grad(set_to_none=True)
        moe_out.clear()
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        kw = {} if pad is None else {"padding_mask": pad}
        logits = model(ids, pos, None, **kw).float()  # [b, s, V]
        if pad is None:  # one sequence alone: which one, by its length
            loss = (logits[0] * weights[LENGTHS.index(ids.shape[1])]).sum()
        else:
            loss = sum((logits[i, :n] * weights[i]).sum() for i, n in enumerate(LENGTHS))
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), grads, [o.clone() for o in moe_out]

    try:
        s = max(LENGTHS)
        ids = torch.full((len(LENGTHS), s), PAD_ID)
        pad = torch.ones(len(LENGTHS), s, dtype=torch.bool)
        for i, q in enumerate(seqs):
            ids[i, :len(q)] = q
            pad[i, :len(q)] = False
        padded_logits, padded_grads, padded_moe = run(ids, pad)
        padded_maps, padded_permutes = list(maps), list(permutes)
        padded_counts = monitor.counts.clone()
        monitor.counts.zero_()

        alone = [run(q.unsqueeze(0), None) for q in seqs]
        alone_counts = monitor.counts.clone()
    finally:
        token_dispatcher.permute = original_permute
        for h in routers + layers:
            h.remove()
        monitor.remove()
        destroy_parallel()

    # MoE layer output [s, b, h]: pads' rows
    pad_moe_max = max(float(o.transpose(0, 1)[pad].abs().max()) for o in padded_moe)
    return dict(
        padded_logits=[padded_logits[i, :n].numpy() for i, n in enumerate(LENGTHS)],
        alone_logits=[a[0][0].numpy() for a in alone],
        padded_grads={k: v.numpy() for k, v in padded_grads.items()},
        alone_grads={k: (alone[0][1][k] + alone[1][1][k]).numpy() for k in alone[0][1]},
        maps=padded_maps, permutes=padded_permutes, pad_moe_max=pad_moe_max,
        real_moe_max=float(padded_moe[0].abs().max()),
        padded_counts=padded_counts.numpy(), alone_counts=alone_counts.numpy(), tokens=len(LENGTHS) * s)


def test_padding_keeps_the_routing_map_whole_and_changes_nothing_real(tmp_path):
    cfg, hf = random_hf_model("qwen3_moe", 0, num_hidden_layers=LAYERS, num_experts=EXPERTS,
                              num_experts_per_tok=TOP_K)
    assert cfg.mlp_only_layers == []
    hf.save_pretrained(str(tmp_path))
    (r,) = run_distributed(_rank, 1, str(tmp_path), timeout=300)

    # the dispatcher's size of the permuted tokens equals the routing map's count (TE's fused permute)
    assert r["permutes"], "megatron-core's permute was not called"
    for num_out, routed in r["permutes"]:
        assert num_out is None or num_out == routed, (num_out, routed)
    # every router call of the padded batch routes every position (pads included) to its top-k
    assert r["maps"] == [(r["tokens"], r["tokens"] * TOP_K)] * LAYERS
    # pads are dispatched with weight 0: their MoE output is exactly 0, the real tokens' is not
    assert r["pad_moe_max"] == 0.0 and r["real_moe_max"] > 0
    for a, b in zip(r["padded_logits"], r["alone_logits"]):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=SCALE_ATOL * float(np.abs(b).max()))
    assert sorted(r["padded_grads"]) == sorted(r["alone_grads"])
    assert any(".experts." in k for k in r["padded_grads"]) and any("router" in k for k in r["padded_grads"])
    for k, b in r["alone_grads"].items():
        np.testing.assert_allclose(r["padded_grads"][k], b, rtol=RTOL, atol=SCALE_ATOL * float(np.abs(b).max()),
                                   err_msg=k)
    # the expert-load counts see the real tokens only: exactly the unpadded runs' counts
    np.testing.assert_array_equal(r["padded_counts"], r["alone_counts"])
    assert r["alone_counts"].sum() == sum(LENGTHS) * TOP_K * LAYERS
