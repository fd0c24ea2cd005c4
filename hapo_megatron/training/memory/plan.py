"""Per-GPU memory plan of a run: trainer static state + SGLang pool + activation estimate against
the device's memory, for each phase of a step. Pure arithmetic (tested with hand-computed cases);
`plan_from_config` reads the numbers from a `HapoConfig` and the model's HF config. Checked
against Megatron-LM's `megatron/training/theoretical_memory_usage.py` (docs/moe.md, "Memory plan").

Bytes per parameter follow Megatron's mixed precision with the distributed optimizer: model
params in the training dtype, fp32 gradient buffers (grad_reduce_in_fp32), and fp32 main params
+ two fp32 Adam moments sharded over the DP x CP ranks. MoE expert weights are split over
EP x ETP (not TP) and their optimizer state over the expert-data-parallel ranks
(TP x CP x DP / (ETP x EP)). A KL reference model (algo.kl_loss_coef > 0) adds one more copy of
the params in the training dtype, never offloaded.

LoRA (``model.lora.rank`` r > 0): the base is frozen (its params in the training dtype, no gradient,
no optimizer state); the adapters, r x (in + out) values per targeted projection (attention only
on MoE layers), hold params, fp32 gradients and the optimizer state like any trained parameter.
Per rank they split like their layers (`models.lora`): column-parallel q/k/v, gate/up keep A whole
and B / TP, row-parallel o, down A / TP and B whole. The KL reference is then the policy with its
adapters off (no copy) unless an SFT warm start or MoE routes keep the copy
(`reference_is_adapters_off`).

Activations (bf16) follow Korthikanti et al. (2022), Table 2, with flash attention (no s^2 term)
and the FFN generalised to SwiGLU of size F as in Megatron-LM: per dense layer s*h*(18 + 4F/h)/t
bytes with sequence parallelism, s*h*(10 + (8 + 4F/h)/t) without (F = 4h gives the paper's 34/t
and 10 + 24/t). A MoE layer keeps k copies of each token around its experts: the expert inputs
and the expert outputs the router scores multiply (2 bytes x h each) and the experts' SwiGLU
(4F/h per copy), so its FFN term is 4k + 4kF/h instead of 4F/h. Full recomputation keeps only the
layer inputs (2*s*h/t under SP) plus one layer recomputed at a time. Under 1F1B the first
pipeline stage keeps PP micro-batches in flight, the last stage one micro-batch plus the output
layer: the final norm's output (2*s*h/t) and either the fused log-prob kernel's slices
(`parallel/linear.py`: two fp32 and one bf16 buffer of min(s, chunk) x V/t entries, the fp32
d-hidden accumulator 4*s*h and, under SP, the gathered hidden states 2*s*h) or, without it, the
fp32 logits and their gradient (2 x 4*s*V/t). With routing replay (or mismatch measurement) the
engine's routes of this rank's whole step (k per token and layer of its pipeline stage, uint8 up to
256 experts, else int16: `MicroBatch.routed_experts`, training/batches/route_share.py) sit on the device
during the old-log-prob pass, which takes all its micro-batches there at once (at full length: the
bound, not the typical step). Everything else (CUDA context, NCCL, allocator slack) is a fixed
overhead per process. With colocated tensor-mode weight sync, each node's leader serialises every
bucket for every server TP rank of its node from its own GPU, so every server worker on another GPU
of the node opens a CUDA context on the leader's GPU (`PEER_CONTEXT_BYTES` each, for the server's
lifetime): the plan adds them to that GPU, the busiest one (docs/multinode.md, "Colocated memory").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from hapo_megatron.training.batches.route_share import route_dtype

GiB = 1024**3
CONTEXT_BYTES = 1 * GiB  # CUDA context + NCCL buffers of one process (rough, deliberately round)
PEER_CONTEXT_BYTES = GiB // 2  # a CUDA context another process opens on this GPU (0.3-0.5 GiB; the upper end)
ACT_BYTES = 2  # activations in bf16 (the GPU dtype; the per-layer constants above are bf16 bytes)
HEADROOM = 0.95  # plan against 95% of the device (fragmentation)

__all__ = ["ModelShape", "MemoryPlan", "activation_bytes", "expert_param_count", "layer_activation_bytes",
           "lora_param_count", "reference_is_adapters_off",
           "output_layer_bytes", "param_count", "plan_memory", "plan_from_config", "format_plan",
           "shape_from_hf_config", "tensor_sync_peer_contexts"]


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm weights of one query and one key head per layer
    experts: int = 0  # MoE: experts per sparse layer, their FFN size, how many layers are sparse
    moe_intermediate: int = 0
    moe_layers: int = 0
    moe_topk: int = 0  # experts per token (num_experts_per_tok)


def expert_param_count(m: ModelShape) -> int:
    """Parameters of the MoE experts (SwiGLU, `moe_intermediate`) of every sparse layer."""
    return m.moe_layers * m.experts * 3 * m.hidden * m.moe_intermediate


LORA_SHAPES = {  # HF projection -> (Megatron parallel kind, MLP?)
    "q_proj": ("column", False), "k_proj": ("column", False), "v_proj": ("column", False), "o_proj": ("row", False),
    "gate_proj": ("column", True), "up_proj": ("column", True), "down_proj": ("row", True)}


def _projection_sides(m: ModelShape, target: str) -> tuple[int, int]:
    """(in, out) of one HF projection of a dense layer."""
    q, kv, h, f = m.heads * m.head_dim, m.kv_heads * m.head_dim, m.hidden, m.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}[target]


def lora_param_count(m: ModelShape, rank: int, targets, tp: int = 1) -> float:
    """LoRA adapter values of the whole model (``tp`` = 1) or held by one TP rank of ``tp`` (summed
    over the layers; divide by PP for a stage): r x (in + out) per targeted projection, the
    TP-split side divided by ``tp`` (module docstring). MoE layers carry attention adapters only."""
    total = 0.0
    for t in targets:
        kind, mlp = LORA_SHAPES[t]
        i, o = _projection_sides(m, t)
        per = rank * (i / tp + o) if kind == "row" else rank * (i + o / tp)
        total += per * ((m.layers - m.moe_layers) if mlp else m.layers)
    return total


def reference_is_adapters_off(cfg, moe_routing: bool) -> bool:
    """Whether a run's KL reference is its own policy with the LoRA adapters skipped (no second
    model): LoRA on, no SFT warm start (whose end state would be the reference), no MoE routing
    replay or measurement (``moe_routing``)."""
    return cfg.model.lora.rank > 0 and cfg.trainer.sft_warmup_steps == 0 and not moe_routing


def param_count(m: ModelShape) -> int:
    """Parameters of a Llama/Qwen decoder (embeddings, attention, SwiGLU MLP or MoE block: router
    + experts, RMSNorms)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    attn = m.hidden * (q + 2 * kv) + q * m.hidden + ((q + 2 * kv) if m.qkv_bias else 0)
    mlp = 3 * m.hidden * m.intermediate
    per_layer = attn + 2 * m.hidden + (2 * m.head_dim if m.qk_norm else 0)
    embed = m.vocab * m.hidden * (1 if m.tied_embeddings else 2)
    moe = m.moe_layers * m.experts * m.hidden + expert_param_count(m)
    return m.layers * per_layer + (m.layers - m.moe_layers) * mlp + moe + embed + m.hidden


