"""Config: field docs, validation messages, coercion, YAML + overrides, presets, cross-section checks."""

import dataclasses
import os

import pytest
import yaml

from hapo_megatron import config as C
from hapo_megatron.config import (
    AlgoConfig, HapoConfig, ParallelConfig, PRESETS, field_docs, format_config, load_config, save_config,
)

SECTION_CLASSES = [C.AlgoConfig, C.RewardConfig, C.DataConfig, C.SGLangConfig, C.RolloutConfig,
                   C.ModelConfig, C.ParallelConfig, C.OptimConfig, C.TrainerConfig, C.LoggingConfig,
                   C.HapoConfig]


def test_defaults_build_and_every_field_has_a_docstring():
    cfg = HapoConfig()
    assert cfg.algo.adv_estimator == "hapo" and cfg.algo.loss.entropy_pivot == 0.8
    for cls in SECTION_CLASSES:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without docstring: {missing}"


def test_contract_field_names_present():
    expected = {
        "algo": "adv_estimator norm_adv_by_std tlga_fallback_threshold adaptive_temperature temperature_tau "
                "entropy_pivot h_hat_mode entropy_stats_scope h_hat_entropy adaptive_clip clip_alpha "
                "adaptive_advantage adv_beta clip_ratio_low clip_ratio_high clip_ratio_c loss_agg_mode "
                "kl_loss_coef kl_loss_type entropy_coeff old_logprob_source tis_cap filter_groups "
                "filter_groups_metric max_num_gen_batches",
        "reward": "reward_fn score_format overlong_buffer_enable overlong_buffer_len overlong_penalty_factor",
        "data": "train_files val_files prompt_key max_prompt_length train_batch_size shuffle seed "
                "tokenizer_path apply_chat_template",
        "rollout": "engine n temperature top_p top_k max_response_length val_n val_temperature val_top_p "
                   "generate_batch_size sglang",
        "model": "hf_model_path megatron_load_path dtype use_te recompute_activations",
        "parallel": "tensor_model_parallel_size pipeline_model_parallel_size context_parallel_size "
                    "sequence_parallel use_distributed_optimizer micro_batch_size max_tokens_per_micro_batch",
        "optim": "lr min_lr lr_warmup_steps lr_decay_style weight_decay adam_beta1 adam_beta2 adam_eps clip_grad",
        "trainer": "total_steps ppo_mini_batch_size ppo_epochs seed run_dir project_name experiment_name "
                   "save_interval keep_last_k resume eval_interval max_consecutive_skips sft_warmup_steps",
        "logging": "console jsonl wandb wandb_mode wandb_project tensorboard log_interval",
    }
    d = HapoConfig().to_dict()
    for section, names in expected.items():
        assert set(names.split()) <= set(d[section]), section
    sglang = "server_urls num_servers server_tp_size mem_fraction_static weight_sync bucket_size_mb " \
             "request_timeout_s max_retries colocate extra_server_args port_base"
    assert set(sglang.split()) <= set(d["rollout"]["sglang"])


