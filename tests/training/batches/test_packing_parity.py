"""Packed rows give the numbers padded rows give, on 8 gloo ranks at TP=2, PP=2, DP=2.

One `MegatronActor` (a random Qwen2: q/k/v biases, tied output layer) lays the same sequences out
padded and packed (`parallel.pack_sequences`); the two layouts put sequences on different DP ranks
and micro-batches. Compared per sequence and per token: the old-log-prob pass (log-probs and
entropies, also through the fused output layer and the KL reference), the exact global entropy
statistics, the HAPO loss (token-mean and seq-mean-token-mean, whose per-sequence normalisation a
packed row must not merge), its metrics, the gradients of every parameter shard, and the token
diagnostics. The weights are the same in both, so only float32 rounding may differ (see TOL).
"""


import numpy as np
import pytest
import torch

from tests.convert.dist_checks import random_hf_model
from tests.distributed import run_distributed

pytestmark = pytest.mark.slow  # 8 ranks, about 4 min on 2 cores; run by default

TP, PP, DP = 2, 2, 2
NUM_SEQS, BUDGET = 14, 64
#: float32 rounding: the two layouts add the same products in another order (matmuls of other
#: shapes, softmax over rows of other lengths). Each result is a few sums of O(1) terms over
#: hidden 64 / vocab 256 through 2 layers: a relative error of a few hundred float32 ulps (eps
#: 1.2e-7) at most, far below the smallest real effect (a wrong mask or position moves log-probs
#: by > 1e-2: the mutations named in this file's tests).
RTOL, ATOL = 1e-4, 2e-5


def _sequences():
    from hapo_megatron.training.batches.micro_batches import SequenceData
    g = torch.Generator().manual_seed(11)
    seqs = []
    for i in range(NUM_SEQS):
        p, r = int(torch.randint(2, 7, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
        seqs.append(SequenceData(torch.randint(4, 200, (p,), generator=g).tolist(),
                                 torch.randint(4, 200, (r,), generator=g).tolist(),
                                 advantage=float(torch.randn(1, generator=g)),
                                 rollout_logprobs=(-torch.rand(r, generator=g) * 3).tolist(),
                                 temperatures=(0.8 + 0.4 * torch.rand(r, generator=g)).tolist() if i % 3 else [],
                                 index=i))
    return seqs


def _per_sequence(mbs, names) -> dict:
    """{seq_index: {name: valid tokens of that field}} of micro-batches (packed or padded)."""
    out = {}
    for mb in (m.unpacked() for m in mbs):
        for r, i in enumerate(mb.seq_index.tolist()):
            if i >= 0:
                m = mb.loss_mask[r] != 0
                out[i] = {n: getattr(mb, n)[r][m].double().numpy() for n in names}
                for k, u in enumerate(mb.updates):
                    out[i].update({f"upd{k}_{f}": getattr(u, f)[r][m].double().numpy()
                                   for f in ("ratio", "adv_after", "clip_low", "clip_high", "clip_dual")})
    return out


def _grads(actor) -> dict:
    return {n: p.main_grad.detach().double().clone().numpy() for n, p in actor.model[0].named_parameters()}


def _run_layout(actor, g, seqs, pack: bool, ref_model):
    import torch.distributed as dist

    from hapo_megatron.config import AlgoConfig
    from hapo_megatron.algo import PolicyLossConfig
    from hapo_megatron.parallel.loss import make_loss_func
    from hapo_megatron.parallel.stats import global_entropy_stats
    from hapo_megatron.parallel.collectives import sum_metrics
    from hapo_megatron.training.batches.micro_batches import PadMultiples, build_rank_micro_batches
    from hapo_megatron.training.metrics.diagnostics import accumulate_token_diagnostics
    from hapo_megatron.training.stages import with_old_policy

    pads = PadMultiples.of(tp_size=g.tp_size, cp_size=g.cp_size, sequence_parallel=False)
    mbs = build_rank_micro_batches(seqs, dp_rank=g.dp_rank, dp_size=g.dp_size, max_tokens_per_micro_batch=BUDGET,
                                   pack=pack, seq_multiple=pads.seq_multiple, row_multiple=pads.row_multiple,
                                       micro_batch_size=1)
    assert all(mb.is_packed == pack for mb in mbs)
    last, contribute = g.is_pipeline_last, g.is_pipeline_last and g.tp_rank == 0
    out = {"num_micro_batches": len(mbs)}
    policy = actor.compute_logprobs_entropy(mbs, temperature=0.9)
    actor.fused_output_layer = True
    fused = actor.compute_logprobs_entropy(mbs, temperature=0.9)
    actor.fused_output_layer = False
    ref = actor.compute_logprobs_entropy(mbs, temperature=0.9, model=ref_model)
    stats = None
    if last:
        mbs = [with_old_policy(mb, lp, ent, old_logprob_source="recompute", ref_logprobs=r[0])
               for mb, (lp, ent), r in zip(mbs, policy, ref)]
        fused_mbs = [mb.with_(old_logprobs=lp, old_entropy=ent) for mb, (lp, ent) in zip(mbs, fused)]
        ent = torch.cat([mb.old_entropy.reshape(-1) for mb in mbs])
        mask = torch.cat([mb.loss_mask.reshape(-1) for mb in mbs])
        stats = global_entropy_stats(ent, mask, group=g.dp, entropy_pivot=0.8)
        out["stats"] = stats.to_dict()
        if contribute:
            out["tokens"] = _per_sequence(mbs, ("old_logprobs", "old_entropy", "ref_logprobs", "temperatures"))
            out["fused"] = _per_sequence(fused_mbs, ("old_logprobs", "old_entropy"))
    stats = _broadcast_stats(stats, g)
    for mode in ("token-mean", "seq-mean-token-mean"):
        cfg = PolicyLossConfig(clip_ratio_high=0.28, loss_agg_mode=mode, kl_loss_coef=0.1, tis_cap=2.0)
        recorded = []
        for chunk in actor.model:
            chunk.zero_grad_buffer()
        metrics = actor.forward_backward(
            mbs, lambda mb: make_loss_func(mb, cfg=cfg, stats=stats, tp_group=g.tp, temperature=0.9,
                                           on_token_fields=recorded.append), forward_only=False)
        sums = {}
        for m in metrics:
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        out[f"metrics/{mode}"] = sum_metrics(sums, contribute=contribute)
        out[f"grads/{mode}"] = _grads(actor)
        if mode == "token-mean" and last:
            mbs = [mb.with_(updates=(u.apply(lambda t: t.cpu()),)) for mb, u in zip(mbs, recorded)]
    diag = accumulate_token_diagnostics(mbs, stats, AlgoConfig()) if contribute else None
    if diag is None:
        from hapo_megatron.analysis import TokenDiagnostics
        diag = TokenDiagnostics()
    diag.all_reduce()
    out["diag"] = diag.summary(pivot=float(np.exp(stats.pivot)))
    if contribute:
        out["updates"] = _per_sequence(mbs, ())
    dist.barrier()
    return out


def _broadcast_stats(stats, g):
    import torch.distributed as dist

    from hapo_megatron.algo import EntropyStats
    from hapo_megatron.parallel.collectives import broadcast_object
    last = dist.get_global_rank(g.pp, g.pp_size - 1)
    return EntropyStats.from_dict(broadcast_object(stats.to_dict() if stats is not None else None, src=last,
                                                   group=g.pp))


def _parity_ranks(rank, world, path):
    from transformers import AutoConfig

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.parallel.groups import initialize_parallel
    from hapo_megatron.training.actor import MegatronActor

    g = initialize_parallel(tp=TP, pp=PP, seed=3)
    assert (g.tp_size, g.pp_size, g.dp_size) == (TP, PP, DP)
    actor = MegatronActor(AutoConfig.from_pretrained(path), groups=g, total_optimizer_steps=10, init_hf_path=path,
                          optim=OptimConfig(lr=1e-2, lr_warmup_steps=0, weight_decay=0.0),
                              dtype='fp32', use_te=None, sequence_parallel=False, recompute_activations=False,
                              use_distributed_optimizer=True, fused_output_layer=False, moe_aux_loss_coef=None)
    ref_model = actor.make_reference()
    seqs = _sequences()
    padded = _run_layout(actor, g, seqs, False, ref_model)
    packed = _run_layout(actor, g, seqs, True, ref_model)
    return {"padded": padded, "packed": packed, "coords": (g.tp_rank, g.pp_rank, g.dp_rank)}


def _close(a, b, what):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64),
                               rtol=RTOL, atol=ATOL, err_msg=what)


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    _, hf = random_hf_model("qwen2", num_hidden_layers=2)
    hf.save_pretrained(path)
    return run_distributed(_parity_ranks, TP * PP * DP, path, timeout=900)


