"""The per-GPU memory plan of a config (training/memory/plan.py) as a doctor line."""

from __future__ import annotations

import torch

from hapo_megatron.doctor.report import FAIL, PASS, CheckResult

GiB = 1024**3
H100_80GB_GIB = 79.6  # what torch.cuda reports for an "80 GB" H100: the default device without a GPU


def check_memory_plan(config: str, overrides=(), *, world_size: int | None = None,
                      device_memory_gib: float | None = None) -> tuple[CheckResult, str]:
    """(the doctor line, the full plan text). The device is this GPU unless ``device_memory_gib``
    (GiB, 2^30 bytes, as torch reports a GPU's memory) is given; on CPU the default is an 80 GB
    H100's 79.6 GiB. The world is the visible GPUs x 1 node
    unless ``world_size`` is given (at least TP x PP x CP). ValueError (from
    ``validate_run``) when the layout cannot run that model on that world."""
    from hapo_megatron.config import load_config
    from hapo_megatron.config.validate import ModelSpec, validate_run
    from hapo_megatron.training.memory.plan import format_plan, plan_from_config
    from hapo_megatron.training.sources import load_hf_config
    cfg = load_config(config, list(overrides))
    try:
        hf_config = load_hf_config(cfg.model.hf_model_path, cfg.model.max_position_embeddings)
    except Exception as e:  # noqa: BLE001 - no network, no such directory, ...
        err = RuntimeError(f"cannot read the HF config of model.hf_model_path={cfg.model.hf_model_path!r} "
                           f"({type(e).__name__})")
        err.fix = ("download the model (or only its config.json) and pass model.hf_model_path=DIR after "
                   "--config, e.g. hapo doctor --config X.yaml model.hf_model_path=/models/Qwen2.5-Math-7B")
        raise err from None
    cuda = torch.cuda.is_available()
    if device_memory_gib:
        device = int(device_memory_gib * GiB)
    else:
        device = torch.cuda.get_device_properties(0).total_memory if cuda else int(H100_80GB_GIB * GiB)
    mp = cfg.parallel.model_parallel_size
    world = world_size or max(torch.cuda.device_count() if cuda else 8, mp)
    # an impossible layout for this model and world (`validate_run`: TP x PP x CP or the expert grid
    # ETP x EP x PP does not divide it, EP the experts, TP the heads...) fails here with the fields
    # to change, as `hapo train` refuses it at start
    try:
        validate_run(cfg, ModelSpec.of(hf_config), world, cuda=True)  # the plan is for GPUs, whatever runs it
    except ValueError as e:
        e.fix = (f"plan for the run's world size (--world-size NODES x GPUS_PER_NODE; {world} was "
                 f"{'given' if world_size else 'assumed'}) or change the parallel.* fields the message names")
        raise
    gpus_per_node = torch.cuda.device_count() if cuda else 8  # the recipes' 8-GPU nodes
    plan = plan_from_config(cfg, hf_config, world_size=world, device_bytes=device, gpus_per_node=gpus_per_node)
    text = format_plan(plan, f"memory plan per GPU of {config} ({world} ranks, {device / GiB:.1f} GiB device)")
    fig = f"peak {plan.peak / GiB:.1f} of {device / GiB:.1f} GiB ({max(plan.phases, key=plan.phases.get)})"
    if plan.warnings:
        return CheckResult("memory plan", FAIL, fig, " | ".join(plan.warnings)), text
    return CheckResult("memory plan", PASS, fig), text
