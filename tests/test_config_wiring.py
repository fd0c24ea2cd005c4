"""Config sections -> component settings: every knob arrives, none silently keeps a default.

Each test sets every mapped field to a value different from both sides' defaults and checks it
arrives; dropping or hard-coding one field on the way (e.g. `h_hat_mode`) fails here."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from hapo_megatron.algo import EntropyStats, PolicyLossConfig
from hapo_megatron.config import AlgoConfig, HapoConfig, RolloutConfig, config_keys, load_config
from hapo_megatron.rollout.engine import SamplingParams

# a non-default value for every PolicyLossConfig field (written algo.<name> in a config)
ALGO_TO_LOSS = dict(
    clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=10.0, adaptive_clip=False, clip_alpha=0.5,
    adaptive_advantage=False, adv_beta=0.25, loss_agg_mode="seq-mean-token-sum-norm", h_hat_mode="reference",
    entropy_stats_scope="microbatch", h_hat_entropy="current", entropy_pivot=0.6, kl_loss_coef=0.01,
    kl_loss_type="k1", entropy_coeff=0.001, old_logprob_source="rollout", tis_cap=2.0, rollout_is="none",
    rollout_is_cap=1.5, policy_loss="cispo", sapo_tau_pos=0.5, sapo_tau_neg=0.75, clip_cov_ratio=0.001,
    clip_cov_lb=0.5, clip_cov_ub=4.0, kl_cov_ratio=0.001, kl_cov_coef=0.5, cov_scope="micro_batch",
    forking_tokens=True, forking_rho=0.3, archer=True, archer_quantile=0.7, archer_low_clip_ratio_low=0.1,
    archer_low_clip_ratio_high=0.15, archer_high_clip_ratio_low=0.4, archer_high_clip_ratio_high=0.45,
    archer_high_kl_coef=0.01, edge_eda=True,
)
# pairs the loss refuses together: "all at once" leaves these out
EXCLUSIVE = {"old_logprob_source", "tis_cap", "policy_loss", "forking_tokens", "archer"}
# knobs valid only beside others (docs/algorithm.md): what the one-knob test sets with them
COMPANIONS = {"archer": ["algo.kl_loss_coef=0.001", "algo.adaptive_clip=false"]}


def test_every_loss_field_is_covered_by_this_test():
    names = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    assert names == set(ALGO_TO_LOSS), "a PolicyLossConfig field has no wiring check"


def test_the_loss_knobs_are_algo_keys_defined_once():
    keys = config_keys(AlgoConfig)
    assert {k for k, (_, holder) in keys.items() if holder == "loss"} == set(ALGO_TO_LOSS)
    own = {f.name for f in dataclasses.fields(AlgoConfig)}
    assert not own & set(ALGO_TO_LOSS), "a loss knob is declared in AlgoConfig too"


@pytest.mark.parametrize("name", sorted(ALGO_TO_LOSS))
def test_a_loss_knob_reaches_the_loss_config(name):
    value = ALGO_TO_LOSS[name]
    assert getattr(PolicyLossConfig(), name) != value
    cfg = load_config(overrides=[f"algo.{name}={value}" if value is not None else f"algo.{name}=null",
                                 *COMPANIONS.get(name, [])])
    assert getattr(cfg.algo.loss, name) == value
    saved = HapoConfig.from_dict(cfg.to_dict())  # a saved config.yaml writes it back as algo.<name>
    assert cfg.to_dict()["algo"][name] == value and getattr(saved.algo.loss, name) == value


def test_all_loss_knobs_at_once():
    given = {k: v for k, v in ALGO_TO_LOSS.items() if k not in EXCLUSIVE} | {"rollout_is": "seq_tis"}
    algo = AlgoConfig.from_dict(given)
    assert {k: getattr(algo.loss, k) for k in given} == given


def test_a_bad_loss_knob_names_its_config_key():
    with pytest.raises(ValueError, match=r"^algo\.clip_ratio_c must be > 1"):
        load_config(overrides=["algo.clip_ratio_c=1"])
    with pytest.raises(ValueError, match=r"^algo\.rollout_is=token_tis .* algo\.old_logprob_source=recompute"):
        AlgoConfig.from_dict(dict(rollout_is="token_tis", old_logprob_source="rollout"))


def test_rollout_is_auto_is_resolved_in_one_place():
    assert AlgoConfig().loss.rollout_is == "auto" and AlgoConfig().loss.rollout_is_mode == "none"
    fp8 = {"rollout": {"engine": "sglang", "quantization": "fp8"}}
    assert HapoConfig.from_dict(fp8).algo.loss.rollout_is == "token_tis"
    assert HapoConfig.from_dict({**fp8, "algo": {"tis_cap": 2.0}}).algo.loss.rollout_is == "none"
    assert HapoConfig.from_dict({**fp8, "algo": {"old_logprob_source": "rollout"}}).algo.loss.rollout_is == "none"
    assert HapoConfig().algo.loss.rollout_is == "none"


STATS = EntropyStats(pivot=-1.0, std=0.5, pos_max=2.0, neg_min=-2.0)
ROLLOUT = dict(n=5, temperature=0.9, top_p=0.8, top_k=7, max_response_length=33,
               val_n=3, val_temperature=0.4, val_top_p=0.6)


def test_sampling_params_from_config_carries_every_field():
    rc = RolloutConfig(**ROLLOUT)
    algo = AlgoConfig.from_dict(dict(temperature_tau=0.3, h_hat_mode="reference"))
    p = SamplingParams.from_config(rc, algo, entropy_stats=STATS, seed=11, stop_token_ids=[2])
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_new_tokens) == (5, 0.9, 0.8, 7, 33)
    assert (p.adaptive, p.entropy_stats, p.temperature_tau, p.h_hat_mode) == (True, STATS, 0.3, "reference")
    assert (p.seed, p.stop_token_ids) == (11, (2,))
    assert SamplingParams.from_config(rc, AlgoConfig.from_dict(dict(h_hat_mode="signed"))).h_hat_mode == "signed"
    off = SamplingParams.from_config(rc, AlgoConfig(adaptive_temperature=False), entropy_stats=STATS)
    assert (off.adaptive, off.entropy_stats) == (False, None)
    val = SamplingParams.from_config(rc, algo, validation=True, entropy_stats=STATS)
    assert (val.n, val.temperature, val.top_p, val.top_k, val.adaptive) == (3, 0.4, 0.6, -1, False)


def test_sampling_params_from_config_needs_the_algo_fields():
    rc = RolloutConfig(**ROLLOUT)
    with pytest.raises(ValueError, match="algo_cfg"):
        SamplingParams.from_config(rc, None)
    with pytest.raises(AttributeError, match="h_hat_mode"):
        SamplingParams.from_config(rc, SimpleNamespace(adaptive_temperature=True, temperature_tau=0.1,
                                                       loss=SimpleNamespace()))


def test_sampling_params_take_the_adaptive_knobs_from_their_caller():
    """``temperature_tau`` and ``h_hat_mode`` have no default of their own (algo.temperature_tau and
    algo.loss.h_hat_mode hold it): adaptive sampling without them is refused, validation sampling
    (never adaptive) is built from the rollout section alone."""
    plain = dict(temperature=1.0, top_p=1.0, top_k=-1)
    with pytest.raises(ValueError, match="algo.temperature_tau") as e:
        SamplingParams(**plain, adaptive=True, h_hat_mode="signed")
    assert "h_hat_mode" not in str(e.value)
    with pytest.raises(ValueError, match="algo.loss.h_hat_mode"):
        SamplingParams(**plain, adaptive=True, temperature_tau=0.05)
    with pytest.raises(ValueError, match="algo.temperature_tau.*algo.loss.h_hat_mode"):
        SamplingParams(**plain, adaptive=True)
    with pytest.raises(ValueError, match="algo.loss.h_hat_mode"):
        SamplingParams(**plain, adaptive=False).with_(adaptive=True, temperature_tau=0.05)
    with pytest.raises(TypeError):
        SamplingParams(temperature=1.0, top_p=1.0)  # top_k is required
    with pytest.raises(TypeError):
        SamplingParams(1, 1.0, 1.0, -1)  # keywords only
    plain_params = SamplingParams(**plain)
    assert (plain_params.adaptive, plain_params.temperature_tau, plain_params.h_hat_mode) == (False, None, None)
    rc = RolloutConfig(**ROLLOUT)
    val = SamplingParams.from_config(rc, validation=True, entropy_stats=STATS)
    assert (val.n, val.temperature, val.top_p, val.top_k, val.adaptive) == (3, 0.4, 0.6, -1, False)
    assert (val.temperature_tau, val.h_hat_mode, val.uses_adaptive) == (None, None, False)