@dataclass
class MemoryPlan:
    """Bytes per GPU. The three phases: training (static + activations), weight sync (static +
    the server's weights resumed), generation (server pool + whatever the trainer still holds)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    sglang_pool: int
    sglang_weights: int
    overhead: int
    device: int
    offload: bool
    reference: int = 0  # the KL reference model's params (algo.kl_loss_coef > 0)
    routes: int = 0  # the routing-replay tensors of this rank's step (part of `activations`)
    lora_params: int = 0  # the LoRA adapters' params (part of `params`; the rest is the frozen base)
    reference_adapters_off: bool = False  # a KL reference that is the policy with its adapters off (no copy)
    peer_contexts: int = 0  # server workers' CUDA contexts on the node leader's GPU (part of `overhead`)
    phases: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)

    @property
    def trainer_state(self) -> int:
        """What offloading moves to the host during generation."""
        return self.params + self.grads + self.optimizer

    @property
    def static(self) -> int:
        return self.trainer_state + self.reference

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        return not self.warnings


def layer_activation_bytes(shape: ModelShape, s: float, t: int, sequence_parallel: bool, moe: bool) -> float:
    """Bytes one layer keeps for its backward (module docstring): ``s`` tokens of this rank's
    micro-batch (after CP), TP size ``t``; a MoE layer's FFN term has its k token copies."""
    h = shape.hidden
    if moe:
        k = shape.moe_topk
        copies, ffn = 4 * k, 4 * k * shape.moe_intermediate / h
    else:
        copies, ffn = 0, 4 * shape.intermediate / h
    # not split by TP without SP: norm inputs 4, QKV and FFN inputs 2 + 2, dropout masks 2 (+ token copies)
    unsplit, split = 10 + copies, 8 + ffn  # split by TP: Q, K, V 6, attention output 2, the FFN
    if sequence_parallel and t > 1:
        return s * h * (unsplit + split) / t
    return s * h * (unsplit + split / t)


