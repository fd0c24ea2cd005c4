"""Config sections -> component settings: every knob arrives, none silently keeps a default.

Each test sets every mapped field to a value different from both sides' defaults and checks it
arrives; dropping or hard-coding one field on the way (e.g. `h_hat_mode`) fails here."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from hapo_megatron.algo import EntropyStats
from hapo_megatron.config import AlgoConfig, RolloutConfig
from hapo_megatron.parallel.loss import LossConfig
from hapo_megatron.rollout.engine import SamplingParams

# a non-default value for every LossConfig field that comes from AlgoConfig
ALGO_TO_LOSS = dict(
    clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=10.0, adaptive_clip=False, clip_alpha=0.5,
    adaptive_advantage=False, adv_beta=0.25, loss_agg_mode="seq-mean-token-sum-norm", h_hat_mode="reference",
    entropy_stats_scope="microbatch", h_hat_entropy="current", entropy_pivot=0.6, kl_loss_coef=0.01,
    kl_loss_type="k1", entropy_coeff=0.001, tis_cap=2.0, rollout_is="seq_tis", rollout_is_cap=1.5,
)
EXCLUSIVE = {"tis_cap"}  # tis_cap and rollout_is cannot both be set: "all at once" leaves tis_cap out
NOT_FROM_ALGO = {"loss_scale_factor", "logprob_chunk_size"}  # trainer-side settings


def test_every_loss_field_is_covered_by_this_test():
    names = {f.name for f in dataclasses.fields(LossConfig)}
    assert names == set(ALGO_TO_LOSS) | NOT_FROM_ALGO, "a LossConfig field has no wiring check"


@pytest.mark.parametrize("name", sorted(ALGO_TO_LOSS))
def test_loss_config_from_algo_carries(name):
    value = ALGO_TO_LOSS[name]
    assert getattr(AlgoConfig(), name) != value and getattr(LossConfig(), name) != value
    cfg = LossConfig.from_algo(AlgoConfig(**{name: value}))
    assert getattr(cfg, name) == value


def test_loss_config_from_algo_all_at_once_and_trainer_settings():
    given = {k: v for k, v in ALGO_TO_LOSS.items() if k not in EXCLUSIVE}
    cfg = LossConfig.from_algo(AlgoConfig(**given), loss_scale_factor=64.0, logprob_chunk_size=128)
    assert {k: getattr(cfg, k) for k in given} == given
    assert (cfg.loss_scale_factor, cfg.logprob_chunk_size) == (64.0, 128)


def test_loss_config_from_algo_raises_on_a_missing_field():
    algo = {k: getattr(AlgoConfig(), k) for k in ALGO_TO_LOSS}
    del algo["h_hat_mode"]
    with pytest.raises(AttributeError, match="h_hat_mode"):
        LossConfig.from_algo(SimpleNamespace(**algo))


STATS = EntropyStats(pivot=-1.0, std=0.5, pos_max=2.0, neg_min=-2.0)
ROLLOUT = dict(n=5, temperature=0.9, top_p=0.8, top_k=7, max_response_length=33,
               val_n=3, val_temperature=0.4, val_top_p=0.6)


def test_sampling_params_from_config_carries_every_field():
    rc = RolloutConfig(**ROLLOUT)
    algo = AlgoConfig(temperature_tau=0.3, h_hat_mode="reference")
    p = SamplingParams.from_config(rc, algo, entropy_stats=STATS, seed=11, stop_token_ids=[2])
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (5, 0.9, 0.8, 7, 33)
    assert (p.adaptive, p.entropy_stats, p.temperature_tau, p.h_hat_mode) == (True, STATS, 0.3, "reference")
    assert (p.seed, p.stop_token_ids) == (11, (2,))
    assert SamplingParams.from_config(rc, AlgoConfig(h_hat_mode="signed")).h_hat_mode == "signed"
    off = SamplingParams.from_config(rc, AlgoConfig(adaptive_temperature=False), entropy_stats=STATS)
    assert (off.adaptive, off.entropy_stats) == (False, None)
    val = SamplingParams.from_config(rc, algo, validation=True, entropy_stats=STATS)
    assert (val.n, val.temperature, val.top_p, val.top_k, val.adaptive) == (3, 0.4, 0.6, -1, False)


def test_sampling_params_from_config_needs_the_algo_fields():
    rc = RolloutConfig(**ROLLOUT)
    with pytest.raises(ValueError, match="algo_cfg"):
        SamplingParams.from_config(rc, None)
    with pytest.raises(AttributeError, match="h_hat_mode"):
        SamplingParams.from_config(rc, SimpleNamespace(adaptive_temperature=True, temperature_tau=0.1))