def _merged(results, layout, key):
    out = {}
    for r in results:
        out.update(r[layout].get(key, {}))
    return out


def test_packed_rows_never_need_more_micro_batches(parity):
    for r in parity:
        assert 1 <= r["packed"]["num_micro_batches"] <= r["padded"]["num_micro_batches"]


@pytest.mark.parametrize("key", ["tokens", "fused", "updates"])
def test_per_token_values_match(parity, key):
    padded, packed = _merged(parity, "padded", key), _merged(parity, "packed", key)
    assert sorted(padded) == sorted(packed) == list(range(NUM_SEQS))
    for i in range(NUM_SEQS):
        assert sorted(padded[i]) == sorted(packed[i])
        for name in padded[i]:
            assert padded[i][name].size > 0
            _close(packed[i][name], padded[i][name], f"{key} seq {i} {name}")


def test_entropy_stats_loss_metrics_and_diagnostics_match(parity):
    for r in parity:
        if "stats" in r["padded"]:
            for k, v in r["padded"]["stats"].items():
                _close(r["packed"]["stats"][k], v, f"stats {k}")
        for mode in ("token-mean", "seq-mean-token-mean"):
            pad, pk = r["padded"][f"metrics/{mode}"], r["packed"][f"metrics/{mode}"]
            assert sorted(pad) == sorted(pk) and pad["loss/num_tokens"] > 0
            for k in pad:
                _close(pk[k], pad[k], f"{mode} {k}")
            _close(pk["loss/objective_sum"] / pk["loss/normalizer"], pad["loss/objective_sum"] / pad["loss/normalizer"],
                   f"{mode} loss")
        assert r["packed"]["diag"].keys() == r["padded"]["diag"].keys() and r["padded"]["diag"]
        for k, v in r["padded"]["diag"].items():
            _close(r["packed"]["diag"][k], v, f"diag {k}")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gradients_match(parity, mode):
    for r in parity:
        pad, pk = r["padded"][f"grads/{mode}"], r["packed"][f"grads/{mode}"]
        assert sorted(pad) == sorted(pk)
        scale = max(float(np.abs(v).max()) for v in pad.values())
        assert scale > 0
        for name in pad:
            np.testing.assert_allclose(pk[name], pad[name], rtol=RTOL, atol=ATOL * scale,
                                       err_msg=f"{mode} {r['coords']} {name}")