def output_layer_bytes(shape: ModelShape, s: float, t: int, sequence_parallel: bool, fused: bool,
                       logprob_chunk: int) -> float:
    """The last stage's output layer and loss on one micro-batch (module docstring)."""
    h, vt = shape.hidden, shape.vocab / t
    sp = sequence_parallel and t > 1
    final_norm = ACT_BYTES * s * h / (t if sp else 1)
    if not fused:
        return final_norm + 2 * 4 * s * vt
    slices = (2 * 4 + ACT_BYTES) * min(s, logprob_chunk) * vt
    return final_norm + slices + 4 * s * h + (ACT_BYTES * s * h if sp else 0)


def activation_bytes(shape: ModelShape, *, tokens: float, tp: int = 1, pp: int = 1, sequence_parallel: bool,
                     recompute: bool, fused_output_layer: bool,
                     logprob_chunk: int = 1024) -> float:
    """The activation peak of the busiest pipeline stage under 1F1B: the first stage with PP
    micro-batches in flight, or the last with one and the output layer (module docstring)."""
    t, sp = tp, sequence_parallel and tp > 1
    dense_layers = shape.layers - shape.moe_layers
    per_layer = [layer_activation_bytes(shape, tokens, t, sequence_parallel, moe)
                 for moe, n in ((False, dense_layers), (True, shape.moe_layers)) if n]
    mean_layer = (dense_layers * layer_activation_bytes(shape, tokens, t, sequence_parallel, False)
                  + shape.moe_layers * layer_activation_bytes(shape, tokens, t, sequence_parallel, True)) / shape.layers
    stage_layers = shape.layers / pp
    if recompute:  # inputs of every layer of the micro-batches in flight + one layer recomputed
        kept, working = stage_layers * ACT_BYTES * tokens * shape.hidden / (t if sp else 1), max(per_layer)
    else:
        kept, working = stage_layers * mean_layer, 0.0
    output = output_layer_bytes(shape, tokens, t, sequence_parallel, fused_output_layer, logprob_chunk)
    if pp == 1:
        return kept + working + output
    return max(pp * kept + working, kept + working + output)


