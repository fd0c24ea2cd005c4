"""Routing replay at PP=2 with each stage's routes only (docs/moe.md, "Routes volume"): a
`MegatronActor` over two pipeline stages of a tiny Qwen3-MoE (both layers sparse), replaying
forced experts. The micro-batches carry every layer's routes, or only the stage's layers
(`route_share.stage_routes`, what the share-out sends). The log-probs are bit-identical: the same
experts reach each router. Replay is in effect: without routes they differ. Padded micro-batches
of unequal lengths, 3 per rank, so the padding mask also crosses the stage boundary.
Mutation tried: the actor reading a stage's routes without its layer offset
(`_route_first_layer` returning 0) fails: stage 1's router finds no layer 1 in them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.convert.dist_checks import random_hf_model
from tests.distributed import run_distributed

pytestmark = pytest.mark.slow  # 2 ranks, about 30 s on 2 cores

LAYERS, TOP_K, EXPERTS = 2, 2, 4


def _sequences(stage=None):
    """Sequences with forced routes (distinct experts per position, seeded): every layer's, or
    (``stage`` = (first, end)) those layers' only."""
    from hapo_megatron.training.batches.micro_batches import SequenceData
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(6):
        p, r = 2 + i % 3, 3 + 2 * i
        ids = torch.randint(4, 150, (p + r,), generator=g).tolist()
        routes = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range((p + r - 1) * LAYERS)])
        routes = routes.view(p + r - 1, LAYERS, TOP_K)
        if stage is not None:
            routes = routes[:, stage[0]:stage[1]]
        out.append(SequenceData(ids[:p], ids[p:], routed_experts=routes.numpy().astype(np.int16).reshape(-1),
                                index=i))
    return out


def _stage_ranks(rank, world, path):
    from transformers import AutoConfig

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.parallel.groups import destroy_parallel, initialize_parallel
    from hapo_megatron.training.actor import MegatronActor
    from hapo_megatron.training.batches.micro_batches import SequenceData, collate_micro_batches
    from hapo_megatron.training.batches.route_share import stage_layer_range

    g = initialize_parallel(pp=2, seed=1)
    actor = MegatronActor(AutoConfig.from_pretrained(path), groups=g, total_optimizer_steps=2, init_hf_path=path,
                          optim=OptimConfig(lr=1e-3, lr_warmup_steps=0), moe_aux_loss_coef=0.0, routing="replay",
                              dtype='fp32', use_te=None, sequence_parallel=False, recompute_activations=False,
                              use_distributed_optimizer=True, fused_output_layer=False)
    stage = stage_layer_range(LAYERS, g.pp_size, g.pp_rank)
    runs = {"whole": _sequences(), "stage": _sequences(stage),
            "own": [SequenceData(s.prompt_ids, s.response_ids, index=s.index) for s in _sequences()]}
    out = {}
    for name, seqs in runs.items():
        mbs = collate_micro_batches([seqs[0:2], seqs[2:4], seqs[4:6]], seqs[0])
        if name == "stage":
            assert mbs[0].routed_experts.shape[-1] == (stage[1] - stage[0]) * TOP_K
        lps = actor.compute_logprobs_entropy(mbs, temperature=1.0)
        out[name] = [lp.numpy() for lp, _ in lps]
    destroy_parallel()
    return out


def test_stage_routes_replay_like_whole_routes(tmp_path):
    cfg, hf = random_hf_model("qwen3_moe", 0, num_hidden_layers=LAYERS, num_experts=EXPERTS,
                              num_experts_per_tok=TOP_K)
    assert cfg.mlp_only_layers == []
    hf.save_pretrained(str(tmp_path))
    first, last = run_distributed(_stage_ranks, 2, str(tmp_path), timeout=400)
    assert first == {"whole": [], "stage": [], "own": []}  # log-probs come from the last stage
    assert len(last["whole"]) == 3
    for a, b in zip(last["stage"], last["whole"]):
        np.testing.assert_array_equal(a, b)
    # the forced experts change the log-probs by far more than rounding
    assert max(float(np.abs(a - b).max()) for a, b in zip(last["own"], last["whole"])) > 1e-3
