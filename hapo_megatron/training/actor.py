"""The Megatron actor: model chunks wrapped in Megatron DDP, the (distributed) optimizer, the LR
schedule, forward-only log-prob passes and mini-batch updates through ``forward_backward_func``.

Micro-batches are `MicroBatch` values (`hapo_megatron.parallel.micro_batch`, laid out by
`training.batches.micro_batches`: full sequences, on the host; this class cuts the context-parallel
chunk and moves it to the model's device). A loss factory ``make_loss(mb)`` returns Megatron's
``loss_func(output_tensor) -> (loss_sum, num_tokens, metrics)`` with
``calculate_per_token_loss=True``: Megatron divides the gradients by the global token count.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from hapo_megatron.compat.processes import children_allowed
from hapo_megatron.dtypes import torch_dtype
from hapo_megatron.config.validate import ModelSpec
from hapo_megatron.models.lora import LoraSettings, adapters_disabled, freeze_base, is_lora_param
from hapo_megatron.models.moe import ExpertLoadMonitor, moe_overrides
from hapo_megatron.models.moe_padding import stage_padding_mask
from hapo_megatron.models.routing_replay import (check_consumed, install_route_replay, queue_routes,
                                                 take_mismatch_counts)
from hapo_megatron.parallel.collectives import all_reduce_tensor
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.training.checkpointing.checkpoint import OPTIMIZER_FORMAT, optimizer_sharding_metadata
from hapo_megatron.training.checkpointing.optimizer_state import (ensure_adam_state, load_optimizer_state,
                                                                  reshaped_for_this_optimizer,
                                                                  saved_with_chained_prefix)
from hapo_megatron.training.batches.route_share import route_layer_offset, stage_layer_range

LossFactory = Callable[[MicroBatch], Callable]
ROUTING_MODES = ("off", "measure", "replay")


@dataclass
class StepResult:
    """Outcome of one optimizer step: ``metrics`` are this rank's summed loss metrics (tensors)."""

    skipped: bool
    grad_norm: float
    lr: float
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def packed_seq_params_of(mb: MicroBatch):
    """megatron-core `PackedSeqParams` of a packed micro-batch (None when padded): THD layout,
    sequence boundaries ``cu_seqlens`` of the full row on the model's device (also under context
    parallelism: Transformer Engine splits by them), ``*_padded`` the same boundaries (a sequence's
    padding belongs to its span and sits after its last token, where causal attention keeps it from
    the real tokens), ``max_seqlen`` the longest span. WHY ``cp_group`` stays None: TE would reset
    its CP group from it on every call; the model already holds the group."""
    if not mb.is_packed:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams
    cu = mb.cu_seqlens.to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)


def transformer_overrides(*, recompute_activations: bool, pp: int) -> dict[str, Any]:
    """TransformerConfig fields the actor needs on top of the HF-derived ones."""
    kw: dict[str, Any] = dict(calculate_per_token_loss=True)
    if pp > 1:  # micro-batches have different lengths: stages exchange shapes first
        # (megatron-core rejects variable lengths with the default MoE dispatcher even without MoE)
        kw.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    if recompute_activations:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return kw


class AdaptersOff(list):
    """The policy's own model chunks, run with their LoRA adapters skipped (`models.lora`): the KL
    reference of a LoRA run, exactly the base model, without a second copy of it."""