def plan_memory(shape: ModelShape, *, tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 1, ep: int = 1,
                etp: Optional[int] = None, param_bytes: int = 2,
                distributed_optimizer: bool, sequence_parallel: bool, tokens_per_micro_batch: int,
                recompute: bool, sglang_fraction: float = 0.0, server_tp: int = 1, colocated: bool = False,
                offload: bool = False, device_bytes: int, fused_output_layer: bool,
                logprob_chunk: int = 1024, reference_model: bool = False, routed_tokens: int = 0,
                peer_contexts: int = 0, server_weight_bytes: Optional[int] = None, lora_rank: int = 0,
                lora_targets=(), reference_adapters_off: bool = False) -> MemoryPlan:
    """The per-GPU plan (see the module docstring for every formula). ``routed_tokens``: tokens of
    this rank's step whose engine routes go to the device (0: no routes travel);
    ``peer_contexts``: CUDA contexts of other processes on this GPU (`tensor_sync_peer_contexts`);
    ``server_weight_bytes``: one server's weights when not 2 bytes per parameter (FP8 servers:
    `fp8_memory`); ``lora_rank`` > 0: LoRA adapters on ``lora_targets`` (HF projection names), the
    rest frozen; ``reference_adapters_off``: a KL reference that costs nothing (the policy with its
    adapters off; ``reference_model`` is then False)."""
    etp = tp if etp is None else etp
    experts = expert_param_count(shape)
    dense_n, expert_n = (param_count(shape) - experts) / (tp * pp), experts / (ep * etp * pp)
    n = dense_n + expert_n
    shard = dp * cp if distributed_optimizer else 1
    expert_shard = max(tp * cp * dp / (etp * ep), 1.0) if distributed_optimizer else 1
    opt_bytes_per_param = 8 + (4 if param_bytes < 4 else 0)  # Adam moments (+ fp32 main params)
    acts = activation_bytes(shape, tokens=tokens_per_micro_batch / cp, tp=tp, pp=pp,
                            sequence_parallel=sequence_parallel, recompute=recompute,
                            fused_output_layer=fused_output_layer, logprob_chunk=logprob_chunk)
    # [b, s, stage layers * k] in the share-out's dtype (training/batches/route_share.py): this stage's layers only
    routes = (routed_tokens * math.ceil(shape.layers / pp) * shape.moe_topk
              * (route_dtype(shape.experts).itemsize if routed_tokens else 0))
    pool = int(sglang_fraction * device_bytes) if colocated else 0
    weight_bytes = param_count(shape) * 2 if server_weight_bytes is None else server_weight_bytes
    server_weights = int(weight_bytes / server_tp) if colocated else 0
    optimizer = dense_n * opt_bytes_per_param / shard + expert_n * opt_bytes_per_param / expert_shard
    lora_n = lora_param_count(shape, lora_rank, lora_targets, tp) / pp if lora_rank else 0.0
    trained = n
    if lora_rank:  # only the adapters train (and they are never expert weights)
        trained, optimizer = lora_n, lora_n * opt_bytes_per_param / shard
    plan = MemoryPlan(params=int((n + lora_n) * param_bytes), grads=int(trained * 4), optimizer=int(optimizer),
                      activations=int(acts) + routes, sglang_pool=pool, sglang_weights=server_weights,
                      overhead=CONTEXT_BYTES * (2 if colocated else 1) + peer_contexts * PEER_CONTEXT_BYTES,
                      device=int(device_bytes), offload=offload,
                      reference=int(n * param_bytes) if reference_model else 0, routes=routes,
                      lora_params=int(lora_n * param_bytes), reference_adapters_off=reference_adapters_off,
                      peer_contexts=peer_contexts * PEER_CONTEXT_BYTES)
    held_in_rollout = plan.overhead + plan.reference + (0 if offload else plan.trainer_state)
    plan.phases = {"training": plan.static + plan.activations + plan.overhead}
    if colocated:
        plan.phases["weight sync"] = plan.static + server_weights + plan.overhead
        plan.phases["generation"] = pool + held_in_rollout
    _add_warnings(plan, colocated)
    return plan


