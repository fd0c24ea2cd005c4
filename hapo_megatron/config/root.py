"""``HapoConfig``: the whole run configuration, one field per section, plus cross-section checks."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from hapo_megatron.algo.choices import GROUP_RELATIVE_ADV_ESTIMATORS
from hapo_megatron.config.base import _fail, _Section
from hapo_megatron.config.sections import (
    AlgoConfig, DataConfig, ModelConfig, RewardConfig, RolloutConfig,
)
from hapo_megatron.config.training_sections import LoggingConfig, OptimConfig, ParallelConfig, TrainerConfig

__all__ = ["HapoConfig"]


@dataclass
class HapoConfig(_Section):
    """The whole run configuration: one field per section."""

    _path: ClassVar[str] = ""

    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm (HAPO / DAPO / GRPO switches and the loss)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function and overlong shaping."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Megatron parallelism."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Training loop."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metric sinks."""

    def _validate(self) -> None:
        """Checks that span sections, then fill the defaults that point at other fields."""
        self._check_batching()
        self._check_rollout()
        fp8_rollouts = self.rollout.quantization == "fp8"
        partial = self.rollout.over_sampling > 1.0 and self.rollout.partial_mode == "correct"
        self.algo.loss = self.algo.loss.with_default_rollout_is(fp8_rollouts=fp8_rollouts, partial_rollouts=partial,
                                                                async_rollouts=self.rollout.max_staleness > 0)
        self._check_partial_mode()
        self._check_gec()
        if self.data.tokenizer_path is None:
            self.data.tokenizer_path = self.model.hf_model_path
        if self.logging.wandb_project is None:
            self.logging.wandb_project = self.trainer.project_name
        if self.logging.wandb_run_name is None:
            self.logging.wandb_run_name = self.trainer.experiment_name
        if self.logging.tensorboard_dir is None:
            self.logging.tensorboard_dir = os.path.join(self.trainer.run_dir, "tensorboard")

    def _check_partial_mode(self) -> None:
        """Over-sampling trains resumed responses whose prefix older weights generated: ``correct``
        weights them with the off-policy correction, so it must be on (docs/algorithm.md,
        "Over-sampling and partial rollouts")."""
        ro = self.rollout
        if ro.over_sampling > 1.0 and self.model.routing_replay:
            _fail("rollout.over_sampling > 1 resumes responses across weight versions, whose routes "
                  "model.routing_replay cannot replay: set rollout.over_sampling=1.0 or model.routing_replay=false")
        if ro.over_sampling > 1.0 and ro.partial_mode == "correct" and self.algo.loss.rollout_is == "none":
            _fail("rollout.partial_mode=correct trains resumed responses with the off-policy correction, but "
                  "algo.rollout_is is none: set algo.rollout_is (auto picks token_tis) or "
                  "rollout.partial_mode=mask_prefix")

    def _check_gec(self) -> None:
        """EDGE-GRPO's guided error correction rewrites wrong responses in the synchronous rollout
        (training/guided_correction.py): the tokens it inserts were sampled by no engine, so they
        have no rollout log-probs, routes or weight versions (docs/algorithm.md, "EDGE-GRPO")."""
        if not self.algo.edge_gec:
            return
        ro, loss = self.rollout, self.algo.loss
        why = "the tokens algo.edge_gec inserts have no"
        if ro.max_staleness > 0:
            _fail(f"algo.edge_gec corrects responses in the synchronous rollout; rollout.max_staleness="
                  f"{ro.max_staleness} runs the asynchronous one: set one of them off")
        if ro.over_sampling > 1.0:
            _fail(f"algo.edge_gec corrects responses in the synchronous rollout; rollout.over_sampling="
                  f"{ro.over_sampling} resumes partial ones: set one of them off")
        for name in ("routing_replay", "measure_routing_mismatch"):
            if getattr(self.model, name):
                _fail(f"model.{name} reads the engine's MoE routes, but {why} routes: set model.{name}=false "
                      "or algo.edge_gec=false")
        if loss.old_logprob_source == "rollout":
            _fail(f"algo.old_logprob_source=rollout takes the engine's log-probs, but {why} engine log-probs: "
                  "set algo.old_logprob_source=recompute or algo.edge_gec=false")
        if loss.tis_cap is not None or loss.rollout_is_mode != "none":
            _fail(f"algo.rollout_is / algo.tis_cap weight tokens by the engine's log-probs, but {why} engine "
                  "log-probs: set algo.rollout_is=none and algo.tis_cap=null, or algo.edge_gec=false")

    def _check_batching(self) -> None:
        bsz, mini = self.data.train_batch_size, self.trainer.ppo_mini_batch_size
        if bsz % mini:
            _fail(f"data.train_batch_size ({bsz}) must be divisible by trainer.ppo_mini_batch_size ({mini})")
        seq_len = self.data.max_prompt_length + self.rollout.max_response_length
        budget = self.parallel.max_tokens_per_micro_batch
        if budget is not None and budget < seq_len:
            _fail(f"parallel.max_tokens_per_micro_batch ({budget}) must be >= data.max_prompt_length "
                  f"+ rollout.max_response_length ({seq_len}) so that every sequence fits")

    def _check_rollout(self) -> None:
        rw, ro, algo = self.reward, self.rollout, self.algo
        if rw.overlong_buffer_enable and rw.overlong_buffer_len >= ro.max_response_length:
            _fail(f"reward.overlong_buffer_len ({rw.overlong_buffer_len}) must be < "
                  f"rollout.max_response_length ({ro.max_response_length}) when "
                  "reward.overlong_buffer_enable is true")
        if algo.filter_groups and ro.n < 2:
            _fail(f"algo.filter_groups needs rollout.n >= 2 (a group of {ro.n} is always constant)")
        # configurations that train nothing: every advantage would be 0 at every step
        if algo.adv_estimator in GROUP_RELATIVE_ADV_ESTIMATORS and ro.n < 2:
            _fail(f"rollout.n={ro.n} with algo.adv_estimator={algo.adv_estimator!r}: the advantage is relative to "
                  "the other responses of the same prompt, so a group of 1 gets advantage 0 and nothing is "
                  "learned; use rollout.n >= 2")
        if ro.top_k == 1:
            _fail("rollout.top_k=1 samples greedily: the rollout.n responses of a prompt are identical, so every "
                  "group-relative advantage is 0 (and algo.filter_groups would never keep a group); use "
                  "rollout.top_k=-1 or >= 2")
        if ro.engine != "sglang" and ro.sglang.server_urls:
            _fail(f"rollout.sglang.server_urls is set but rollout.engine is {ro.engine!r}; "
                  "set rollout.engine=sglang")
        if algo.loss.old_logprob_source == "rollout" and algo.adaptive_temperature:
            warnings.warn("algo.old_logprob_source='rollout' with algo.adaptive_temperature: the "
                          "rollout log-probs are under the adaptive temperatures, not T_base",
                          stacklevel=3)
