"""MegatronActor on 2 gloo ranks (TP=2): old log-probs match an HF forward (label shift, weight
load) and the fused output layer's (from hidden states), a step changes the weights, a non-finite
loss skips the update, save/load round trip."""

import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.training.tiny_setup import prepare_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return prepare_tiny(str(tmp_path_factory.mktemp("tiny")), n_train=16, n_val=4)


def _actor_checks(rank, world, data, ckpt_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from hapo_megatron.config import OptimConfig
    from hapo_megatron.parallel.groups import initialize_parallel
    from hapo_megatron.training.actor import MegatronActor
    from hapo_megatron.training.batches.micro_batches import SequenceData, build_rank_micro_batches
    from hapo_megatron.training.sft import cross_entropy_loss_factory

    g = initialize_parallel(tp=2, seed=3)
    path = os.path.join(data, "model")
    hf_config = AutoConfig.from_pretrained(path)
    actor = MegatronActor(hf_config, groups=g, optim=OptimConfig(lr=1e-2, lr_warmup_steps=0, weight_decay=0.0),
                          total_optimizer_steps=10, init_hf_path=path,
                              dtype='fp32', use_te=None, sequence_parallel=False, recompute_activations=False,
                              use_distributed_optimizer=True, fused_output_layer=False, moe_aux_loss_coef=None)
    gen = torch.Generator().manual_seed(0)
    seqs = [SequenceData(torch.randint(4, 80, (5 + i,), generator=gen).tolist(),
                         torch.randint(4, 80, (3 + 2 * i,), generator=gen).tolist(), index=i) for i in range(3)]
    mbs = build_rank_micro_batches(seqs, dp_rank=0, dp_size=1, micro_batch_size=2, max_tokens_per_micro_batch=None)
    old = actor.compute_logprobs_entropy(mbs, temperature=1.0)
    actor.fused_output_layer = True  # the same pass from hidden states (no logits)
    fused = actor.compute_logprobs_entropy(mbs, temperature=0.8)
    reference = actor.make_reference()  # the KL reference's pass (a copy of the current weights)
    ref_out = actor.compute_logprobs_entropy(mbs, temperature=0.8, model=reference)
    actor.fused_output_layer = False
    plain = actor.compute_logprobs_entropy(mbs, temperature=0.8)
    fused_err = max(float((a[k] - b[k]).abs().max()) for x, y in ((fused, plain), (ref_out, plain))
                    for a, b in zip(x, y) for k in (0, 1))
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    max_err = 0.0
    for mb, (lp, _) in zip(mbs, old):
        with torch.no_grad():
            logits = hf(input_ids=mb.input_ids).logits.float()
        ref = torch.log_softmax(logits, -1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1) * mb.loss_mask
        max_err = max(max_err, float((ref - lp).abs().max()))
    actor.save(ckpt_dir + "_before_any_step")  # a run stopped before its first update saves too
    before = [p.detach().clone() for p in actor.model[0].parameters()]
    res = actor.train_step(mbs, cross_entropy_loss_factory(g.tp))
    moved = any(not torch.equal(a, b) for a, b in zip(before, actor.model[0].parameters()))

    def nan_loss(mb):
        def loss_func(output):
            loss = output.sum() * float("nan")
            return loss, mb.loss_mask.sum().to(torch.int), {"x": loss.detach()}
        return loss_func
    after_ok = [p.detach().clone() for p in actor.model[0].parameters()]
    bad = actor.train_step(mbs, nan_loss)
    unchanged = all(torch.equal(a, b) for a, b in zip(after_ok, actor.model[0].parameters()))
    # save -> one more step -> load -> the same step again gives the same weights
    actor.save(ckpt_dir)
    actor.train_step(mbs, cross_entropy_loss_factory(g.tp))
    w1 = [p.detach().clone() for p in actor.model[0].parameters()]
    actor.load(ckpt_dir)
    actor.train_step(mbs, cross_entropy_loss_factory(g.tp))
    replay_equal = all(torch.equal(a, b) for a, b in zip(w1, actor.model[0].parameters()))
    # the HAPO loss moves log-probs in the direction of the advantage
    from hapo_megatron.algo import EntropyStats
    from hapo_megatron.config import AlgoConfig
    from hapo_megatron.parallel.loss import make_loss_func
    for i, s in enumerate(seqs):
        s.advantage = 1.0 if i % 2 == 0 else -1.0
    mbs = build_rank_micro_batches(seqs, dp_rank=0, dp_size=1, micro_batch_size=4, max_tokens_per_micro_batch=None)
    (lp, ent), = actor.compute_logprobs_entropy(mbs, temperature=1.0)
    mbs = [mbs[0].with_(old_logprobs=lp, old_entropy=ent)]
    lc = AlgoConfig().loss
    actor.train_step(mbs, lambda mb: make_loss_func(mb, cfg=lc, stats=EntropyStats.neutral(), tp_group=g.tp,
                                                    temperature=1.0))
    (after, _), = actor.compute_logprobs_entropy(mbs, temperature=1.0)
    delta = (after.sum(1) - lp.sum(1)).tolist()
    names = [n for n, _ in actor.export_hf_weights()]
    return dict(max_err=max_err, fused_err=fused_err, skipped=res.skipped, moved=moved, bad_skipped=bad.skipped,
                unchanged=unchanged, num_skipped=actor.num_skipped, replay_equal=replay_equal, delta=delta,
                names=sorted(names), hf_names=sorted(hf.state_dict()))


def test_actor_tp2(tiny, tmp_path):
    out = run_distributed(_actor_checks, 2, tiny, str(tmp_path / "ckpt"), timeout=300)
    for r in out:
        assert r["max_err"] < 1e-4, r["max_err"]
        assert r["fused_err"] < 1e-5, r["fused_err"]
        assert not r["skipped"] and r["moved"]
        assert r["bad_skipped"] and r["unchanged"] and r["num_skipped"] == 1
        assert r["replay_equal"]
        assert r["names"] == r["hf_names"]
        assert [d > 0 for d in r["delta"]] == [True, False, True], r["delta"]