def _add_warnings(plan: MemoryPlan, colocated: bool) -> None:
    limit = HEADROOM * plan.device
    for phase, need in plan.phases.items():
        if need > limit:
            fix = {"training": "raise parallel.tensor/context_parallel_size, set model.recompute_activations=true or "
                               "lower parallel.max_tokens_per_micro_batch",
                   "weight sync": "raise parallel.tensor_model_parallel_size or rollout.sglang.server_tp_size",
                   "generation": "lower rollout.sglang.mem_fraction_static" +
                                 ("" if plan.offload else " or set model.offload_during_rollout=true")}[phase]
            plan.warnings.append(f"{phase} needs {need / GiB:.1f} GiB > {limit / GiB:.1f} GiB "
                                 f"({HEADROOM:.0%} of the device): {fix}")
    if colocated and plan.sglang_pool <= plan.sglang_weights:
        plan.warnings.append(f"rollout.sglang.mem_fraction_static leaves {plan.sglang_pool / GiB:.1f} GiB, not more "
                             f"than the server's weights ({plan.sglang_weights / GiB:.1f} GiB): no room for a KV cache")


def shape_from_hf_config(hf_config) -> ModelShape:
    # models/ and offload import torch; the planner itself stays torch-free for `hapo train`'s preflight
    from hapo_megatron.config.validate import ModelSpec
    from hapo_megatron.models.hf_config import (has_qk_norm, has_qkv_bias, head_dim_of, moe_layer_pattern,
                                                num_kv_heads_of)
    spec = ModelSpec.of(hf_config)
    moe = dict(experts=spec.num_experts, moe_intermediate=spec.moe_ffn, moe_layers=sum(moe_layer_pattern(hf_config)),
               moe_topk=spec.experts_per_token) if spec.is_moe else {}
    return ModelShape(**moe, hidden=int(hf_config.hidden_size), layers=int(hf_config.num_hidden_layers),
                      heads=int(hf_config.num_attention_heads), kv_heads=num_kv_heads_of(hf_config),
                      head_dim=head_dim_of(hf_config), intermediate=int(hf_config.intermediate_size),
                      vocab=int(hf_config.vocab_size),
                      tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                      qkv_bias=has_qkv_bias(hf_config), qk_norm=has_qk_norm(hf_config))


def tensor_sync_peer_contexts(cfg, gpus_per_node: int) -> int:
    """Server workers that open a CUDA context on a node leader's GPU: with colocated tensor-mode
    sync (`rollout/sglang/node_servers.py`) every server TP rank of the node maps the leader's buckets,
    all but the one on the leader's own GPU; 0 with disk / distributed sync or separate servers."""
    from hapo_megatron.rollout.sglang.engine import resolve_weight_sync
    sg = cfg.rollout.sglang
    if cfg.rollout.engine != "sglang" or not sg.colocate:
        return 0
    if resolve_weight_sync(sg.weight_sync, colocate=True) != "tensor":
        return 0
    per_node = gpus_per_node // sg.server_tp_size if not sg.num_servers else sg.num_servers
    workers = min(per_node * sg.server_tp_size, gpus_per_node)
    return max(workers - 1, 0)


