"""Everything a training run holds (`Runtime`) and how it is built from a `HapoConfig`.

Rank 0 owns the rollout engine and the metric sinks; every rank holds the actor shard, the
datasets and the per-step metadata (broadcast from rank 0). The checkpointed RL state is one
`RLState` (`training.rl_state`).
"""

from __future__ import annotations

import glob
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from hapo_megatron.config import HapoConfig
from hapo_megatron.dtypes import torch_dtype
from hapo_megatron.data import PromptDataset
from hapo_megatron.parallel.collectives import all_gather_objects
from hapo_megatron.models.moe import check_moe_training_layout
from hapo_megatron.parallel.groups import ParallelGroups
from hapo_megatron.rewards import RewardResult
from hapo_megatron.rewards.scoring import RewardScorer
from hapo_megatron.rollout.engine import RolloutEngine
from hapo_megatron.training.actor import MegatronActor
from hapo_megatron.training.checkpoint import (CheckpointManager, Layout, capture_rng_state,
                                               list_checkpoints, load_newest_loadable, read_checkpoint_info,
                                               resume_message)
from hapo_megatron.training.metrics import MetricsLogger, Timer
from hapo_megatron.training.engine_memory import EngineMemory
from hapo_megatron.training.rl_state import RLState
from hapo_megatron.training.rl_step import DynamicSampler

if TYPE_CHECKING:  # transformers is imported only where a tokenizer or config is loaded
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def load_hf_config(path: str, max_position_embeddings: Optional[int] = None):
    """The model's HF config with ``model.max_position_embeddings`` applied (when given): the one
    config object the Megatron model, the HF engine and HF exports are built from."""
    from transformers import AutoConfig

    from hapo_megatron.training.context import apply_context_override
    return apply_context_override(AutoConfig.from_pretrained(path), max_position_embeddings)


def has_hf_weights(path: Optional[str]) -> bool:
    """True when ``path`` is a directory holding safetensors / bin weights."""
    if not path or not os.path.isdir(path):
        return False
    return bool(glob.glob(os.path.join(path, "*.safetensors")) or glob.glob(os.path.join(path, "*.bin")))


def initial_hf_weights(model_cfg) -> Optional[str]:
    """The HF directory the actor's weights start from (None: model.megatron_load_path or, asked
    for explicitly, a random initialisation). ValueError naming the fields when
    model.hf_model_path has no weights and nothing else was chosen: a silent random start would
    train noise and push it into SGLang servers that loaded the real weights."""
    if model_cfg.random_init or model_cfg.megatron_load_path:
        return None
    if has_hf_weights(model_cfg.hf_model_path):
        return model_cfg.hf_model_path
    raise ValueError(f"model.hf_model_path={model_cfg.hf_model_path!r} holds no weights (*.safetensors / *.bin) "
                     "and model.megatron_load_path is not set: point model.hf_model_path at a model with "
                     "weights, set model.megatron_load_path, or set model.random_init=true to train from "
                     "a random initialisation on purpose")


def build_datasets(cfg, tokenizer):
    """(train, val or None) PromptDatasets; malformed rows / long prompts raise ValueError here."""
    from hapo_megatron.data import PromptDataset
    kw = dict(prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
              apply_chat_template=cfg.data.apply_chat_template, filter_overlong=cfg.data.filter_overlong_prompts)
    if not cfg.data.train_files:
        raise ValueError("data.train_files is empty: name at least one .parquet or .jsonl file")
    train = PromptDataset(cfg.data.train_files, tokenizer, **kw)
    val = PromptDataset(cfg.data.val_files, tokenizer, **kw) if cfg.data.val_files else None
    return train, val


def optimizer_steps_per_rl_step(cfg) -> int:
    return max(1, cfg.data.train_batch_size // cfg.trainer.ppo_mini_batch_size) * cfg.trainer.ppo_epochs


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
        return (int(self.cfg.trainer.seed) * 1_000_003 + step * 1_009 + gen_index) % (2**31 - 1)

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
        since until then the model and optimizer are unchanged (training/preemption.py)."""
        return StepSnapshot(json.loads(json.dumps(self.checkpoint_state())), capture_rng_state())

    def save_checkpoint(self, snapshot: Optional["StepSnapshot"] = None) -> str:
        """Save the current state, or ``snapshot``'s RL and RNG state with the current model."""
        state = dict(snapshot.rl_state) if snapshot else self.checkpoint_state()
        return self.ckpt.save(state.pop("step"), rl_state=state, save_model=self.actor.save,
                              rng_state=snapshot.rng_state if snapshot else None)


@dataclass(frozen=True)
class StepSnapshot:
    """`Runtime.checkpoint_state` (JSON copy) and this rank's RNG states at one point in time."""

    rl_state: dict[str, Any]
    rng_state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.rl_state["step"])


