"""Mixture-of-Experts (Qwen3-MoE) on Megatron: the TransformerConfig fields of the sparse layers
and the per-step MoE metrics (router load-balancing loss and per-expert load). The checks of an
expert layout are `config/validate.py`'s.
"""

from __future__ import annotations

from typing import Optional

import torch
from hapo_megatron.config.validate import ModelSpec
from hapo_megatron.models.hf_config import moe_layer_pattern
from hapo_megatron.models.moe_padding import real_rows
from hapo_megatron.parallel.collectives import all_reduce_tensor, rank_and_world

# Megatron's name of the router load-balancing loss in its aux-loss tracker (moe_utils).
AUX_LOSS_NAME = "load_balancing_loss"


def moe_config_fields(hf_config, etp: int = 1, fused: bool = False) -> dict:
    """TransformerConfig fields of a Qwen3-MoE config's sparse layers.

    The router: HF takes softmax over all experts, then the top-k, then (norm_topk_prob)
    renormalises them to sum 1. That equals Megatron's top-k of the logits followed by a softmax
    over the k chosen (moe_router_pre_softmax=False); without renormalisation it is Megatron's
    pre-softmax routing (softmax over all, then top-k). No capacity limit or token dropping (HF
    drops none). Experts: with ``fused`` (Transformer Engine on a GPU) TE's grouped MLP (one grouped
    GEMM for all local experts, not a loop with a host sync per expert) and TE's fused token
    permutation; otherwise SequentialMLP and the unfused permutation (exact, and the only ones on
    CPU). `hapo doctor` checks each fused path against the unfused one on the GPU
    (docs/moe.md, "GPU speed settings"). The aux-loss coefficient comes from router_aux_loss_coef;
    the training config may override it (`moe_aux_loss_coeff=` in `kw`). Tokens travel with the
    alltoall dispatcher, except with ETP > 1 without CUDA: its uneven all-gather over the expert-TP
    group is not supported by gloo, so the allgather dispatcher (same results) is used there.
    """
    pattern = moe_layer_pattern(hf_config)
    return dict(
        num_moe_experts=int(hf_config.num_experts),
        moe_router_topk=int(hf_config.num_experts_per_tok),
        moe_ffn_hidden_size=int(hf_config.moe_intermediate_size),
        moe_layer_freq=pattern if not all(pattern) else 1,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not bool(getattr(hf_config, "norm_topk_prob", False)),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="allgather" if etp > 1 and not torch.cuda.is_available() else "alltoall",
        moe_grouped_gemm=bool(fused),
        moe_permute_fusion=bool(fused),
        moe_shared_expert_intermediate_size=None,
    )


