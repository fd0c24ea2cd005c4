"""`hapo train` / `torchrun -m hapo_megatron.train`: parse the command line, check the inputs
before any work, join the process group, print + save the resolved config, and run `fit`.

    torchrun --nproc-per-node 2 -m hapo_megatron.train --config examples/cpu_tiny/config.yaml \\
        [--preset dapo] [--resume auto|none|PATH] [section.field=value ...]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import warnings
from typing import Optional, Sequence

import torch

from hapo_megatron.compat import activate_cpu_shims
from hapo_megatron.refusal import NOTHING_TO_DO, OneLineParser, refuse
from hapo_megatron.training.checkpointing.checkpoint import CheckpointLoadError, read_rl_state, resolve_resume
from hapo_megatron.training.run_records import finished_message, move_records_aside


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = OneLineParser(prog="hapo train", description="RL training (HAPO / DAPO / GRPO) on Megatron-Core.")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--preset", help="algorithm preset (hapo, dapo, grpo, dapo+temp, ...)")
    p.add_argument("--resume", help="'auto' (newest checkpoint in the run dir), 'none', or a checkpoint path")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume the run directory's checkpoints even though the algorithm (algo.*, reward, model, "
                        "optim, sampling) differs from its saved config.yaml (config/run_identity.py)")
    p.add_argument("--check", action="store_true",
                   help="only the checks done before any process starts, for launcher scripts before torchrun: "
                        f"exit 0 (go), 2 (refused, one line says why) or {NOTHING_TO_DO} (the run is finished)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="with --check: the ranks per node torchrun will start")
    p.add_argument("--nnodes", type=int, default=1, help="with --check: the number of nodes")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as algo.clip_ratio_high=0.28")
    return p.parse_intermixed_args(list(argv) if argv is not None else None)


def collective_wait_bounds_s(cfg) -> dict[str, float]:
    """The longest single waits a trainer collective (the NCCL groups) can span, in seconds, by
    what causes them: while a node leader waits for one weight-sync request
    (rollout.sglang.request_timeout_s; not retried) or for the servers it launched to answer
    (`start_node_servers`' launch timeout), the other ranks wait in the next collective. Empty for
    the HF engine. Generation and evaluation are not here: their waits run on the control group."""
    if cfg.rollout.engine != "sglang":
        return {}
    import inspect

    from hapo_megatron.rollout.sglang.node_servers import start_node_servers
    s = cfg.rollout.sglang
    bounds = {f"one weight-sync request (rollout.sglang.request_timeout_s={s.request_timeout_s:g})":
              float(s.request_timeout_s)}
    if not s.server_urls:
        launch = float(inspect.signature(start_node_servers).parameters["launch_timeout_s"].default)
        bounds[f"the start of the servers the trainer launches ({launch:g} s)"] = launch
    return bounds


def check_dist_timeout(cfg, world_size: int = 1) -> None:
    """trainer.dist_timeout_minutes (the NCCL collectives' timeout) must outlast the longest single
    wait a collective can see (`collective_wait_bounds_s`): a shorter one would abort a healthy run,
    so it is refused at start. A generation round is no such wait (the other ranks wait on the
    control group, training/rollout_protocol.py), so the timeout stays in minutes and a real hang
    stops the job soon. ``world_size`` is kept for the callers (the bounds do not depend on it)."""
    timeout_s = 60.0 * cfg.trainer.dist_timeout_minutes
    too_long = {what: b for what, b in collective_wait_bounds_s(cfg).items() if timeout_s <= b}
    if too_long:
        what, bound = max(too_long.items(), key=lambda kv: kv[1])
        raise ValueError(
            f"trainer.dist_timeout_minutes={cfg.trainer.dist_timeout_minutes:g} ({timeout_s:.0f} s) is not longer than "
            f"{what}, {bound:.0f} s, which a collective of the trainer may wait through: raise "
            f"trainer.dist_timeout_minutes above {bound / 60:.0f} minutes (or lower rollout.sglang.request_timeout_s)")


def check_server_placement(cfg, world_size: int, env=None) -> None:
    """The SGLang servers the trainer launches must fit the nodes: each node runs its share on its
    own GPUs (rollout.placement; ValueError naming the fields when they do not fit)."""
    from hapo_megatron.rollout.sglang.placement import NodeContext, plan_servers
    sg = cfg.rollout.sglang
    if cfg.rollout.engine != "sglang" or sg.server_urls:
        return
    env = os.environ if env is None else env
    ctx = NodeContext.from_env(int(env.get("RANK", 0)), world_size, env)
    plan_servers(num_servers=sg.num_servers, server_tp_size=sg.server_tp_size, num_nodes=ctx.num_nodes,
                 ranks_per_node=ctx.ranks_per_node, colocate=sg.colocate, port_base=sg.port_base,
                 gpus_per_node=torch.cuda.device_count() if torch.cuda.is_available() else None)


def _import_error(module: str) -> Optional[str]:
    """Why ``module`` cannot be imported (None: it can)."""
    import importlib
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any failure means "not usable"; the message says which
        return f"{type(e).__name__}: {e}"
    return None


def check_installs(cfg, *, cuda: Optional[bool] = None) -> None:
    """What the config turns on is installed (README.md, "Installs"), before the model download:
    wandb / TensorBoard when logged to (their extras), and Transformer Engine for context
    parallelism on CUDA (megatron-core's local attention refuses CP without it)."""
    for on, module, extra, field in ((cfg.logging.wandb, "wandb", "wandb", "logging.wandb"),
                                     (cfg.logging.tensorboard, "tensorboard", "tensorboard", "logging.tensorboard")):
        why = _import_error(module) if on else None
        if why:
            raise ValueError(f"{field}=true but {module} cannot be imported ({why}): pip install -e '.[{extra}]' "
                             f"(the image has it), or set {field}=false")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    cp = cfg.parallel.context_parallel_size
    if cuda and cp > 1:
        why = "model.use_te=false" if cfg.model.use_te is False else _import_error("transformer_engine.pytorch")
        if why:
            raise ValueError(f"parallel.context_parallel_size={cp} needs Transformer Engine's attention on CUDA, "
                             f"which is not available ({why}): use the image (docs/docker.md) or the GPU pip "
                             "install with TE (README.md), or set parallel.context_parallel_size=1")


class RunFinished(Exception):
    """The run directory holds a finished run and nothing asks for more steps (the message says
    how to extend it); `main` prints it and exits 0 without touching the directory."""


def check_not_finished(cfg, resumes_from: Optional[str]) -> None:
    """Raise `RunFinished` when ``resumes_from`` (the checkpoint a resume would load) is at or past
    trainer.total_steps and the run's summary covers it (training/run_records.py)."""
    if resumes_from is None:
        return
    try:
        step = int(read_rl_state(resumes_from)["step"])
    except (OSError, ValueError, KeyError):
        return  # the load reports a damaged checkpoint
    why = finished_message(cfg.trainer.run_dir, step, cfg.trainer.total_steps)
    if why:
        raise RunFinished(why)


def _load_model_config(path: Optional[str]):
    from hapo_megatron.training.sources import load_hf_config
    if not path:
        raise ValueError("model.hf_model_path must name an HF model directory (config.json + tokenizer)")
    try:
        return load_hf_config(path, max_position_embeddings=None)  # the model's own context
    except Exception as e:  # noqa: BLE001 - any failure here means "no usable model config"
        if not os.path.exists(path):
            raise FileNotFoundError(f"model.hf_model_path: {path!r} does not exist") from None
        raise ValueError(f"model.hf_model_path: cannot read an HF config from {path!r}: {e}") from None


def resolve_model_sources(cfg) -> None:
    """Hub names in model.hf_model_path / data.tokenizer_path -> their local snapshots, in place,
    before anything reads them (models/hub.py): the actor, tokenizer, servers and exports then
    read the same files."""
    from hapo_megatron.models.hub import resolve_model_path
    name = cfg.model.hf_model_path
    local = resolve_model_path(name, "model.hf_model_path")
    if cfg.data.tokenizer_path == name:
        cfg.data.tokenizer_path = local
    else:
        cfg.data.tokenizer_path = resolve_model_path(cfg.data.tokenizer_path, "data.tokenizer_path")
    cfg.model.hf_model_path = local


def preflight(cfg, world_size: int, *, allow_config_change: bool = False):
    """Every check that can fail on the inputs, before any process group or model exists.

    Returns ``(tokenizer, (train_dataset, val_dataset))``. Raises ValueError / FileNotFoundError
    with a message naming the config field or the file/row.
    """
    from hapo_megatron.training.sources import build_datasets, initial_hf_weights, load_tokenizer
    from hapo_megatron.training.context_length import check_sequence_fits, sglang_context_args
    from hapo_megatron.config.run_identity import check_same_algorithm
    from hapo_megatron.config.validate import ModelSpec, validate_run
    from hapo_megatron.models.lora import check_lora
    check_installs(cfg)
    resolve_model_sources(cfg)
    hf_config = _load_model_config(cfg.model.hf_model_path)
    validate_run(cfg, ModelSpec.of(hf_config), world_size)
    check_lora(cfg.model.lora, hf_config)
    check_sequence_fits(hf_config, cfg)
    sglang_context_args(cfg, cfg.rollout.sglang.extra_server_args)  # no clashing server flags
    check_dist_timeout(cfg, world_size)
    check_server_placement(cfg, world_size)
    if cfg.model.megatron_load_path and not os.path.isdir(cfg.model.megatron_load_path):
        raise FileNotFoundError(f"model.megatron_load_path: {cfg.model.megatron_load_path!r} does not exist")
    initial_hf_weights(cfg.model)  # weights, a Megatron checkpoint, or model.random_init=true
    resumes_from = resolve_resume(cfg.trainer.resume, os.path.join(cfg.trainer.run_dir, "checkpoints"))
    changed = check_same_algorithm(cfg, resumes_from, allow_change=allow_config_change)
    if changed and int(os.environ.get("RANK", 0)) == 0:
        warnings.warn(f"--allow-config-change: resuming {resumes_from} with a changed algorithm: " + "; ".join(changed))
    check_not_finished(cfg, resumes_from)
    from hapo_megatron.models.lora import lora_settings
    from hapo_megatron.models.lora_checkpoint import check_resume
    check_resume(resumes_from, lora_settings(cfg.model.lora), cfg.model.hf_model_path)  # the same base, adapters
    for i, f in enumerate(list(cfg.data.train_files) + list(cfg.data.val_files)):
        if not os.path.isfile(f):
            raise FileNotFoundError(f"data file {f!r} does not exist (data.train_files / data.val_files)")
    try:
        tokenizer = load_tokenizer(cfg.data.tokenizer_path)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"data.tokenizer_path: cannot load a tokenizer from {cfg.data.tokenizer_path!r}: "
                         f"{e}") from None
    train, val = build_datasets(cfg, tokenizer)
    per_round = cfg.rollout.generate_batch_size or cfg.data.train_batch_size
    if per_round > len(train):
        raise ValueError(f"data.train_batch_size / rollout.generate_batch_size ({per_round}) is larger than the "
                         f"training set ({len(train)} prompts)")
    if len(tokenizer) > hf_config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{hf_config.vocab_size} (data.tokenizer_path / model.hf_model_path mismatch)")
    return tokenizer, (train, val)


def _init_distributed(timeout_minutes: float) -> None:
    import torch.distributed as dist
    if dist.is_initialized() or "RANK" not in os.environ:
        return  # single process: initialize_parallel creates a 1-process group
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def cpu_threads(cpu_count: int, local_ranks: int, max_staleness: int) -> int:
    """Intra-op threads of each CPU rank: the node's cores shared out among its ranks, one core
    left out under asynchronous rollouts. There the producer and the servers run while the ranks
    train, and an OpenMP team that spans every core stalls whenever one of its threads is
    preempted (measured on 2 cores: training 27% slower with 2 threads, unchanged with 1;
    tools/bench/README.md)."""
    cores = cpu_count - 1 if max_staleness else cpu_count
    return max(1, cores // max(1, local_ranks))


def _set_threads(cfg) -> None:
    if torch.cuda.is_available():
        return
    torch.set_num_threads(cpu_threads(os.cpu_count() or 1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                                      int(cfg.rollout.max_staleness)))


def print_memory_plan(cfg, world_size: int) -> None:
    """Rank 0 on CUDA: the per-GPU memory plan of the run (training/memory/plan.py), with a
    warning when a phase does not fit the device."""
    if not torch.cuda.is_available():
        return
    from hapo_megatron.training.memory.plan import format_plan, plan_from_config
    from hapo_megatron.training.sources import load_hf_config
    hf_config = load_hf_config(cfg.model.hf_model_path, cfg.model.max_position_embeddings)
    device = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    plan = plan_from_config(cfg, hf_config, world_size=world_size, device_bytes=device,
                            gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count())))
    print(format_plan(plan, f"memory plan per GPU ({torch.cuda.get_device_name()}, estimate)"), flush=True)
    if plan.warnings:
        warnings.warn("the memory plan does not fit the device: " + "; ".join(plan.warnings))


def quiet_warnings() -> None:
    """Hide the import-time/deprecation noise of megatron-core and torch on CPU-only installs."""
    for pattern in ("Transformer Engine and Apex", "Apex is not installed", "full scope is deprecated",
                    "CUDA_DEVICE_MAX_CONNECTIONS", "The .grad attribute of a Tensor that is not a leaf",
                    "ShardedTensor", "`load_state_dict` is deprecated", "TypedStorage is deprecated"):
        warnings.filterwarnings("ignore", message=f".*{pattern}.*")
    warnings.filterwarnings("ignore", category=FutureWarning)


def start_records(cfg) -> None:
    """Rank 0, every rank past its checks: a run that starts fresh (nothing to resume) moves the
    records of the directory's earlier run into one dated folder first, so that none is
    overwritten (training/run_records.py), and says where."""
    run_dir = cfg.trainer.run_dir
    os.makedirs(run_dir, exist_ok=True)
    if resolve_resume(cfg.trainer.resume, os.path.join(run_dir, "checkpoints")) is not None:
        return
    # attached servers (a recipe's launch_servers.sh with the run dir as its shared dir) write their
    # logs there before the trainer starts: those are this run's, and the servers hold them open
    keep = ("sglang_logs",) if cfg.rollout.engine == "sglang" and cfg.rollout.sglang.server_urls else ()
    moved = move_records_aside(run_dir, keep=keep)
    if moved:
        print(f"hapo train: a new run in {run_dir}: the records of the run before it are moved to {moved}",
              flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `hapo train`; returns the exit code: 0 done, 1 stopped by a failure, 2 bad
    input (nothing was run), 75 stopped early by a signal or trainer.exit_after_minutes after
    saving (`--resume auto` continues; training/checkpointing/preemption.py)."""
    quiet_warnings()
    from hapo_megatron.config import format_config, load_config, save_config
    args = parse_args(argv)
    if args.check:  # the world torchrun will start (placement and layout checks read it)
        os.environ.update(WORLD_SIZE=str(args.nproc_per_node * args.nnodes), LOCAL_WORLD_SIZE=str(args.nproc_per_node))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    overrides = list(args.overrides) + ([f"trainer.resume={args.resume}"] if args.resume else [])
    try:
        cfg = load_config(args.config, overrides, preset=args.preset)
        tokenizer, datasets = preflight(cfg, world, allow_config_change=args.allow_config_change)
    except RunFinished as e:
        if rank == 0:
            print(f"hapo train: {e}", flush=True)
        return NOTHING_TO_DO if args.check else 0
    except (ValueError, OSError) as e:  # OSError: FileNotFoundError, IsADirectoryError, PermissionError...
        return refuse("hapo train", e, rank=rank)
    if args.check:
        return 0
    _set_threads(cfg)
    activate_cpu_shims()  # megatron-core on CPU (gloo); a no-op where CUDA is available
    _init_distributed(cfg.trainer.dist_timeout_minutes)
    if rank == 0:
        start_records(cfg)
        print(format_config(cfg), flush=True)
        print_memory_plan(cfg, world)
        print(f"config saved to {save_config(cfg, os.path.join(cfg.trainer.run_dir, 'config.yaml'))}", flush=True)
    import torch.distributed as dist

    from hapo_megatron.rollout.sglang.client import SGLangError
    from hapo_megatron.training.checkpointing.preemption import RunStopped
    from hapo_megatron.training.trainer import TrainingStopped, fit
    code = 0
    try:
        fit(cfg, tokenizer=tokenizer, datasets=datasets)
    except RunStopped as e:  # every rank agreed on it and the checkpoint is complete
        if rank == 0:
            print(f"hapo train: stopped early: {e} (exit code {e.exit_code})", file=sys.stderr, flush=True)
        code = e.exit_code
    except CheckpointLoadError as e:  # every rank: the failure is agreed on (CheckpointManager.load)
        if rank == 0:
            print(f"hapo train: error: {e}", file=sys.stderr, flush=True)
        return 1
    except TrainingStopped as e:
        if rank == 0:
            print(f"hapo train: stopped: {e}", file=sys.stderr, flush=True)
        return 1
    except SGLangError as e:  # rank 0 only (it drives the engine); torchrun then ends the others
        print(f"hapo train: stopped: the SGLang rollout engine failed (checkpoints saved so far are kept): {e}",
              file=sys.stderr, flush=True)
        return 1
    if dist.is_initialized() and "RANK" in os.environ:
        dist.barrier()
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