def setup_reference(rt: Runtime) -> None:
    """The KL reference (only with algo.kl_loss_coef > 0): the policy as RL starts.

    After a warm start it is saved to ``<run_dir>/reference`` so a resumed run gets the same
    one; without a warm start it is the initial weights (rebuilt from the model paths on resume).
    """
    from hapo_megatron.training.actor import MegatronActor
    from hapo_megatron.training.checkpoint import COMPLETE
    if rt.cfg.algo.kl_loss_coef <= 0:
        return
    ref_dir = os.path.join(rt.run_dir, "reference")
    if os.path.isfile(os.path.join(ref_dir, COMPLETE)):
        rt.reference = rt.actor.make_reference(ckpt_path=ref_dir)
    elif rt.start_step > 0:
        m = rt.cfg.model
        rt.reference = rt.actor.make_reference(megatron_path=m.megatron_load_path,
                                               hf_path=None if m.megatron_load_path else m.hf_model_path)
    else:
        rt.reference = rt.actor.make_reference()
        if rt.cfg.trainer.sft_warmup_steps > 0:
            MegatronActor.save_reference(rt.reference, ref_dir)
            if rt.is_main:
                open(os.path.join(ref_dir, COMPLETE), "w").close()
            dist.barrier()


def _start_fresh(run_dir: str, ckpt_root: str) -> None:
    """A new run in an existing directory: old metrics and saved rollouts go, old checkpoints are
    moved aside (so their step numbers cannot shadow the new run's) rather than deleted."""
    import shutil
    import time
    for name in ("metrics.jsonl", "sft_metrics.jsonl", "summary.json"):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            os.remove(path)
    shutil.rmtree(os.path.join(run_dir, "rollouts"), ignore_errors=True)
    if os.path.isdir(ckpt_root) and os.listdir(ckpt_root):
        old = f"{ckpt_root}.old-{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(ckpt_root, old)
        warnings.warn(f"starting a new run in {run_dir}: previous checkpoints moved to {old}")


def launches_node_servers(cfg) -> bool:
    """SGLang servers the trainer starts itself: on every node (rollout.node_servers)."""
    return cfg.rollout.engine == "sglang" and not cfg.rollout.sglang.server_urls


def build_engine(cfg, hf_config, tokenizer):
    """The rollout engine of this rank (every rank calls it). Rank 0 gets the engine that
    generates. Launched SGLang servers start on every node, each node's first rank starting its
    own (`rollout.node_servers`); those ranks get an engine too (weight sync of their node's
    servers, shutdown). Every other rank: None."""
    from hapo_megatron.rollout.factory import make_engine
    if not launches_node_servers(cfg) and dist.get_rank() != 0:
        return None
    on_gpu = torch.cuda.is_available()
    dtype = torch_dtype(cfg.model.dtype) if on_gpu else torch.float32
    rollout, keys = cfg.rollout, {}
    if rollout.engine == "sglang":  # launched servers get model.max_position_embeddings too
        from dataclasses import replace

        from hapo_megatron.rollout.api_key import KEY_FILE_NAME
        from hapo_megatron.training.context import sglang_context_args
        extra = sglang_context_args(cfg, rollout.sglang.extra_server_args)
        rollout = replace(rollout, sglang=replace(rollout.sglang, extra_server_args=extra))
        keys["key_file"] = os.path.join(cfg.trainer.run_dir, KEY_FILE_NAME)  # the servers' API key
    if launches_node_servers(cfg):
        from hapo_megatron.rollout.node_servers import start_node_servers
        sync_dir = os.environ.get("HAPO_SGLANG_SYNC_DIR")  # disk sync across nodes: run_dir is shared
        if not sync_dir and int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) < dist.get_world_size():
            sync_dir = os.path.join(cfg.trainer.run_dir, "sglang_weights")
        return start_node_servers(rollout.sglang, model_path=cfg.model.hf_model_path, tokenizer=tokenizer,
                                  dtype=dtype, device="cuda" if on_gpu else "cpu", disk_sync_dir=sync_dir,
                                  log_dir=os.path.join(cfg.trainer.run_dir, "sglang_logs"), **keys)
    src = cfg.model.hf_model_path if rollout.engine == "sglang" else hf_config
    return make_engine(rollout, hf_config_or_path=src, tokenizer=tokenizer,
                       device="cuda" if on_gpu else "cpu", dtype=dtype, **keys)


def _start_engine(rt: Runtime) -> None:
    """Build the engine (collective: servers start on every node). Colocated on CUDA, every rank
    offloads its trainer state first, so the servers size their memory pool from a free GPU, and
    reloads it after."""
    from hapo_megatron.training.offload import make_actor_offloader
    rt.memory = EngineMemory(offloader=make_actor_offloader(rt.cfg, rt.actor))
    with rt.memory.trainer_offloaded():
        rt.engine = rt.memory.engine = build_engine(rt.cfg, rt.hf_config, rt.tokenizer)
        if rt.is_main:
            rt.memory.release_all()  # every server's memory; the first weight sync resumes the weights
        dist.barrier()