class ExpertLoadMonitor:
    """Counts the tokens each router sends to each expert (forward hooks on every MoE router of
    the model chunks) and reads Megatron's aux-loss tracker; `step_metrics` reduces both over
    the ranks and starts over (docs/moe.md, "Metrics").

    Set `recording` around the passes to count. Counts are per (layer, expert) over this rank's
    routed tokens: under sequence parallelism
    each TP rank routes its own slice, without it every TP rank routes the same tokens (so the
    TP sum is taken only with sequence parallelism). The counts stay on the model's device
    (`device`; default: the first parameter's): no device-to-host copy per router call, one per
    step in `step_metrics`, whose collectives also run on that device (NCCL takes no CPU tensor).
    Only router calls under grad count, as Megatron's aux-loss tracker does: under activation
    recompute the checkpointed no-grad forward and its recompute both route the same tokens.
    """

    def __init__(self, model_chunks, num_layers: int, num_experts: int, device=None):
        self.num_layers, self.num_experts = num_layers, num_experts
        chunks = list(model_chunks)
        if device is None:
            device = next(iter(chunks[0].parameters())).device if chunks else torch.device("cpu")
        self.device = torch.device(device)
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=self.device)
        self.calls = torch.zeros(num_layers, dtype=torch.float64, device=self.device)  # on the device: no sync
        self.recording = False  # on during training steps only (not the log-prob passes)
        self.handles = []
        for chunk in chunks:
            for module in chunk.modules():
                if type(module).__name__ == "TopKRouter":
                    self.handles.append(module.register_forward_hook(self._hook))

    def _hook(self, router, inputs, output) -> None:
        if not self.recording or not torch.is_grad_enabled():
            return
        # [tokens, experts] bool; pads are dispatched with weight 0 and not counted (models/moe_padding.py)
        routing_map = real_rows(inputs, output[1].detach())
        layer = router.layer_number - 1
        routed = routing_map.sum(0).to(self.device, torch.int64)
        self.counts[layer] += routed
        self.calls[layer] += routed.sum() > 0  # a filler micro-batch (all padding) is no call; stays on the device

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _reduced_totals(self, *, tp_group=None, pp_group=None, dp_cp_group=None,
                        sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(counts ``[L, E]``, router calls ``[L]``, summed aux losses ``[L]``), float64 on
        `device`, summed over the groups (collective over every group given); resets. Over
        data x context parallel: each CP rank routes its own slice of the sequences, and its aux
        loss is a partial sum over megatron-core's TP x CP reduce group (router.py `_apply_aux_loss`)."""
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        stats = torch.cat([self.counts.flatten().to(torch.float64), self.calls])  # counts < 2^53: exact
        tracker = get_moe_layer_wise_logging_tracker().get(AUX_LOSS_NAME)
        aux = (tracker["values"].detach().to(self.device, torch.float64) if tracker is not None
               else torch.zeros(self.num_layers, dtype=torch.float64, device=self.device))
        if tracker is not None:
            tracker["values"].zero_()
        groups = (pp_group, tp_group if sequence_parallel else None, dp_cp_group)
        for group in groups:
            if group is not None:
                all_reduce_tensor(stats, group)
        for group in groups:  # partial sums of one loss over TP (SP) and CP; whole losses over DP
            if group is not None:
                all_reduce_tensor(aux, group)
        self.counts.zero_()
        self.calls.zero_()
        n = self.counts.numel()
        return stats[:n].view(self.num_layers, self.num_experts), stats[n:], aux

    def step_metrics(self, *, tp_group=None, pp_group=None, dp_cp_group=None, cp_size: int = 1,
                     sequence_parallel: bool) -> dict[str, float]:
        """`actor/moe_aux_loss`: the router load-balancing loss (before its coefficient), mean over
        MoE layers, micro-batches and data-parallel ranks; `actor/moe_expert_load_{max,min}`: the
        most / least loaded expert's share of routed tokens over the uniform share 1/E, and
        `actor/moe_expert_load_cv` their coefficient of variation, per layer over the whole step
        and all ranks, averaged over MoE layers. ``dp_cp_group``: the data x context parallel group
        (`ParallelGroups.dp_cp`), of which ``cp_size`` ranks share each sequence. Collective over
        every group given; resets."""
        counts, calls, aux = (t.cpu() for t in self._reduced_totals(
            tp_group=tp_group, pp_group=pp_group, dp_cp_group=dp_cp_group, sequence_parallel=sequence_parallel))
        layers = calls > 0
        if not bool(layers.any()):
            return {}
        dp_cp = rank_and_world(dp_cp_group)[1] if dp_cp_group is not None else 1
        if dp_cp % cp_size:
            raise ValueError(f"data x context parallel size {dp_cp} is not a multiple of cp_size {cp_size}")
        # calls were summed over dp x cp (and tp under SP) ranks: micro-batches per rank = calls / that;
        # the aux loss over tp (SP) x cp ranks is one loss per data-parallel rank and micro-batch
        ranks = dp_cp * (rank_and_world(tp_group)[1] if sequence_parallel and tp_group is not None else 1)
        per_layer_aux = aux[layers] / (calls[layers] / ranks) / (dp_cp // cp_size)
        share = counts[layers] / counts[layers].sum(1, keepdim=True).clamp_min(1) * self.num_experts
        return {"actor/moe_aux_loss": float(per_layer_aux.mean()),
                "actor/moe_expert_load_max": float(share.max(1).values.mean()),
                "actor/moe_expert_load_min": float(share.min(1).values.mean()),
                "actor/moe_expert_load_cv": float((share.std(1, unbiased=False)).mean())}


def moe_overrides(hf_config, moe_aux_loss_coef: Optional[float]) -> dict:
    """TransformerConfig overrides of the run's MoE settings (`model.moe_aux_loss_coef`; None keeps
    the HF config's router_aux_loss_coef); empty for dense models."""
    if not ModelSpec.of(hf_config).is_moe or moe_aux_loss_coef is None:
        return {}
    return {"moe_aux_loss_coeff": float(moe_aux_loss_coef)}
