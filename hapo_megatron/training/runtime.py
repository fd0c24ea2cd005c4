"""Everything a training run holds on this rank (`Runtime`) and the checkpointed part of it.

Rank 0 owns the rollout engine and the metric sinks; every rank holds the actor shard, the
datasets and the per-step metadata (broadcast from rank 0). The checkpointed RL state is one
`RLState` (`training.checkpointing.rl_state`). Building it from a config is `training.build`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from hapo_megatron.config import HapoConfig
from hapo_megatron.data import PromptDataset
from hapo_megatron.parallel.groups import ParallelGroups
from hapo_megatron.rewards import RewardResult
from hapo_megatron.rewards.scoring import RewardScorer
from hapo_megatron.rollout.engine import RolloutEngine
from hapo_megatron.training.actor import MegatronActor
from hapo_megatron.training.checkpointing.checkpoint import CheckpointManager, capture_rng_state
from hapo_megatron.training.memory.engine_memory import EngineMemory
from hapo_megatron.training.metrics.sinks import MetricsLogger, Timer
from hapo_megatron.training.checkpointing.rl_state import RLState

if TYPE_CHECKING:  # transformers is imported only where a tokenizer or config is loaded
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


@dataclass
class Runtime:
    """The live state of one run on this rank (built by `build_runtime`)."""

    cfg: HapoConfig
    groups: ParallelGroups
    rank: int
    world_size: int
    tokenizer: PreTrainedTokenizerBase
    hf_config: PretrainedConfig
    train_ds: PromptDataset
    val_ds: Optional[PromptDataset]
    actor: MegatronActor
    engine: Optional[RolloutEngine]  # rank 0; with launched SGLang servers also every node's first rank (node_servers)
    reward_fn: Callable[..., RewardResult]
    logger: MetricsLogger
    ckpt: CheckpointManager
    rl: RLState  # step, sampler, dynamic sampling, entropy statistics, skips (checkpointed)
    timer: Timer = field(default_factory=Timer)
    start_step: int = 0
    reference: Optional[list[torch.nn.Module]] = None  # frozen KL reference chunks (algo.kl_loss_coef > 0)
    memory: EngineMemory = field(default_factory=EngineMemory)  # engine regions + actor offloader (named moves)
    scorer: Optional[RewardScorer] = None  # rank 0: the reward with its worker pool (rewards.scoring)
    control: Any = None  # rollout_protocol.Rank0Channel: rank 0's messages while it alone works (CPU group)
    previous_summary: Optional[dict] = None  # rank 0, resumed: the summary it set aside (run_records.py)
    async_rollout: Any = None  # rank 0 with rollout.max_staleness >= 1: training.asynchronous.producer.AsyncRollout
    sync_manager: Any = None  # rank 0 with rollout.sync_producer: process: training.asynchronous.manager.RolloutManager

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def run_dir(self) -> str:
        return self.cfg.trainer.run_dir

    def data_metrics(self) -> dict[str, float]:
        """Prompts dropped by data.filter_overlong_prompts (only when it is on)."""
        if not self.cfg.data.filter_overlong_prompts:
            return {}
        val = self.val_ds.num_overlong_filtered if self.val_ds is not None else 0
        return {"data/train_overlong_filtered": float(self.train_ds.num_overlong_filtered),
                "data/val_overlong_filtered": float(val)}

    @property
    def contributes_metrics(self) -> bool:
        """This rank's loss metrics count (TP rank 0 of the last pipeline stage, CP/DP all)."""
        return self.groups.tp_rank == 0 and self.groups.is_pipeline_last

    def sampling_seed(self, step: int, gen_index: int) -> int:
        """Seed of one generation batch: a pure function of (trainer.seed, step, batch index),
        so a resumed run samples exactly what the uninterrupted run sampled."""
        return sampling_seed(self.cfg, step, gen_index)

    # ------------------------------------------------------------------ checkpoint state
    def checkpoint_state(self) -> dict[str, Any]:
        """``rl_state.json``: the RL loop's `RLState` and the actor's skip count / LR schedule."""
        return {**self.rl.state_dict(), **self.actor.train_state_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        self.rl.load_state_dict(state)
        self.start_step = self.rl.step
        self.actor.load_train_state_dict(state)

    def snapshot(self) -> "StepSnapshot":
        """The checkpointed state as it is now (a copy): what a stop before the next update saves,
        since until then the model and optimizer are unchanged (training/checkpointing/preemption.py)."""
        return StepSnapshot(json.loads(json.dumps(self.checkpoint_state())), capture_rng_state())

    def save_checkpoint(self, snapshot: Optional["StepSnapshot"] = None) -> str:
        """Save the current state, or ``snapshot``'s RL and RNG state with the current model."""
        state = dict(snapshot.rl_state) if snapshot else self.checkpoint_state()
        return self.ckpt.save(state.pop("step"), rl_state=state, save_model=self.actor.save,
                              rng_state=snapshot.rng_state if snapshot else None)


def sampling_seed(cfg: HapoConfig, step: int, gen_index: int) -> int:
    """`Runtime.sampling_seed` (also the rollout manager's, training/asynchronous/manager.py)."""
    return (int(cfg.trainer.seed) * 1_000_003 + step * 1_009 + gen_index) % (2**31 - 1)


@dataclass(frozen=True)
class StepSnapshot:
    """`Runtime.checkpoint_state` (JSON copy) and this rank's RNG states at one point in time."""

    rl_state: dict[str, Any]
    rng_state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.rl_state["step"])
