"""The proximal log-probs of the off-policy correction (training/off_policy.py) and the config
that turns it on.

The engine's log-probs are taken under ``softmax(z / T_t)`` with each token's sampling
temperature; the proximal ones must be too. A fake actor computes log-probs from fixed logits at
whatever temperature it is asked for, so the test sees which one was used.
Mutations tried: `with_proximal_logprobs` passing ``T_base`` instead of ``"per_token"`` fails
`test_proximal_logprobs_at_the_sampling_temperatures`; `stages.old_logprob_pass` without the
`with_proximal_logprobs` call leaves ``proximal_logprobs`` None and the loss refuses the batch
(`test_loss_refuses_a_batch_without_proximal_logprobs`)."""

from types import SimpleNamespace

import pytest
import torch

from hapo_megatron.algo import EntropyStats
from hapo_megatron.config import AlgoConfig, RolloutConfig, load_config
from hapo_megatron.algo import PolicyLossConfig
from hapo_megatron.parallel.loss import hapo_loss_from_logits
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.training.off_policy import with_proximal_logprobs

B, S, V = 2, 4, 5
STATS = EntropyStats(pivot=1.0, std=0.5, pos_max=2.0, neg_min=-2.0)


class FakeActor:
    """Log-probs of fixed logits at the asked temperature (a float, or each micro-batch's own)."""

    def __init__(self, logits):
        self.logits, self.calls = logits, []

    def compute_logprobs_entropy(self, mbs, *, temperature, chunk_size=None, model=None):
        self.calls.append(temperature)
        out = []
        for mb in mbs:
            t = mb.temperatures.unsqueeze(-1) if temperature == "per_token" else temperature
            lp = torch.log_softmax(self.logits / t, -1).gather(-1, mb.labels.unsqueeze(-1)).squeeze(-1)
            out.append((lp * mb.loss_mask, torch.zeros_like(lp)))
        return out


def _setup(adaptive, mode="token_tis", cap=2.0):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, S, V, generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    temps = torch.where(mask != 0, 0.8 + 0.4 * torch.rand(B, S, generator=g), torch.ones(B, S))
    t_base = 1.0
    at_base = torch.log_softmax(logits / t_base, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1) * mask
    rollout = (at_base + 0.3 * torch.randn(B, S, generator=g)) * mask
    mb = MicroBatch(input_ids=labels, position_ids=labels, labels=labels, loss_mask=mask,
                    rollout_logprobs=rollout, temperatures=temps, recomputed_logprobs=at_base,
                    old_logprobs=at_base, advantages=torch.ones(B, S))
    cfg = SimpleNamespace(rollout=RolloutConfig(temperature=t_base),
                          algo=AlgoConfig.from_dict(dict(adaptive_temperature=adaptive, rollout_is=mode,
                                                         rollout_is_cap=cap)))
    actor = FakeActor(logits)
    rt = SimpleNamespace(cfg=cfg, rl=SimpleNamespace(rollout_entropy_stats=STATS), actor=actor,
                         groups=SimpleNamespace(is_pipeline_last=True), contributes_metrics=True)
    return rt, mb, logits, at_base


def test_proximal_logprobs_at_the_sampling_temperatures():
    rt, mb, logits, at_base = _setup(adaptive=True)
    (out,), metrics = with_proximal_logprobs(rt, [mb])
    want = torch.log_softmax(logits / mb.temperatures.unsqueeze(-1), -1).gather(
        -1, mb.labels.unsqueeze(-1)).squeeze(-1) * mb.loss_mask
    assert rt.actor.calls == ["per_token"]
    torch.testing.assert_close(out.proximal_logprobs, want)
    assert not torch.allclose(out.proximal_logprobs, at_base)  # the temperatures matter here
    valid = mb.loss_mask != 0
    r = torch.exp((want - mb.rollout_logprobs)[valid].double())
    assert metrics["rollout_is/weight_mean"] == pytest.approx(float(r.clamp(max=2.0).mean()), rel=1e-6)
    assert metrics["rollout_is/weight_max"] == pytest.approx(float(r.clamp(max=2.0).max()), rel=1e-6)
    assert metrics["rollout_is/chi2"] == pytest.approx(float((r * r - 1).mean()), rel=1e-6)
    assert metrics["rollout_is/kl_k1"] == pytest.approx(float(-r.log().mean()), rel=1e-6, abs=1e-9)


def test_without_adaptive_temperature_the_old_logprob_pass_is_reused():
    rt, mb, _, at_base = _setup(adaptive=False)
    (out,), metrics = with_proximal_logprobs(rt, [mb])
    assert rt.actor.calls == []  # no second forward pass: every T_t is T_base
    assert torch.equal(out.proximal_logprobs, at_base)
    assert set(metrics) == {"rollout_is/weight_mean", "rollout_is/weight_max", "rollout_is/capped_frac",
                            "rollout_is/kl_k1", "rollout_is/kl_k3", "rollout_is/chi2"}


def test_loss_refuses_a_batch_without_proximal_logprobs():
    _, mb, logits, _ = _setup(adaptive=False)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        hapo_loss_from_logits(logits, mb, cfg=PolicyLossConfig(rollout_is="seq_tis", adaptive_clip=False,
                                                         adaptive_advantage=False), stats=None, temperature=1.0)


def test_loss_none_ignores_the_proximal_field_bit_for_bit():
    _, mb, logits, _ = _setup(adaptive=False)
    cfg = PolicyLossConfig(adaptive_clip=False, adaptive_advantage=False)
    a = hapo_loss_from_logits(logits, mb, cfg=cfg, stats=None, temperature=1.0)
    b = hapo_loss_from_logits(logits, mb.with_(proximal_logprobs=mb.rollout_logprobs + 1), cfg=cfg, stats=None,
                              temperature=1.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(a[2][k], b[2][k]) for k in a[2])


@pytest.mark.parametrize("override,message", [
    (["algo.rollout_is=bogus"], "algo.rollout_is must be one of"),
    (["algo.rollout_is=token_tis", "algo.rollout_is_cap=0"], "algo.rollout_is_cap must be > 0.0"),
    (["algo.rollout_is=token_tis", "algo.tis_cap=2"], "algo.tis_cap and algo.rollout_is"),
    (["algo.rollout_is=seq_tis", "algo.old_logprob_source=rollout"], "algo.old_logprob_source=recompute"),
])
def test_config_refuses(override, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_config(overrides=override)
