"""The trainer's step-wide selections (docs/algorithm.md, "Forking tokens", "Clip-Cov and KL-Cov"):
the forking-token threshold (`stages.forking_threshold`) and the Clip-Cov / KL-Cov statistics
(`stages.step_cov_stats`) are the algo values over every micro-batch of the step together, and are
only computed where the loss runs with the switch on."""

from types import SimpleNamespace

import torch

from hapo_megatron.algo import PolicyLossConfig, forking_threshold as algo_threshold
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.training import stages


def _mb(seed, b=2, s=5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 9, (b, s), generator=g)
    return MicroBatch(input_ids=ids, position_ids=torch.arange(s).expand(b, s), labels=ids,
                      loss_mask=(torch.rand(b, s, generator=g) > 0.3).float(),
                      old_entropy=torch.rand(b, s, generator=g))


def _rt(loss: PolicyLossConfig, last: bool = True):
    return SimpleNamespace(cfg=SimpleNamespace(algo=SimpleNamespace(loss=loss)),
                           groups=SimpleNamespace(is_pipeline_last=last, dp=None, tp_rank=0, cp_rank=0, dp_rank=0),
                           actor=SimpleNamespace(device=torch.device("cpu")))


def test_step_threshold_spans_every_micro_batch():
    minis = [[_mb(0), _mb(1)], [_mb(2)]]
    on = PolicyLossConfig(forking_tokens=True, forking_rho=0.25)
    ent = torch.cat([mb.old_entropy.reshape(-1) for mini in minis for mb in mini])
    mask = torch.cat([mb.loss_mask.reshape(-1) for mini in minis for mb in mini])
    assert stages.forking_threshold(_rt(on), minis) == algo_threshold(ent, mask, 0.25)
    assert stages.forking_threshold(_rt(on), minis) != algo_threshold(minis[0][0].old_entropy,
                                                                      minis[0][0].loss_mask, 0.25)
    assert stages.forking_threshold(_rt(PolicyLossConfig()), minis) is None
    assert stages.forking_threshold(_rt(on, last=False), minis) is None


def test_step_cov_stats_span_every_micro_batch_and_follow_the_step():
    from hapo_megatron.algo import cov_stats, position_keys, step_seed

    def mb(seed, rows):
        g = torch.Generator().manual_seed(seed)
        base = _mb(seed)
        return base.with_(advantages=torch.randn(2, 1, generator=g).expand(2, 5).contiguous(),
                          old_logprobs=-torch.rand(2, 5, generator=g) * 3, seq_index=torch.tensor(rows))
    minis = [[mb(0, [0, 1]), mb(1, [2, 3])], [mb(2, [4, 5])]]
    cfg = PolicyLossConfig(policy_loss="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=0.0)
    rt = _rt(cfg)
    rt.cfg.trainer, rt.rl = SimpleNamespace(seed=3), SimpleNamespace(step=7)
    got = stages.step_cov_stats(rt, minis)
    flat = [m for mini in minis for m in mini]

    def cat(fn):
        return torch.cat([fn(m) for m in flat])
    seed = step_seed(3, 7)
    keys = cat(lambda m: position_keys(seed, m.tokens_of_sequences(m.seq_index), m.position_ids))
    want = cov_stats("clip_cov", cat(lambda m: m.advantages), cat(lambda m: m.old_logprobs),
                     cat(lambda m: m.loss_mask), keys, seed=seed, ratio=0.2, lb=0.0, ub=5.0)
    assert got == want and got.threshold is not None
    rt.rl.step = 8
    assert stages.step_cov_stats(rt, minis).seed != got.seed
    micro = PolicyLossConfig(policy_loss="clip_cov", cov_scope="micro_batch")
    rt2 = _rt(micro)
    rt2.cfg.trainer, rt2.rl = rt.cfg.trainer, rt.rl
    assert stages.step_cov_stats(rt2, minis).threshold is None
    assert stages.step_cov_stats(_rt(PolicyLossConfig()), minis) is None


def test_step_cov_metrics_describe_the_step_batch():
    """``cov/*``: the covariances of every micro-batch of the step together, in both scopes; nothing
    without Clip-Cov / KL-Cov, nor on a stage without the loss when no rank of the last one adds them."""
    from hapo_megatron.parallel.cov import global_cov_distribution

    def mb(seed):
        g = torch.Generator().manual_seed(seed)
        return _mb(seed).with_(advantages=torch.randn(2, 1, generator=g).expand(2, 5).contiguous(),
                               old_logprobs=-torch.rand(2, 5, generator=g) * 3)
    minis = [[mb(0), mb(1)], [mb(2)]]
    flat = [m for mini in minis for m in mini]
    want = global_cov_distribution(*(torch.cat([getattr(m, k).reshape(-1) for m in flat])
                                     for k in ("advantages", "old_logprobs", "loss_mask")))
    assert want != global_cov_distribution(flat[0].advantages, flat[0].old_logprobs, flat[0].loss_mask)
    for scope in ("step", "micro_batch"):
        for loss in ("clip_cov", "kl_cov"):
            hapo = loss == "clip_cov"  # KL-Cov has no clip range for HAPO to adapt
            cfg = PolicyLossConfig(policy_loss=loss, cov_scope=scope, adaptive_clip=hapo, adaptive_advantage=hapo)
            assert stages.step_cov_metrics(_rt(cfg), minis) == want
    assert stages.step_cov_metrics(_rt(PolicyLossConfig()), minis) == {}
    assert stages.step_cov_metrics(_rt(PolicyLossConfig(policy_loss="clip_cov"), last=False), minis) == {}