class MegatronActor:
    """Policy model + optimizer on this rank (Megatron parallel state must be initialised).

    Args:
        hf_config: transformers config of the policy (Llama / Qwen2 / Qwen3).
        groups: `hapo_megatron.parallel.groups.ParallelGroups`.
        dtype: "bf16" | "fp16" | "fp32" (CPU runs use fp32).
        optim: an ``OptimConfig`` (lr, min_lr, lr_warmup_steps, lr_decay_style, lr_decay_steps,
            weight_decay, adam_beta1/2, adam_eps, clip_grad).
        total_optimizer_steps: length of the LR schedule when ``optim.lr_decay_steps`` is null.
        fused_output_layer: the last stage hands its final hidden states and output weight to the
            loss (`parallel.linear_logprobs_entropy`) instead of logits, so the ``[T, V/tp]``
            logits and their gradient are never materialised.
        routing: MoE models: ``"replay"`` routes every token the engine ran to the experts it
            chose (`models.routing_replay`), ``"measure"`` only counts how often the actor's own
            choice differs, ``"off"`` neither (ignored for dense models).
        lora: `models.lora.LoraSettings` (``model.lora``; None: full fine-tuning): adapters on the
            targeted layers, every other parameter frozen before DDP and the optimizer are built,
            so gradient buffers and optimizer state (distributed or not) hold the adapters only.
    """

    def __init__(self, hf_config, *, groups, optim, total_optimizer_steps: int, dtype: str,
                 use_te: Optional[bool], sequence_parallel: bool,
                 recompute_activations: bool, use_distributed_optimizer: bool,
                 init_hf_path: Optional[str] = None, init_megatron_path: Optional[str] = None,
                 fused_output_layer: bool, moe_aux_loss_coef: Optional[float],
                 routing: str = "off", lora: Optional[LoraSettings] = None):
        self.hf_config, self.groups, self.dtype = hf_config, groups, torch_dtype(dtype)
        self.spec = ModelSpec.of(hf_config)
        self.fused_output_layer = bool(fused_output_layer)
        self.lora = lora
        self.lora_base_path = init_hf_path  # what a LoRA checkpoint records (`models.lora_checkpoint`)
        self._lora_base_hash: Optional[str] = None
        self._moe_kw = moe_overrides(hf_config, moe_aux_loss_coef)
        self.model = self._build_model(use_te, sequence_parallel, recompute_activations,
                                       init_hf_path, init_megatron_path, use_distributed_optimizer)
        self.moe_monitor = (ExpertLoadMonitor(self.model, self.spec.num_layers, self.spec.num_experts)
                            if self.spec.is_moe else None)
        if routing not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {ROUTING_MODES}, got {routing!r}")
        self.routing = routing if self.spec.is_moe else "off"  # what the rollouts must return
        # the policy's MoE routers on this stage, each with a `RouteReplay` (none: dense or "off")
        self.routers = (install_route_replay(self.model, replay=routing == "replay", recompute=recompute_activations)
                        if self.routing != "off" else [])
        self.optimizer, self.scheduler = self._build_optimizer(optim, total_optimizer_steps,
                                                               use_distributed_optimizer)
        self.config = self.model[0].config
        from megatron.core.distributed import finalize_model_grads
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.model[0].no_sync
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.num_skipped = 0

    # ------------------------------------------------------------------ construction
    def _build_model(self, use_te, sequence_parallel, recompute, init_hf_path, init_megatron_path,
                     use_distributed_optimizer) -> list:
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        from hapo_megatron.models import build_gpt_model

        g = self.groups
        self._build_kw = dict(groups=g, pre_process=g.is_pipeline_first, post_process=g.is_pipeline_last,
                              dtype=self.dtype, use_te=use_te, sequence_parallel=sequence_parallel,
                              **transformer_overrides(recompute_activations=recompute, pp=g.pp_size),
                              lora=self.lora, **self._moe_kw)
        model = build_gpt_model(self.hf_config, **self._build_kw)
        for p in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        if init_megatron_path:
            from hapo_megatron.convert import load_megatron_checkpoint
            with children_allowed():
                load_megatron_checkpoint([model], init_megatron_path)
        elif init_hf_path:
            from hapo_megatron.convert import load_hf_weights_into_mcore
            load_hf_weights_into_mcore(model, init_hf_path, self.hf_config, tp_rank=g.tp_rank,
                                       tp_size=g.tp_size, pp_rank=g.pp_rank, pp_size=g.pp_size,
                                       etp_rank=g.etp_rank, etp_size=g.etp_size)
        if self.lora is not None:
            freeze_base(model)
        self.param_counts = _param_counts(model, g)
        if self.dtype != torch.float32:
            model = Float16Module(model.config, model)
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=use_distributed_optimizer)
        ddp = DistributedDataParallel(model.config, ddp_cfg, model)
        return [ddp]

    def _build_optimizer(self, optim, total_optimizer_steps, use_distributed_optimizer):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        ocfg = OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
            clip_grad=optim.clip_grad, bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16,
            params_dtype=self.dtype, use_distributed_optimizer=use_distributed_optimizer)
        opt = get_megatron_optimizer(ocfg, self.model)
        warmup = int(optim.lr_warmup_steps)
        decay = int(optim.lr_decay_steps or max(total_optimizer_steps, warmup + 1))
        sched = OptimizerParamScheduler(
            opt, init_lr=0.0 if warmup else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
            lr_warmup_steps=warmup, lr_decay_steps=max(decay, warmup + 1),
            lr_decay_style=optim.lr_decay_style, start_wd=optim.weight_decay, end_wd=optim.weight_decay,
            wd_incr_steps=max(decay, 1), wd_incr_style="constant")
        if warmup:
            sched.step(1)  # the first update already uses lr / warmup, not 0
        return opt, sched

    # ------------------------------------------------------------------ forward / backward
    def _local(self, mb: MicroBatch) -> MicroBatch:
        """This rank's context-parallel chunk of a full-sequence micro-batch, on the model's device."""
        g = self.groups
        return mb.split_for_cp(g.cp_size, g.cp_rank).to(self.device)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (the micro-batches go there for the forward pass)."""
        return next(self.model[0].parameters()).device

    def forward_backward(self, micro_batches: list[MicroBatch], make_loss: LossFactory, *,
                         forward_only: bool, model: Optional[list] = None) -> list[dict]:
        """Run Megatron's schedule over ``micro_batches`` (on ``model``, default the policy);
        returns the loss metrics of each micro-batch (last pipeline stage only; ``[]`` elsewhere).
        ``make_loss`` gets each micro-batch's local chunk, in order."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from hapo_megatron.models.gpt import forward_hidden_states

        local = [self._local(mb) for mb in micro_batches]
        base_only = isinstance(model, AdaptersOff)
        forward = forward_hidden_states if self.fused_output_layer else (lambda m, *a, **kw: m(*a, **kw))
        routers = self.routers if model is None or model is self.model else []  # the KL reference routes itself
        g = self.groups

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if routers:  # this micro-batch's engine routes, in the order this rank's routers see its tokens
                queue_routes(routers, mb.routed_experts, training=not forward_only, tp_rank=g.tp_rank,
                             tp_size=g.tp_size, sequence_parallel=bool(self.config.sequence_parallel),
                             first_layer=self._route_first_layer(mb.routed_experts))
            kw = {}
            packed = packed_seq_params_of(mb)
            if packed is not None:
                kw["packed_seq_params"] = packed
            if self.moe_monitor is not None and mb.padding_mask is not None:  # MoE: padding weighs 0, uncounted
                kw["padding_mask"] = stage_padding_mask(
                    mb.padding_mask, pre_process=g.is_pipeline_first, tp_rank=g.tp_rank, tp_size=g.tp_size,
                    sequence_parallel=bool(self.config.sequence_parallel))
            return forward(model, mb.input_ids, mb.position_ids, None, **kw), make_loss(mb)

        seq_len = max(mb.seq_len for mb in local)
        mbs = max(mb.batch_size for mb in local)
        ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        try:
            with ctx, adapters_disabled(model) if base_only else contextlib.nullcontext():
                out = get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(local), model=model or self.model,
                    num_microbatches=len(local), seq_length=seq_len, micro_batch_size=mbs,
                    forward_only=forward_only)
        except BaseException:
            for r in routers:  # an aborted pass leaves no routes behind for the next one
                r.router_replay.clear()
            raise
        check_consumed(routers)
        return list(out or [])

    def _route_first_layer(self, routes: Optional[torch.Tensor]) -> int:
        """The layer of a micro-batch's first route column: routes hold every layer, or (shared
        out by `stages.rollout`) only this pipeline stage's (`training.batches.route_share`)."""
        if routes is None:
            return 0
        g, cfg = self.groups, self.hf_config
        first, end = stage_layer_range(cfg.num_hidden_layers, g.pp_size, g.pp_rank)
        return route_layer_offset(routes.shape[-1], top_k=int(cfg.num_experts_per_tok),
                                  num_layers=cfg.num_hidden_layers, first=first, end=end)

    @contextlib.contextmanager
    def counting_routing_mismatch(self):
        """Count, in the passes inside, the (token, MoE layer) pairs whose top-k set the actor
        chooses otherwise than the engine did (`take_routing_mismatch`)."""
        for r in self.routers:
            r.router_replay.counting = True
        try:
            yield
        finally:
            for r in self.routers:
                r.router_replay.counting = False

    def take_routing_mismatch(self) -> tuple[int, int]:
        """``(differing, compared)`` pairs of this rank counted so far (resets; (0, 0) without MoE
        routing). Summed over all ranks they give ``rollout/routing_mismatch``: under sequence or
        pipeline parallelism each rank counts its own tokens or layers, without sequence
        parallelism every TP rank counts the same ones, which scales both sums alike."""
        return take_mismatch_counts(self.routers)

    def compute_logprobs_entropy(self, micro_batches: list[MicroBatch], *, temperature: float | str,
                                 chunk_size: Optional[int] = None,
                                 model: Optional[list] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Forward-only pass: ``(logprobs, entropy)`` of each micro-batch, ``[b, s]`` float32 on
        the host, full sequences (gathered over CP), zero where ``loss_mask`` is 0; on the last
        pipeline stage (``[]`` elsewhere). ``model`` selects another model (e.g. the KL reference).
        ``temperature="per_token"``: each micro-batch's own ``temperatures`` (the sampling ones)."""
        from hapo_megatron.parallel.loss import logprobs_entropy_from_logits, zero_loss_like

        results: list[tuple[torch.Tensor, torch.Tensor]] = []

        def make_loss(mb: MicroBatch):
            def loss_func(output):  # logits, or HiddenStates with the fused output layer
                temp = temperature
                if temperature == "per_token":
                    if mb.temperatures is None:
                        raise ValueError("temperature='per_token' needs MicroBatch.temperatures")
                    temp = mb.temperatures.to(mb.labels.device)
                lp, ent = logprobs_entropy_from_logits(output, mb.labels, tp_group=self.groups.tp,
                                                       temperature=temp, chunk_size=chunk_size)
                mask = mb.loss_mask
                results.append(((lp * mask).float(), (ent * mask).float()))
                return zero_loss_like(output), mask.sum().to(torch.int), {}
            return loss_func

        self.forward_backward(micro_batches, make_loss, forward_only=True, model=model)
        if not self.groups.is_pipeline_last:
            return []
        if len(results) != len(micro_batches):
            raise RuntimeError(f"{len(results)} log-prob results for {len(micro_batches)} micro-batches")
        return [(self.gather_cp(lp, mb.cu_seqlens).cpu(), self.gather_cp(ent, mb.cu_seqlens).cpu())
                for mb, (lp, ent) in zip(micro_batches, results)]

    # ------------------------------------------------------------------ KL reference
    def make_reference(self, *, ckpt_path: Optional[str] = None, hf_path: Optional[str] = None,
                       megatron_path: Optional[str] = None) -> list:
        """A frozen copy of the policy (no DDP, no optimizer) for the KL penalty, with the weights
        of a `save_reference` checkpoint, an HF directory, a Megatron checkpoint, or (none given)
        the policy's current weights."""
        from megatron.core import dist_checkpointing
        from megatron.core.transformer.module import Float16Module

        from hapo_megatron.convert import load_hf_weights_into_mcore, load_megatron_checkpoint, unwrap_model
        from hapo_megatron.models import build_gpt_model
        g = self.groups
        ref = build_gpt_model(self.hf_config, **self._build_kw)
        if ckpt_path:
            ref.load_state_dict(dist_checkpointing.load({"model": ref.sharded_state_dict()}, ckpt_path)["model"])
        elif megatron_path:
            load_megatron_checkpoint([ref], megatron_path)
        elif hf_path:
            load_hf_weights_into_mcore(ref, hf_path, self.hf_config, tp_rank=g.tp_rank, tp_size=g.tp_size,
                                       pp_rank=g.pp_rank, pp_size=g.pp_size, etp_rank=g.etp_rank,
                                       etp_size=g.etp_size)
        else:
            ref.load_state_dict(unwrap_model(self.model[0]).state_dict())
        ref.requires_grad_(False)
        ref.eval()
        return [Float16Module(ref.config, ref) if self.dtype != torch.float32 else ref]

    def base_reference(self) -> AdaptersOff:
        """The KL reference of a LoRA run that starts from the base weights: the policy itself with
        its adapters skipped (`AdaptersOff`), no second model."""
        if self.lora is None:
            raise ValueError("base_reference needs LoRA adapters (model.lora.rank > 0)")
        return AdaptersOff(self.model)

    def step_metrics(self) -> dict[str, float]:
        """``actor/trainable_params`` and ``actor/total_params``: the whole model's, over every rank."""
        trainable, total = self.param_counts
        return {"actor/trainable_params": float(trainable), "actor/total_params": float(total)}

    @staticmethod
    def save_reference(reference: list, path: str) -> None:
        from megatron.core import dist_checkpointing

        from hapo_megatron.convert import unwrap_model
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        with children_allowed():
            dist_checkpointing.save({"model": unwrap_model(reference[0]).sharded_state_dict()}, path)

    def gather_cp(self, t: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The full sequence ``[b, s]`` of this rank's context-parallel shard ``[b, s / cp]``
        (collective over the CP group; ``t`` itself without CP); a packed row's THD shard when
        ``cu_seqlens`` (`MicroBatch.cu_seqlens`) is given."""
        if self.groups.cp_size == 1:
            return t
        from hapo_megatron.parallel.context_parallel import all_gather_from_cp
        return all_gather_from_cp(t, self.groups.cp, dim=1, cu_seqlens=cu_seqlens)

    def _grads_finite(self, metrics: list[dict]) -> bool:
        """True when every gradient and loss is finite on every rank (one all-reduce)."""
        bad = 0.0
        for chunk in self.model:
            for buf in list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", [])):
                if not bool(torch.isfinite(buf.grad_data).all()):
                    bad = 1.0
        for m in metrics:
            for v in m.values():
                if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
                    bad = 1.0
        flag = torch.tensor([bad], device=self.device)  # NCCL groups reduce device tensors only
        all_reduce_tensor(flag, None, dist.ReduceOp.MAX)
        return flag.item() == 0.0

    def train_step(self, micro_batches: list[MicroBatch], make_loss: LossFactory) -> StepResult:
        """One optimizer step over ``micro_batches`` (gradients accumulated, normalised by the
        global token count). A non-finite loss or gradient skips the update."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.moe_monitor is not None:
            self.moe_monitor.recording = True
        try:
            per_mb = self.forward_backward(micro_batches, make_loss, forward_only=False)
        finally:
            if self.moe_monitor is not None:
                self.moe_monitor.recording = False
        metrics: dict[str, torch.Tensor] = {}
        for m in per_mb:
            for k, v in m.items():
                v = v.detach().double() if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64)
                metrics[k] = metrics[k] + v if k in metrics else v
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not self._grads_finite(per_mb):
            self.num_skipped += 1
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            return StepResult(skipped=True, grad_norm=float("nan"), lr=lr, metrics=metrics)
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(1)
        return StepResult(skipped=not ok, grad_norm=float(grad_norm or 0.0), lr=lr, metrics=metrics)

    # ------------------------------------------------------------------ weights & checkpoints
    def export_hf_weights(self, dtype: Optional[torch.dtype] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` for the whole model; every rank must consume it fully."""
        from hapo_megatron.convert import export_hf_weights
        return export_hf_weights(self.model, self.hf_config, tp_group=self.groups.tp,
                                 pp_group=self.groups.pp, ep_group=self.groups.ep, etp_group=self.groups.etp,
                                 dtype=dtype)

    def export_lora_adapters(self, dtype: Optional[torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(peft_name, whole matrix)`` of every LoRA adapter's A and B (`convert.peft_export`) in
        ``dtype`` (None: the model's), for SGLang's adapter mode; collective over TP and PP, every
        rank yields every tensor."""
        from hapo_megatron.convert.peft_export import peft_state_dict
        state = peft_state_dict(self.model, tp_group=self.groups.tp, pp_group=self.groups.pp)
        for name in sorted(state):
            yield name, state[name].to(dtype or self.dtype)

    def moe_step_metrics(self) -> dict[str, float]:
        """The MoE metrics of the training steps since the last call (`models.moe`; collective,
        the same on every rank); empty for dense models."""
        if self.moe_monitor is None:
            return {}
        g = self.groups
        return self.moe_monitor.step_metrics(tp_group=g.tp, pp_group=g.pp, dp_cp_group=g.dp_cp, cp_size=g.cp_size,
                                             sequence_parallel=bool(self.config.sequence_parallel))

    def _sharded_state_dict(self, is_loading: bool, optimizer_format: str, chained_prefix: bool = False) -> dict:
        from hapo_megatron.convert import unwrap_model
        model_sd = unwrap_model(self.model[0]).sharded_state_dict()
        if self.lora is not None:  # adapter-only: the frozen base comes back from the base model's weights
            model_sd = {k: v for k, v in model_sd.items() if is_lora_param(k)}
        opt_sd = self.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata=optimizer_sharding_metadata(optimizer_format, chained_prefix=chained_prefix))
        if not is_loading:
            _drop_unsaved_param_state(opt_sd)
        return {"model": model_sd, "optimizer": opt_sd}

    def save(self, path: str, optimizer_format: str = OPTIMIZER_FORMAT) -> None:
        """Model + optimizer with Megatron dist_checkpointing (collective). The default optimizer
        format is layout-free (see `hapo_megatron.training.checkpointing.checkpoint.OPTIMIZER_FORMAT`)."""
        from megatron.core import dist_checkpointing
        ensure_adam_state(self.optimizer)  # a save before the first optimizer step (a run stopped early)
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        with children_allowed():
            dist_checkpointing.save(self._sharded_state_dict(False, optimizer_format), path)
        if self.lora is not None and dist.get_rank() == 0:
            from hapo_megatron.models.lora_checkpoint import lora_record, write_record
            write_record(path, lora_record(self.lora, self.lora_base_path, self.lora_base_hash()))

    def lora_base_hash(self) -> str:
        """The hash of the LoRA base model's weights (`models.lora_checkpoint.base_weights_hash`;
        computed once, on the ranks that ask)."""
        if self._lora_base_hash is None:
            from hapo_megatron.models.lora_checkpoint import base_weights_hash
            self._lora_base_hash = base_weights_hash(self.lora_base_path)
        return self._lora_base_hash

    def load(self, path: str, optimizer_format: str = OPTIMIZER_FORMAT) -> None:
        """Inverse of `save` (collective); ``optimizer_format`` is the one the checkpoint was saved in."""
        from megatron.core import dist_checkpointing

        from hapo_megatron.convert import unwrap_model
        ensure_adam_state(self.optimizer)
        if optimizer_format != OPTIMIZER_FORMAT or saved_with_chained_prefix(path):
            # bucket-bound, or (MoE) keyed by the chain: loads on the layout it was saved under
            state = dist_checkpointing.load(self._sharded_state_dict(True, optimizer_format, True), path)
            optimizer_state = state["optimizer"]
        else:  # model space: loads under any layout, the optimizer chain rebuilt for this one
            sharded = self._sharded_state_dict(True, optimizer_format)
            # WHY a key of its own: the result starts from the saved non-tensor state, shaped
            # like the optimizer that saved it (under "optimizer"); this one's tensors land beside it
            state = dist_checkpointing.load({"model": sharded["model"], "optimizer_loaded": sharded["optimizer"]},
                                            path)
            optimizer_state = reshaped_for_this_optimizer(sharded["optimizer"], state.get("optimizer"),
                                                          state["optimizer_loaded"])
        _load_model_state(unwrap_model(self.model[0]), state["model"], adapters_only=self.lora is not None)
        load_optimizer_state(self.optimizer, optimizer_state)

    def train_state_dict(self) -> dict[str, Any]:
        """The actor's part of ``rl_state.json``: skipped updates and the LR schedule."""
        return {"num_skipped_updates": int(self.num_skipped), "scheduler": self.scheduler.state_dict()}

    def load_train_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of `train_state_dict` (keys an older checkpoint lacks keep their values)."""
        self.num_skipped = int(state.get("num_skipped_updates", 0))
        if state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])


def _load_model_state(model, state: dict, *, adapters_only: bool) -> None:
    """``model.load_state_dict``; with ``adapters_only`` (a LoRA checkpoint) the state holds the
    adapters only and every adapter must be in it (the base keeps the weights it was built with)."""
    if not adapters_only:
        model.load_state_dict(state)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    lost = [k for k in missing if is_lora_param(k)]
    if lost or unexpected:
        raise RuntimeError(f"LoRA checkpoint: adapters missing {lost[:3]}, unexpected keys {list(unexpected)[:3]}")


def _param_counts(model, groups) -> tuple[int, int]:
    """(trainable, total) parameter values of the whole model: a TP-split parameter counted on every
    TP rank, a replicated one on TP rank 0 only, summed over TP and PP (collective over both; the
    embedding's copy on the last stage of a tied model at PP > 1 counts twice)."""
    trainable = total = 0
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False) or groups.tp_rank == 0:
            trainable, total = trainable + (p.numel() if p.requires_grad else 0), total + p.numel()
    device = next(model.parameters()).device  # NCCL groups reduce device tensors only
    counts = torch.tensor([trainable, total], dtype=torch.float64, device=device)
    for group in (groups.tp, groups.pp):
        all_reduce_tensor(counts, group)
    return int(counts[0]), int(counts[1])


def _drop_unsaved_param_state(opt_sd: dict) -> None:
    """Saving the mem-efficient "fully_reshardable" format, the DP ranks other than 0 get
    ``param_state: None`` (DP rank 0 holds the gathered state, see `optimizer_sharding_metadata`).
    That None would sit in their common state dict only, which dist_checkpointing reports as
    "Rank N common state dict differs"; nothing of it is stored, so it goes."""
    parts = [opt_sd] if "param_state" in opt_sd else [v for v in opt_sd.values() if isinstance(v, dict)]
    for part in parts:
        if "param_state" in part and part["param_state"] is None:
            del part["param_state"]