def build_logger(cfg: HapoConfig, *, enabled: bool) -> MetricsLogger:
    """The metric sinks of ``cfg.logging`` (rank 0 only: ``enabled``), every field named."""
    lg = cfg.logging
    return MetricsLogger(
        cfg.trainer.run_dir, total_steps=cfg.trainer.total_steps, enabled=enabled, console=lg.console,
        jsonl=lg.jsonl, wandb=lg.wandb, wandb_mode=lg.wandb_mode, wandb_project=lg.wandb_project,
        wandb_entity=lg.wandb_entity, experiment_name=lg.wandb_run_name, tensorboard=lg.tensorboard,
        log_interval=lg.log_interval, config=cfg.to_dict(), desc=cfg.trainer.experiment_name,
        tensorboard_dir=lg.tensorboard_dir, initial_step=0)


def build_runtime(cfg: HapoConfig, groups: ParallelGroups, *, tokenizer=None, datasets=None) -> Runtime:
    """Build datasets, actor, engine (rank 0), sinks and checkpoint manager; resume if asked."""
    from hapo_megatron.data import PromptSampler
    from hapo_megatron.rewards import get_reward_fn
    from hapo_megatron.training.checkpoint import resolve_resume

    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = tokenizer or load_tokenizer(cfg.data.tokenizer_path)
    train_ds, val_ds = datasets or build_datasets(cfg, tokenizer)
    hf_config = load_hf_config(cfg.model.hf_model_path, cfg.model.max_position_embeddings)
    init_hf = initial_hf_weights(cfg.model)
    total_opt = cfg.trainer.total_steps * optimizer_steps_per_rl_step(cfg) + cfg.trainer.sft_warmup_steps
    p = cfg.parallel
    check_moe_training_layout(hf_config, tp=p.tensor_model_parallel_size, ep=p.expert_model_parallel_size,
                              etp=p.expert_tensor_parallel_size, pp=p.pipeline_model_parallel_size,
                              cp=p.context_parallel_size, sequence_parallel=p.sequence_parallel)
    actor = MegatronActor(
        hf_config, groups=groups, optim=cfg.optim, total_optimizer_steps=total_opt,
        dtype=cfg.model.dtype if torch.cuda.is_available() else "fp32", use_te=cfg.model.use_te,
        sequence_parallel=cfg.parallel.sequence_parallel,
        recompute_activations=cfg.model.recompute_activations,
        fused_output_layer=cfg.model.fused_output_layer,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        init_hf_path=init_hf, init_megatron_path=cfg.model.megatron_load_path,
        moe_aux_loss_coef=cfg.model.moe_aux_loss_coef)
    ckpt_root = os.path.join(cfg.trainer.run_dir, "checkpoints")
    resume_from = resolve_resume(cfg.trainer.resume, ckpt_root)
    if resume_from is None and rank == 0:
        _start_fresh(cfg.trainer.run_dir, ckpt_root)
    dist.barrier()
    logger = build_logger(cfg, enabled=rank == 0)
    rt = Runtime(
        cfg=cfg, groups=groups, rank=rank, world_size=world, tokenizer=tokenizer, hf_config=hf_config,
        train_ds=train_ds, val_ds=val_ds, actor=actor, engine=None,
        reward_fn=get_reward_fn(cfg.reward.reward_fn), logger=logger,
        ckpt=CheckpointManager(ckpt_root, keep_last_k=cfg.trainer.keep_last_k or 10**9, rank=rank,
                               barrier=dist.barrier, layout=Layout.from_groups(groups), world_size=world,
                               gather=all_gather_objects),
        rl=RLState(
            sampler=PromptSampler(train_ds, cfg.data.train_batch_size if cfg.rollout.generate_batch_size is None
                                  else cfg.rollout.generate_batch_size, seed=cfg.data.seed,
                                  shuffle=cfg.data.shuffle),
            dyn=DynamicSampler(enabled=cfg.algo.filter_groups, metric=cfg.algo.filter_groups_metric,
                               max_num_gen_batches=cfg.algo.max_num_gen_batches)),
        scorer=RewardScorer.from_config(cfg.reward) if rank == 0 else None)
    from hapo_megatron.training.rollout_protocol import Rank0Channel
    rt.control = Rank0Channel.create(timeout_minutes=cfg.trainer.dist_timeout_minutes)  # collective
    for name, n in rt.data_metrics().items():
        logger.write(f"{name}: dropped {n:.0f} prompt(s) longer than data.max_prompt_length="
                     f"{cfg.data.max_prompt_length} (data.filter_overlong_prompts)")
    _start_engine(rt)
    if resume_from:
        if str(cfg.trainer.resume).lower() == "auto":  # a damaged newest checkpoint: an older one
            newest_first = [path for _, path in reversed(list_checkpoints(ckpt_root, warn=False))]
            resume_from, state = load_newest_loadable(rt.ckpt, newest_first, load_model=actor.load,
                                                      log=logger.write)
        else:  # the checkpoint asked for, or an error naming it
            state = rt.ckpt.load(resume_from, load_model=actor.load)
        logger.write(resume_message(resume_from, read_checkpoint_info(resume_from), rt.ckpt.layout))
        rt.restore(state)
        logger.resume(rt.rl.step)
        logger.write(f"resumed from {resume_from} at step {rt.rl.step}")
    return rt