@pytest.mark.parametrize("override, message", [
    ("algo.entropy_pivot=1.5", "algo.entropy_pivot must be in (0, 1), got 1.5"),
    ("algo.entropy_pivot=0", "algo.entropy_pivot must be in (0, 1), got 0.0"),
    ("algo.adv_estimator=ppo", "algo.adv_estimator must be one of"),
    ("algo.h_hat_mode=abs", "algo.h_hat_mode must be one of 'signed', 'reference'"),
    ("algo.clip_ratio_low=-0.1", "algo.clip_ratio_low must be >= 0.0, got -0.1"),
    ("algo.clip_ratio_c=1.0", "algo.clip_ratio_c must be > 1.0, got 1.0"),
    ("algo.loss_agg_mode=sum", "algo.loss_agg_mode must be one of"),
    ("algo.temperature_tau=1.0", "algo.temperature_tau must be in [0, 1), got 1.0"),
    ("algo.tis_cap=0", "algo.tis_cap must be > 0.0"),
    ("algo.max_num_gen_batches=0", "algo.max_num_gen_batches must be >= 1"),
    ("reward.score_format=binary", "reward.score_format must be one of 'pm1', '01'"),
    ("data.max_prompt_length=0", "data.max_prompt_length must be >= 1, got 0"),
    ("rollout.top_p=1.5", "rollout.top_p must be in (0, 1], got 1.5"),
    ("rollout.top_k=0", "rollout.top_k must be -1 (off) or >= 1, got 0"),
    ("rollout.engine=vllm", "rollout.engine must be one of 'hf', 'sglang'"),
    ("rollout.sglang.weight_sync=nccl", "rollout.sglang.weight_sync must be one of"),
    ("rollout.sglang.mem_fraction_static=0", "rollout.sglang.mem_fraction_static must be in (0, 1]"),
    ("model.dtype=fp8", "model.dtype must be one of 'bf16', 'fp16', 'fp32'"),
    ("parallel.tensor_model_parallel_size=0", "parallel.tensor_model_parallel_size must be >= 1"),
    ("optim.min_lr=1.0", "optim.min_lr must be in [0, optim.lr=1e-06], got 1.0"),
    ("optim.adam_beta2=1", "optim.adam_beta2 must be in [0, 1), got 1.0"),
    ("trainer.total_steps=0", "trainer.total_steps must be >= 1, got 0"),
    ("logging.wandb_mode=cloud", "logging.wandb_mode must be one of"),
    ("optim.lr=abc", "optim.lr must be a number, got 'abc'"),
    ("optim.lr=.nan", "optim.lr must be finite"),
    ("trainer.total_steps=1.5", "trainer.total_steps must be an integer, got 1.5"),
    ("algo.adaptive_clip=maybe", "algo.adaptive_clip must be true or false, got 'maybe'"),
    ("rollout.n=true", "rollout.n must be an integer, got True"),
    ("data.train_files={a: 1}", "data.train_files must be a list"),
    ("parallel.max_tokens_per_micro_batch=[1]",
     "parallel.max_tokens_per_micro_batch must be an integer or null, got [1]"),
])
def test_validation_messages_name_the_field(override, message):
    with pytest.raises(ValueError) as info:
        load_config(overrides=[override])
    assert message in str(info.value)


def test_direct_construction_is_checked_and_coerced():
    with pytest.raises(ValueError, match=r"algo\.entropy_pivot must be in \(0, 1\), got 1\.5"):
        AlgoConfig.from_dict(dict(entropy_pivot=1.5))
    algo = AlgoConfig.from_dict(dict(clip_ratio_high="0.28", max_num_gen_batches=4.0))
    assert algo.loss.clip_ratio_high == 0.28 and isinstance(algo.max_num_gen_batches, int)
    cfg = HapoConfig(algo={"clip_ratio_high": 0.3}, rollout={"sglang": {"num_servers": 2}})
    assert isinstance(cfg.algo, AlgoConfig) and cfg.algo.loss.clip_ratio_high == 0.3
    assert cfg.rollout.sglang.num_servers == 2


def test_override_value_parsing():
    cfg = load_config(overrides=[
        "optim.lr=1e-5",  # YAML 1.1 reads this as a string; coerced to float
        "algo.clip_ratio_c=10",  # int -> float
        "data.train_files=a.parquet",  # str -> [str]
        "data.val_files=[b.parquet, c.jsonl]",
        "model.use_te=null", "model.hf_model_path=Qwen/Qwen2.5-Math-7B",
        "trainer.experiment_name=2024",  # int -> str
        "algo.tis_cap=2", "rollout.sglang.server_urls=[http://a:1]", "rollout.engine=sglang",
        "reward.reward_kwargs={x: 1}",
    ])
    assert cfg.optim.lr == 1e-5 and isinstance(cfg.algo.loss.clip_ratio_c, float)
    assert cfg.data.train_files == ["a.parquet"] and cfg.data.val_files == ["b.parquet", "c.jsonl"]
    assert cfg.model.use_te is None and cfg.trainer.experiment_name == "2024"
    assert cfg.algo.loss.tis_cap == 2.0 and cfg.rollout.sglang.server_urls == ["http://a:1"]
    assert cfg.reward.reward_kwargs == {"x": 1}
    assert cfg.data.tokenizer_path == "Qwen/Qwen2.5-Math-7B"  # defaults to model.hf_model_path
    assert cfg.trainer.run_dir == os.path.join("runs", "2024")
    assert cfg.logging.wandb_project == "hapo" and cfg.logging.wandb_run_name == "2024"


@pytest.mark.parametrize("override", ["algo.clip_ratio_hi=0.3", "algo=3", "foo.bar=1", "rollout.sglang.nope=1",
                                      "rollout.sglang.use_router=false",
                                      "algo.clip_ratio_low.x=1", "noequals"])
