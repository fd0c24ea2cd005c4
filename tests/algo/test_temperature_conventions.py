"""`h_hat_mode: reference` follows the authors' trainer, not their vLLM sampler.

docs/algorithm.md ("What `reference` reproduces, and what it does not") states the choice: the
rollout temperature uses the trainer's conventions (entropy at ``T_base``, floor 1e-8, ``z`` divided
by ``std``). The sampler's conventions (entropy at temperature 1, floor 1e-6, ``std + 1e-6``) are
written out here from that page, so the claim that they differ, and by how much, is checked.
"""

import math

import torch

from hapo_megatron.algo import adaptive_temperature, compute_entropy_stats, token_entropy
from tests.algo import loops
from hapo_megatron.algo.loss_config import PolicyLossConfig


def _sampler_h_hat(logits_row, stats, mode):
    """The authors' sampler: entropy of softmax(z) at T = 1, floor 1e-6, z over (std + 1e-6)."""
    pivot, std = stats[0], stats[1]
    return loops.h_hat_from_z((math.log(max(loops.entropy_row(logits_row, 1.0), 1e-6)) - pivot) / (std + 1e-6),
                              stats, mode)


def _case(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, 30, generator=g) * 2.0
    stats = compute_entropy_stats(token_entropy(torch.randn(64, 30, generator=g) * 2.0,
        temperature=1.0), torch.ones(64),
        entropy_pivot=PolicyLossConfig().entropy_pivot)
    return logits, stats


def test_reference_mode_uses_the_trainer_conventions_at_a_base_temperature_other_than_one():
    logits, stats = _case(0)
    t_base, tau = 0.6, 0.5
    got = adaptive_temperature(logits, stats, t_base, tau, "reference").double()
    rows = logits.double().tolist()
    trainer = torch.tensor([t_base * (1 + tau * loops.h_hat(loops.entropy_row(r, t_base), stats.as_tuple(),
                                                          "reference")) for r in rows], dtype=torch.float64)
    sampler = torch.tensor([t_base * (1 + tau * _sampler_h_hat(r, stats.as_tuple(), "reference")) for r in rows],
                           dtype=torch.float64)
    # float32 temperatures: a few ulp of t_base * (1 + tau) ~ 1e-7 relative
    torch.testing.assert_close(got, trainer, rtol=1e-5, atol=1e-6)
    # the sampler's entropy at T = 1 is a different number at T_base = 0.6: the rows move by far
    # more than float32 rounding, so a switch to the sampler's conventions fails the line above
    assert (got - sampler).abs().max().item() > 1e-2


def test_at_base_temperature_one_the_sampler_differs_only_by_its_epsilons():
    logits, stats = _case(1)
    tau = 0.5
    got = adaptive_temperature(logits, stats, 1.0, tau, "reference").double()
    sampler = torch.tensor([1.0 + tau * _sampler_h_hat(r, stats.as_tuple(), "reference")
                            for r in logits.double().tolist()], dtype=torch.float64)
    # std + 1e-6 changes z by ~1e-6 / std relative (std ~ 0.5 here) and no entropy is near the
    # floors, so the two agree to ~tau * 1e-5; float32 rounding of T adds ~1e-7
    torch.testing.assert_close(got, sampler, rtol=0, atol=tau * 1e-5)