def plan_from_config(cfg, hf_config, *, world_size: int, device_bytes: int, gpus_per_node: int = 8) -> MemoryPlan:
    """The plan of ``cfg`` on GPUs (its dtype, its offload choice) with ``world_size`` ranks on
    devices of ``device_bytes``, ``gpus_per_node`` of them per node (at most ``world_size``)."""
    from hapo_megatron.config.sections import lora_hf_targets
    from hapo_megatron.training.memory.fp8_weights import fp8_server_weight_bytes
    from hapo_megatron.training.memory.offload import offload_planned
    p, sg = cfg.parallel, cfg.rollout.sglang
    dp = world_size // p.model_parallel_size
    tokens = p.max_tokens_per_micro_batch or p.micro_batch_size * (cfg.data.max_prompt_length
                                                                    + cfg.rollout.max_response_length)
    colocated = cfg.rollout.engine == "sglang" and sg.colocate
    offload = offload_planned(cfg)
    shape = shape_from_hf_config(hf_config)
    routes_travel = shape.experts > 0 and (cfg.model.routing_replay or cfg.model.measure_routing_mismatch)
    # this rank's share of the step at full length: the old-log-prob pass takes it to the device at once
    step_tokens = cfg.data.train_batch_size * cfg.rollout.n * (cfg.data.max_prompt_length
                                                               + cfg.rollout.max_response_length)
    fp8 = cfg.rollout.engine == "sglang" and cfg.rollout.quantization == "fp8"
    kl, adapters_off = cfg.algo.loss.kl_loss_coef > 0, reference_is_adapters_off(cfg, routes_travel)
    return plan_memory(shape, tp=p.tensor_model_parallel_size,
                       pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size, dp=max(dp, 1),
                       ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
                       param_bytes={"bf16": 2, "fp16": 2}.get(cfg.model.dtype, 4),
                       distributed_optimizer=p.use_distributed_optimizer, sequence_parallel=p.sequence_parallel,
                       tokens_per_micro_batch=tokens, recompute=cfg.model.recompute_activations,
                       sglang_fraction=sg.mem_fraction_static, server_tp=sg.server_tp_size, colocated=colocated,
                       offload=offload, device_bytes=device_bytes, fused_output_layer=cfg.model.fused_output_layer,
                       reference_model=kl and not adapters_off, reference_adapters_off=kl and adapters_off,
                       lora_rank=cfg.model.lora.rank, lora_targets=lora_hf_targets(cfg.model.lora.target_modules),
                       routed_tokens=step_tokens // max(dp, 1) if routes_travel else 0,
                       peer_contexts=tensor_sync_peer_contexts(cfg, min(gpus_per_node, world_size)),
                       server_weight_bytes=fp8_server_weight_bytes(shape, param_count(shape)) if fp8 else None)


def format_plan(plan: MemoryPlan, title: Optional[str] = None) -> str:
    g = lambda b: f"{b / GiB:6.1f} GiB"  # noqa: E731
    lines = [title or "memory plan per GPU (estimate)",
             f"  trainer static  {g(plan.static)}  (params {g(plan.params).strip()}"
             + (f": frozen base {g(plan.params - plan.lora_params).strip()}, LoRA adapters "
                f"{g(plan.lora_params).strip()}" if plan.lora_params else "") + ", fp32 grads "
             f"{g(plan.grads).strip()}, optimizer {g(plan.optimizer).strip()}"
             + (f", KL reference {g(plan.reference).strip()}" if plan.reference else "")
             + (", KL reference: the policy with its adapters off, no copy" if plan.reference_adapters_off else "")
             + ")",
             f"  activations     {g(plan.activations)}  (busiest pipeline stage under 1F1B, estimate"
             + (f"; routes {g(plan.routes).strip()}" if plan.routes else "") + ")",
             f"  SGLang pool     {g(plan.sglang_pool)}  (mem_fraction_static x device; weights "
             f"{g(plan.sglang_weights).strip()})",
             f"  overhead        {g(plan.overhead)}  (CUDA context per process"
             + (f"; {plan.peer_contexts // PEER_CONTEXT_BYTES} server workers' contexts for the tensor sync"
                if plan.peer_contexts else "") + ")",
             f"  trainer state offloaded during generation: {'yes' if plan.offload else 'no'}"]
    for phase, need in plan.phases.items():
        lines.append(f"  {phase + ' peak':<16}{g(need)}  of {g(plan.device).strip()}")
    lines += [f"  WARNING: {w}" for w in plan.warnings] or ["  fits: yes"]
    return "\n".join(lines)
