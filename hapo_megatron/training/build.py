"""How a run is built from a `HapoConfig`: datasets, actor, rollout engine (rank 0; with launched
SGLang servers every node's first rank), reward scorer, metric sinks, checkpoint manager and the
KL reference; resuming when asked. The built state is a `training.runtime.Runtime`."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hapo_megatron.config import HapoConfig
from hapo_megatron.data import PromptSampler
from hapo_megatron.dtypes import torch_dtype
from hapo_megatron.convert.peft_export import peft_config
from hapo_megatron.models.lora import lora_settings
from hapo_megatron.training.memory.plan import reference_is_adapters_off
from hapo_megatron.config.validate import ModelSpec, rollout_dtype
from hapo_megatron.parallel.collectives import all_gather_objects
from hapo_megatron.parallel.groups import ParallelGroups
from hapo_megatron.rewards import get_reward_fn
from hapo_megatron.rewards.scoring import RewardScorer
from hapo_megatron.rollout.sglang.api_key import KEY_FILE_NAME
from hapo_megatron.rollout.factory import make_engine
from hapo_megatron.rollout.sglang.node_servers import start_node_servers
from hapo_megatron.training.actor import MegatronActor
from hapo_megatron.training.checkpointing.checkpoint import (COMPLETE, CheckpointManager, Layout,
                                                             list_checkpoints, load_newest_loadable,
                                                             read_checkpoint_info, resolve_resume,
                                                             resume_message)
from hapo_megatron.training.context_length import sglang_context_args
from hapo_megatron.training.memory.engine_memory import EngineMemory
from hapo_megatron.training.metrics.sinks import MetricsLogger
from hapo_megatron.training.memory.offload import make_actor_offloader
from hapo_megatron.training.checkpointing.rl_state import RLState
from hapo_megatron.training.batches.rollout_batch import DynamicSampler
from hapo_megatron.training.rollout_protocol import Rank0Channel
from hapo_megatron.training.run_records import read_summary, set_aside_after
from hapo_megatron.training.runtime import Runtime
from hapo_megatron.training.sources import build_datasets, initial_hf_weights, load_hf_config, load_tokenizer


def optimizer_steps_per_rl_step(cfg) -> int:
    return max(1, cfg.data.train_batch_size // cfg.trainer.ppo_mini_batch_size) * cfg.trainer.ppo_epochs


def setup_reference(rt: Runtime) -> None:
    """The KL reference (only with algo.kl_loss_coef > 0): the policy as RL starts. With LoRA
    (no SFT warm start, no MoE routing) that is the policy with its adapters skipped, no copy.

    After a warm start it is saved to ``<run_dir>/reference`` so a resumed run gets the same
    one; without a warm start it is the initial weights (rebuilt from the model paths on resume).
    """
    if rt.cfg.algo.loss.kl_loss_coef <= 0:
        return
    if reference_is_adapters_off(rt.cfg, rt.actor.routing != "off"):
        rt.reference = rt.actor.base_reference()  # LoRA: the base weights are the policy's own, frozen
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


ROUTES_SERVER_FLAG = "--enable-return-routed-experts"  # SGLang answers return_routed_experts requests


def routing_mode(cfg, hf_config) -> str:
    """The actor's MoE routing (`MegatronActor` ``routing``): replay, measure or off. Replay on a
    dense model is a config error."""
    if not ModelSpec.of(hf_config).is_moe:
        if cfg.model.routing_replay:
            raise ValueError(f"model.routing_replay=true needs a MoE model; {cfg.model.hf_model_path} "
                             f"({getattr(hf_config, 'model_type', None)}) has no experts")
        return "off"
    if cfg.model.routing_replay:
        return "replay"
    return "measure" if cfg.model.measure_routing_mismatch else "off"


def engine_returns_routes(cfg, hf_config) -> bool:
    """Whether training rollouts ask the engine for its routed experts."""
    return routing_mode(cfg, hf_config) != "off"


def launches_node_servers(cfg) -> bool:
    """SGLang servers the trainer starts itself: on every node (rollout.sglang.node_servers)."""
    return cfg.rollout.engine == "sglang" and not cfg.rollout.sglang.server_urls


def engine_settings(cfg, hf_config, *, on_gpu: bool):
    """The rollout section the engine is built from and its dtype: ``rollout.dtype``, else the
    model's on a GPU and fp32 on CPU; launched SGLang servers also get the context length
    (`sglang_context_args`) and, when training replays or measures routes, the routes flag."""
    dtype = torch_dtype(rollout_dtype(cfg, on_gpu=on_gpu))
    rollout = cfg.rollout
    if rollout.engine == "sglang":
        from dataclasses import replace

        extra = sglang_context_args(cfg, rollout.sglang.extra_server_args)
        if engine_returns_routes(cfg, hf_config) and ROUTES_SERVER_FLAG not in extra:
            extra = (*extra, ROUTES_SERVER_FLAG)
        if rollout.sglang.lora_sync == "adapter" and "--enable-lora" not in extra:
            from hapo_megatron.config.sections import lora_hf_targets
            from hapo_megatron.rollout.sglang.launch import lora_server_args
            lora = cfg.model.lora
            extra = (*extra, *lora_server_args(lora.rank, lora_hf_targets(lora.target_modules)))
        rollout = replace(rollout, sglang=replace(rollout.sglang, extra_server_args=extra))
    return rollout, dtype


def build_engine(cfg, hf_config, tokenizer):
    """The rollout engine of this rank (every rank calls it). Rank 0 gets the engine that
    generates. Launched SGLang servers start on every node, each node's first rank starting its
    own (`rollout.sglang.node_servers`); those ranks get an engine too (weight sync of their node's
    servers, shutdown). Every other rank: None."""
    if not launches_node_servers(cfg) and dist.get_rank() != 0:
        return None
    on_gpu = torch.cuda.is_available()
    rollout, dtype = engine_settings(cfg, hf_config, on_gpu=on_gpu)
    keys = {"key_file": os.path.join(cfg.trainer.run_dir, KEY_FILE_NAME)} if rollout.engine == "sglang" else {}
    if rollout.engine == "sglang" and rollout.sglang.lora_sync == "adapter":
        keys["lora_adapter"] = peft_config(lora_settings(cfg.model.lora), cfg.model.hf_model_path)
    if launches_node_servers(cfg):
        sync_dir = os.environ.get("HAPO_SGLANG_SYNC_DIR")  # disk sync across nodes: run_dir is shared
        if not sync_dir and int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) < dist.get_world_size():
            sync_dir = os.path.join(cfg.trainer.run_dir, "sglang_weights")
        return start_node_servers(rollout.sglang, model_path=cfg.model.hf_model_path, tokenizer=tokenizer,
                                  dtype=dtype, device="cuda" if on_gpu else "cpu", disk_sync_dir=sync_dir,
                                  log_dir=os.path.join(cfg.trainer.run_dir, "sglang_logs"),
                                  quantization=rollout.quantization, kv_cache_dtype=rollout.kv_cache_dtype, **keys)
    src = cfg.model.hf_model_path if rollout.engine == "sglang" else hf_config
    return make_engine(rollout, hf_config_or_path=src, tokenizer=tokenizer,
                       device="cuda" if on_gpu else "cpu", dtype=dtype, **keys)


def start_engine(rt: Runtime) -> None:
    """Build the engine (collective: servers start on every node). Colocated on CUDA, every rank
    offloads its trainer state first, so the servers size their memory pool from a free GPU, and
    reloads it after."""
    rt.memory = EngineMemory(offloader=make_actor_offloader(rt.cfg, rt.actor))
    with rt.memory.trainer_offloaded():
        rt.engine = rt.memory.engine = build_engine(rt.cfg, rt.hf_config, rt.tokenizer)
        if rt.is_main:
            rt.memory.release_all()  # every server's memory; the first weight sync resumes the weights
        dist.barrier()


def build_logger(cfg: HapoConfig, *, enabled: bool) -> MetricsLogger:
    """The metric sinks of ``cfg.logging`` (rank 0 only: ``enabled``)."""
    return MetricsLogger(cfg.logging, cfg.trainer.run_dir, total_steps=cfg.trainer.total_steps, enabled=enabled,
                         config=cfg.to_dict(), desc=cfg.trainer.experiment_name, initial_step=0)


def set_aside_resumed_records(rt: Runtime) -> None:
    """Rank 0 on resume: what the resumed run writes again (metrics lines and rollouts after its
    step, the summary) goes to a dated folder, the summary kept for the new one (run_records.py)."""
    rt.previous_summary = read_summary(rt.run_dir)
    moved = set_aside_after(rt.run_dir, rt.rl.step)
    if moved:
        rt.logger.write(f"resume: the records of the run after step {rt.rl.step} are moved to {moved}")


def build_runtime(cfg: HapoConfig, groups: ParallelGroups, *, tokenizer=None, datasets=None) -> Runtime:
    """Build datasets, actor, engine (rank 0), sinks and checkpoint manager; resume if asked."""

    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = tokenizer or load_tokenizer(cfg.data.tokenizer_path)
    train_ds, val_ds = datasets or build_datasets(cfg, tokenizer)
    hf_config = load_hf_config(cfg.model.hf_model_path, cfg.model.max_position_embeddings)
    init_hf = initial_hf_weights(cfg.model)
    total_opt = cfg.trainer.total_steps * optimizer_steps_per_rl_step(cfg) + cfg.trainer.sft_warmup_steps
    actor = MegatronActor(
        hf_config, groups=groups, optim=cfg.optim, total_optimizer_steps=total_opt,
        dtype=cfg.model.dtype if torch.cuda.is_available() else "fp32", use_te=cfg.model.use_te,
        sequence_parallel=cfg.parallel.sequence_parallel,
        recompute_activations=cfg.model.recompute_activations,
        fused_output_layer=cfg.model.fused_output_layer,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        init_hf_path=init_hf, init_megatron_path=cfg.model.megatron_load_path,
        moe_aux_loss_coef=cfg.model.moe_aux_loss_coef, routing=routing_mode(cfg, hf_config),
        lora=lora_settings(cfg.model.lora))
    ckpt_root = os.path.join(cfg.trainer.run_dir, "checkpoints")
    resume_from = resolve_resume(cfg.trainer.resume, ckpt_root)  # a fresh start: train.start_records
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
        scorer=RewardScorer(cfg.reward) if rank == 0 else None)
    rt.control = Rank0Channel.create(timeout_minutes=cfg.trainer.control_timeout_minutes)  # collective
    for name, n in rt.data_metrics().items():
        logger.write(f"{name}: dropped {n:.0f} prompt(s) longer than data.max_prompt_length="
                     f"{cfg.data.max_prompt_length} (data.filter_overlong_prompts)")
    start_engine(rt)
    if resume_from:
        if str(cfg.trainer.resume).lower() == "auto":  # a damaged newest checkpoint: an older one
            newest_first = [path for _, path in reversed(list_checkpoints(ckpt_root, warn=False))]
            resume_from, state = load_newest_loadable(rt.ckpt, newest_first, load_model=actor.load,
                                                      log=logger.write)
        else:  # the checkpoint asked for, or an error naming it
            state = rt.ckpt.load(resume_from, load_model=actor.load)
        logger.write(resume_message(resume_from, read_checkpoint_info(resume_from), rt.ckpt.layout))
        rt.restore(state)
        if rt.is_main:
            set_aside_resumed_records(rt)
        logger.resume(rt.rl.step)
        logger.write(f"resumed from {resume_from} at step {rt.rl.step}")
    return rt