def test_bad_override_keys(override):
    with pytest.raises(ValueError) as info:
        load_config(overrides=[override])
    msg = str(info.value)
    if override == "algo.clip_ratio_hi=0.3":
        assert "unknown config key 'algo.clip_ratio_hi'" in msg and "did you mean 'clip_ratio_high'" in msg
        assert "valid keys of section 'algo': adv_estimator," in msg
    elif override == "foo.bar=1":
        assert "unknown config key 'foo'" in msg and "valid keys of the top level: algo, reward" in msg
    elif override in ("rollout.sglang.nope=1", "rollout.sglang.use_router=false"):  # no router field
        assert "valid keys of section 'rollout.sglang': server_urls" in msg
    elif override == "algo.clip_ratio_low.x=1":
        assert "'algo.clip_ratio_low' is a value, not a section" in msg
    elif override == "noequals":
        assert "must look like section.field=value" in msg
    else:
        assert "algo must be a mapping" in msg


def test_yaml_unknown_key_names_file(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("algo:\n  clip_ratio_high: 0.28\n  bogus: 1\n")
    with pytest.raises(ValueError, match=r"unknown config key 'algo.bogus'.*x\.yaml.*valid keys of section 'algo'"):
        load_config(str(path))
    with pytest.raises(ValueError, match="unknown config key 'trainer.nope'"):
        HapoConfig.from_dict({"trainer": {"nope": 1}})
    path.write_text("algo:\nrollout:\n  sglang:\n")  # empty blocks are fine
    assert load_config(str(path), "algo.clip_ratio_high=0.3").algo.loss.clip_ratio_high == 0.3
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="must contain a mapping"):
        load_config(str(path))
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(str(tmp_path / "missing.yaml"))


def test_yaml_overrides_round_trip(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "algo": {"clip_ratio_high": 0.28, "adaptive_clip": False},
        "data": {"train_files": ["t.parquet"], "train_batch_size": 64},
        "rollout": {"n": 4, "sglang": {"num_servers": 2}},
        "trainer": {"ppo_mini_batch_size": 16, "experiment_name": "exp"},
    }))
    cfg = load_config(str(path), ["algo.clip_ratio_high=0.3", "rollout.n=8"])
    assert cfg.algo.loss.clip_ratio_high == 0.3 and cfg.algo.loss.adaptive_clip is False  # override beats YAML
    assert cfg.rollout.n == 8 and cfg.rollout.sglang.num_servers == 2
    assert cfg.trainer.run_dir == os.path.join("runs", "exp")
    out = save_config(cfg, str(tmp_path / "sub" / "resolved.yaml"))
    again = load_config(out)
    assert again.to_dict() == cfg.to_dict() == HapoConfig.from_dict(cfg.to_dict()).to_dict()
    assert yaml.safe_load(format_config(cfg)) == cfg.to_dict()


