"""Config sections of the training side: parallelism, optimizer, training loop, logging."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from hapo_megatron.config.base import LR_DECAY_STYLES, WANDB_MODES, _check_choice, _check_min, _fail, _Section

__all__ = ["ParallelConfig", "OptimConfig", "TrainerConfig", "LoggingConfig", "parse_signal_names"]


def parse_signal_names(names) -> list[signal.Signals]:
    """``["SIGTERM", "USR1", ...]`` as signals (ValueError naming one that is unknown or cannot be
    handled)."""
    out = []
    for name in names:
        key = str(name).strip().upper()
        key = key if key.startswith("SIG") else "SIG" + key
        sig = getattr(signal.Signals, key, None)
        if sig is None or key in ("SIGKILL", "SIGSTOP"):
            _fail(f"trainer.exit_signals: {name!r} is not a signal that can be handled")
        out.append(sig)
    return out


@dataclass
class ParallelConfig(_Section):
    """Megatron parallelism of the actor; data parallelism is what the world size leaves over."""

    _path: ClassVar[str] = "parallel"

    tensor_model_parallel_size: int = 1
    """Tensor parallel size (TP); must divide the attention heads (checked with the model)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline parallel size (PP)."""
    context_parallel_size: int = 1
    """Context parallel size (CP)."""
    expert_model_parallel_size: int = 1
    """Expert parallel size (EP) of MoE models: each rank holds num_experts / EP whole experts.
    The expert grid ETP x EP sits beside TP inside each pipeline stage (world size divisible by
    expert_tensor_parallel_size * EP * PP); must divide num_experts (checked with the model)."""
    expert_tensor_parallel_size: Optional[int] = None
    """Tensor parallel size of each expert's FFN in MoE models (ETP; null = TP, as in Megatron)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (ignored when TP == 1)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks."""
    micro_batch_size: int = 1
    """Sequences per micro-batch (when max_tokens_per_micro_batch is null)."""
    max_tokens_per_micro_batch: Optional[int] = None
    """Group sequences into micro-batches of at most this many tokens (prompt + response): padded
    tokens (rows x longest) without packing, real tokens with pack_sequences."""
    pack_sequences: bool = False
    """Padding-free RL micro-batches: concatenate sequences into one row (THD layout, sequence
    boundaries for the attention) up to max_tokens_per_micro_batch real tokens, balanced over
    data-parallel ranks and micro-batches. Needs max_tokens_per_micro_batch. The SFT warm start
    stays padded."""

    def _validate(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "micro_batch_size", "expert_model_parallel_size"):
            _check_min(f"parallel.{name}", getattr(self, name), 1)
        _check_min("parallel.expert_tensor_parallel_size", self.expert_tensor_parallel_size, 1)
        _check_min("parallel.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, 1)
        if self.pack_sequences and self.max_tokens_per_micro_batch is None:
            _fail("parallel.pack_sequences needs parallel.max_tokens_per_micro_batch (the real-token "
                  "budget of a packed row)")

    @property
    def model_parallel_size(self) -> int:
        """tp * pp * cp: ranks holding one replica of the model."""
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)

    def validate_world(self, world_size: int) -> int:
        """Check that ``world_size`` is divisible by tp * pp * cp; returns the DP size."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            _fail(f"world_size must be a positive integer, got {world_size!r}")
        mp = self.model_parallel_size
        if world_size % mp:
            _fail(f"world_size {world_size} is not divisible by parallel.tensor_model_parallel_size "
                  f"* pipeline_model_parallel_size * context_parallel_size = "
                  f"{self.tensor_model_parallel_size} * {self.pipeline_model_parallel_size} * "
                  f"{self.context_parallel_size} = {mp}")
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        expert_grid = etp * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % expert_grid:
            _fail(f"world_size {world_size} is not divisible by the expert grid "
                  f"parallel.expert_tensor_parallel_size * expert_model_parallel_size * "
                  f"pipeline_model_parallel_size = {etp} * {self.expert_model_parallel_size} * "
                  f"{self.pipeline_model_parallel_size} = {expert_grid}")
        return world_size // mp


@dataclass
class OptimConfig(_Section):
    """Adam optimizer and learning-rate schedule."""

    _path: ClassVar[str] = "optim"

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the linear/cosine decay."""
    lr_warmup_steps: int = 10
    """Linear warm-up steps (optimizer steps)."""
    lr_decay_style: str = "constant"
    """Schedule after warm-up: constant, linear or cosine."""
    lr_decay_steps: Optional[int] = None
    """Optimizer steps of warm-up + decay (null = all optimizer steps of the run)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1 in [0, 1)."""
    adam_beta2: float = 0.999
    """Adam beta2 in [0, 1)."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Gradient-norm clipping (0 = off)."""

    def _validate(self) -> None:
        _check_min("optim.lr", self.lr, 0.0, strict=True)
        if not 0 <= self.min_lr <= self.lr:
            _fail(f"optim.min_lr must be in [0, optim.lr={self.lr}], got {self.min_lr}")
        _check_min("optim.lr_warmup_steps", self.lr_warmup_steps, 0)
        _check_choice("optim.lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        _check_min("optim.lr_decay_steps", self.lr_decay_steps, 1)
        _check_min("optim.weight_decay", self.weight_decay, 0.0)
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                _fail(f"optim.{name} must be in [0, 1), got {getattr(self, name)}")
        _check_min("optim.adam_eps", self.adam_eps, 0.0, strict=True)
        _check_min("optim.clip_grad", self.clip_grad, 0.0)


@dataclass
class TrainerConfig(_Section):
    """The training loop: steps, PPO updates, checkpoints, evaluation, naming."""

    _path: ClassVar[str] = "trainer"

    total_steps: int = 500
    """Training steps (one rollout batch each)."""
    ppo_mini_batch_size: int = 32
    """Prompts per PPO mini-batch (optimizer step); must divide data.train_batch_size."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    seed: int = 1
    """Seed of model init, sampling and everything else random in the trainer."""
    project_name: str = "hapo"
    """Project name (wandb project unless logging.wandb_project is set)."""
    experiment_name: str = "hapo_run"
    """Run name (default run_dir and wandb run name)."""
    run_dir: Optional[str] = None
    """Run directory (resolved config, metrics.jsonl, checkpoints); null = runs/<experiment_name>
    (filled in when the config is built)."""
    save_interval: int = 50
    """Save a checkpoint every this many steps (0 = only at the end)."""
    keep_last_k: Optional[int] = 3
    """Checkpoints to keep (null = all)."""
    resume: str = "auto"
    """"auto" (latest checkpoint in run_dir if any), "none", or a checkpoint path."""
    eval_interval: int = 0
    """Evaluate on data.val_files every this many steps (0 = never during training)."""
    val_before_train: bool = False
    """Evaluate once before the first step."""
    val_at_end: bool = True
    """Evaluate after the last step (when data.val_files is set)."""
    max_consecutive_skips: int = 5
    """Abort after this many consecutive skipped steps (no usable group or a non-finite loss)."""
    sft_warmup_steps: int = 0
    """Supervised warm-up steps on reference solutions before RL (the CPU example)."""
    dist_timeout_minutes: float = 30.0
    """Timeout of the trainer's collectives: the default process group and Megatron's
    TP/PP/CP/DP/EP groups (NCCL on GPUs). No such collective spans a generation round or an
    evaluation (the other ranks wait on the control group, trainer.control_timeout_minutes), so
    minutes suffice and a real hang stops the job soon. It must exceed the longest single wait
    that one of them can see (checked at start): a weight-sync request to a server
    (rollout.sglang.request_timeout_s) and, when the trainer launches servers, their start (900 s)."""
    control_timeout_minutes: float = 180.0
    """Timeout of the CPU (gloo) control group over which the other ranks wait while rank 0
    generates or evaluates (a heartbeat from rank 0 every minute, or a tenth of this timeout when
    that is shorter), receive their share of the step's batch, and agree on a stop signal. It
    bounds the longest gap between two messages of rank 0 (sharing out a large batch), not a
    whole generation round (docs/multinode.md, "Timeouts and waiting ranks")."""
    exit_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    """Signals that stop the run cleanly: every rank stops at the next safe point between stages,
    the last finished step is saved, launched SGLang servers are shut down and the ranks exit with
    code 75; a second signal aborts at once (docs/troubleshooting.md, "Preemption")."""
    exit_grace_s: float = 300.0
    """After a stop signal (or trainer.exit_after_minutes), a rank still running this many seconds
    later exits with code 124 (its checkpoint in progress, if any, is never used). torchrun sends
    SIGKILL --shutdown-timeout seconds (default 30) after forwarding a signal: set that higher."""
    exit_after_minutes: Optional[float] = None
    """Save and stop (exit code 75) at the first safe point after this many minutes of training,
    e.g. a few steps before a SLURM allocation ends (null = no limit)."""

    def _validate(self) -> None:
        for name, lo in (("total_steps", 1), ("ppo_mini_batch_size", 1), ("ppo_epochs", 1),
                         ("save_interval", 0), ("keep_last_k", 1), ("eval_interval", 0),
                         ("max_consecutive_skips", 0), ("sft_warmup_steps", 0)):
            _check_min(f"trainer.{name}", getattr(self, name), lo)
        _check_min("trainer.dist_timeout_minutes", self.dist_timeout_minutes, 0.0, strict=True)
        _check_min("trainer.control_timeout_minutes", self.control_timeout_minutes, 0.0, strict=True)
        _check_min("trainer.exit_grace_s", self.exit_grace_s, 0.0, strict=True)
        _check_min("trainer.exit_after_minutes", self.exit_after_minutes, 0.0, strict=True)
        parse_signal_names(self.exit_signals)
        for name in ("project_name", "experiment_name", "resume"):
            if not getattr(self, name).strip():
                _fail(f"trainer.{name} must be a non-empty string")
        if self.run_dir is None:
            self.run_dir = os.path.join("runs", self.experiment_name)


@dataclass
class LoggingConfig(_Section):
    """Metric sinks: console, <run_dir>/metrics.jsonl, wandb, TensorBoard."""

    _path: ClassVar[str] = "logging"

    console: bool = True
    """Print a metrics line every log_interval steps."""
    jsonl: bool = True
    """Append metrics to <run_dir>/metrics.jsonl."""
    wandb: bool = False
    """Log to Weights & Biases."""
    wandb_mode: str = "offline"
    """wandb mode: offline, online or disabled."""
    wandb_project: Optional[str] = None
    """wandb project (null = trainer.project_name)."""
    wandb_entity: Optional[str] = None
    """wandb entity (null = your default)."""
    wandb_run_name: Optional[str] = None
    """wandb run name (null = trainer.experiment_name)."""
    tensorboard: bool = False
    """Write TensorBoard event files."""
    tensorboard_dir: Optional[str] = None
    """TensorBoard directory (null = <run_dir>/tensorboard)."""
    log_interval: int = 1
    """Log every this many steps."""
    save_rollouts_interval: int = 0
    """Every this many steps, write the step's rollouts with per-token diagnostics (entropy,
    h_hat, temperatures, advantages before/after redistribution, the loss's ratio and clip flags
    in the token's last PPO update) to <run_dir>/rollouts/step_<step>.jsonl for `python -m
    hapo_megatron.analysis` (0 = never)."""

    def _validate(self) -> None:
        _check_choice("logging.wandb_mode", self.wandb_mode, WANDB_MODES)
        _check_min("logging.log_interval", self.log_interval, 1)
        _check_min("logging.save_rollouts_interval", self.save_rollouts_interval, 0)