def test_order_preset_then_yaml_then_overrides(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("preset: dapo\nalgo:\n  clip_ratio_high: 0.25\n")
    cfg = load_config(str(path))
    assert cfg.algo.adv_estimator == "grpo" and cfg.algo.filter_groups  # from the YAML's preset
    assert cfg.algo.loss.clip_ratio_high == 0.25  # YAML beats preset
    cfg = load_config(str(path), ["algo.clip_ratio_high=0.3"])
    assert cfg.algo.loss.clip_ratio_high == 0.3
    cfg = load_config(str(path), preset="hapo")  # the argument replaces the YAML's preset
    assert cfg.algo.adv_estimator == "hapo" and cfg.algo.loss.clip_ratio_high == 0.25
    with pytest.raises(ValueError, match="unknown preset 'dapo2'; available presets: hapo, dapo, grpo"):
        load_config(preset="dapo2")


SWITCHES = ("adv_estimator", "adaptive_temperature", "adaptive_advantage", "adaptive_clip", "policy_loss",
            "forking_tokens")
#: the field's objectives (docs/algorithm.md): what each changes from its base preset
OBJECTIVE_PRESETS = {
    "gspo": ("grpo", {"policy_loss": "gspo", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4,
                      "loss_agg_mode": "seq-mean-token-mean"}),
    "gmpo": ("grpo", {"policy_loss": "gmpo", "clip_ratio_low": 0.4, "clip_ratio_high": 0.4,
                      "loss_agg_mode": "seq-mean-token-mean"}),
    "cispo": ("grpo", {"policy_loss": "cispo", "clip_ratio_low": 10.0}),
    "sapo": ("grpo", {"policy_loss": "sapo", "loss_agg_mode": "seq-mean-token-mean"}),
    "dr-grpo": ("grpo", {"norm_adv_by_std": False, "loss_agg_mode": "seq-mean-token-sum-norm"}),
    "forking-tokens": ("dapo", {"forking_tokens": True}),
    "clip-cov": ("grpo", {"policy_loss": "clip_cov"}),
    "kl-cov": ("grpo", {"policy_loss": "kl_cov"}),
    "archer": ("grpo", {"archer": True, "clip_ratio_c": 10.0, "kl_loss_coef": 0.001}),
    "edge-grpo": ("grpo", {"edge_eda": True, "edge_gec": True}),
}


def test_presets_produce_intended_switches():
    hapo = load_config(preset="hapo")
    assert [hapo.to_dict()["algo"][s] for s in SWITCHES] == ["hapo", True, True, True, "ppo", False]
    h = hapo.algo.loss
    assert (h.clip_ratio_low, h.clip_ratio_high, h.clip_ratio_c) == (0.2, 0.2, 10.0)
    assert hapo.algo.filter_groups and hapo.algo.filter_groups_metric == "acc"
    assert hapo.reward.overlong_buffer_enable and hapo.algo.loss.kl_loss_coef == 0.0

    dapo = load_config(preset="dapo")
    assert [dapo.to_dict()["algo"][s] for s in SWITCHES] == ["grpo", False, False, False, "ppo", False]
    assert (dapo.algo.loss.clip_ratio_low, dapo.algo.loss.clip_ratio_high) == (0.2, 0.28)
    assert dapo.algo.filter_groups and dapo.reward.overlong_buffer_enable
    assert dapo.algo.loss.loss_agg_mode == "token-mean" and dapo.algo.loss.kl_loss_coef == 0.0

    grpo = load_config(preset="grpo")
    assert [grpo.to_dict()["algo"][s] for s in SWITCHES] == ["grpo", False, False, False, "ppo", False]
    assert (grpo.algo.loss.clip_ratio_low, grpo.algo.loss.clip_ratio_high) == (0.2, 0.2)
    assert not grpo.algo.filter_groups and not grpo.reward.overlong_buffer_enable

    ablations = {"dapo+temp": "adaptive_temperature", "dapo+tlga": "adv_estimator",
                 "dapo+redistribution": "adaptive_advantage", "dapo+clip": "adaptive_clip"}
    for name, switch in ablations.items():
        cfg = load_config(preset=name).to_dict()
        base = dapo.to_dict()
        diff = {(s, k) for s in cfg for k in cfg[s] if cfg[s][k] != base[s][k]}
        assert diff == {("algo", switch)}, name
    assert set(PRESETS) == {"hapo", "dapo", "grpo", *ablations, *OBJECTIVE_PRESETS}


def test_objective_presets_change_only_their_objective():
    for name, (base, want) in OBJECTIVE_PRESETS.items():
        cfg = load_config(preset=name).to_dict()
        ref = load_config(preset=base).to_dict()
        diff = {k: cfg[s][k] for s in cfg for k in cfg[s] if cfg[s][k] != ref[s][k]}
        assert diff == want, name
    sapo = load_config(preset="sapo").algo.loss
    assert (sapo.sapo_tau_pos, sapo.sapo_tau_neg) == (1.0, 1.05)
    assert load_config(preset="forking-tokens").algo.loss.forking_rho == 0.2


def test_presets_do_not_depend_on_defaults():
    # every preset sets all four switches itself
    for name, overrides in PRESETS.items():
        assert {f"algo.{s}" for s in SWITCHES} <= set(overrides), name


def test_cross_section_checks():
    cases = [
        (["data.train_batch_size=100", "trainer.ppo_mini_batch_size=32"],
         "data.train_batch_size (100) must be divisible by trainer.ppo_mini_batch_size (32)"),
        (["reward.overlong_buffer_enable=true", "reward.overlong_buffer_len=100", "rollout.max_response_length=100"],
         "reward.overlong_buffer_len (100) must be < rollout.max_response_length (100)"),
        (["algo.filter_groups=true", "rollout.n=1"], "algo.filter_groups needs rollout.n >= 2"),
        (["rollout.n=1"], "rollout.n=1 with algo.adv_estimator='hapo': the advantage is relative"),
        (["rollout.n=1", "algo.adv_estimator=grpo"], "a group of 1 gets advantage 0 and nothing is learned"),
        (["rollout.top_k=1"], "rollout.top_k=1 samples greedily"),
        (["rollout.sglang.server_urls=[http://h:1]"], "rollout.sglang.server_urls is set but rollout.engine is 'hf'"),
        (["rollout.sglang.server_urls=[h:1]", "rollout.engine=sglang"],
         "rollout.sglang.server_urls[0] must start with http"),
        (["rollout.sglang.weight_sync=tensor", "rollout.sglang.colocate=false"],
         "rollout.sglang.weight_sync='tensor' (CUDA IPC) needs rollout.sglang.colocate=true"),
        (["parallel.max_tokens_per_micro_batch=1000", "data.max_prompt_length=100", "rollout.max_response_length=1000"],
         "parallel.max_tokens_per_micro_batch (1000) must be >= data.max_prompt_length + "
         "rollout.max_response_length (1100)"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError) as info:
            load_config(overrides=overrides)
        assert message in str(info.value), (overrides, str(info.value))
    # overlong buffer length is free when shaping is off
    assert load_config(overrides=["reward.overlong_buffer_len=99999"]).reward.overlong_buffer_len == 99999
    with pytest.warns(UserWarning, match="old_logprob_source='rollout'"):
        load_config(overrides=["algo.old_logprob_source=rollout"])


def test_validate_world():
    p = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2)
    assert p.validate_world(16) == 2 and p.validate_world(8) == 1
    with pytest.raises(ValueError, match=r"world_size 12 is not divisible by .* = 2 \* 2 \* 2 = 8"):
        p.validate_world(12)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        p.validate_world(0)


def test_choices_come_from_algo():
    """One definition: the config's choice tuples are algo's objects, not copies."""
    from hapo_megatron.algo import choices
    from hapo_megatron.algo import loss_config

    for name in ("ADV_ESTIMATORS", "H_HAT_MODES", "ENTROPY_STATS_SCOPES", "H_HAT_ENTROPIES", "LOSS_AGG_MODES",
                 "KL_LOSS_TYPES", "OLD_LOGPROB_SOURCES", "FILTER_GROUPS_METRICS"):
        assert getattr(C, name) is getattr(choices, name), name
    assert loss_config.ENTROPY_STATS_SCOPES is choices.ENTROPY_STATS_SCOPES
    assert loss_config.H_HAT_ENTROPIES is choices.H_HAT_ENTROPIES


def test_fp8_and_asynchronous_rollouts_turn_the_off_policy_correction_on_by_default():
    """algo.rollout_is=auto (the default) resolves once, at load: token_tis with FP8 or asynchronous
    rollouts, none otherwise; an explicit value wins, and so do the settings that already decide the weighting
    (fails when the auto rule is dropped: FP8 then trains with no correction; or when it ignores
    tis_cap: the config is then refused for carrying two weights)."""
    from hapo_megatron.config import HapoConfig

    def resolved(**algo):
        return HapoConfig.from_dict({"rollout": {"engine": "sglang", "quantization": "fp8", "dtype": "bf16"},
                                     "algo": algo}).algo.loss.rollout_is

    assert HapoConfig().algo.loss.rollout_is == "none"
    assert resolved() == "token_tis"
    assert resolved(rollout_is="none") == "none" and resolved(rollout_is="seq_tis") == "seq_tis"
    assert resolved(tis_cap=2.0) == "none"
    assert resolved(old_logprob_source="rollout") == "none"
    lagged = {"engine": "sglang", "max_staleness": 1, "sglang": {"colocate": False}}
    assert HapoConfig.from_dict({"rollout": lagged}).algo.loss.rollout_is == "token_tis"  # asynchronous too
    assert HapoConfig.from_dict({"rollout": lagged, "algo": {"rollout_is": "none"}}).algo.loss.rollout_is == "none"
    saved = HapoConfig.from_dict({"rollout": {"engine": "sglang", "quantization": "fp8", "dtype": "bf16"}})
    assert HapoConfig.from_dict(saved.to_dict()).algo.loss.rollout_is == "token_tis"  # a saved config keeps it
