"""Per-GPU memory plan of a run: trainer static state + SGLang pool + activation estimate against
the device's memory, for each phase of a step. Pure arithmetic (tested with hand-computed cases);
`plan_from_config` reads the numbers from a `HapoConfig` and the model's HF config.

Bytes per parameter follow Megatron's mixed precision with the distributed optimizer: model
params in the training dtype, fp32 gradient buffers (grad_reduce_in_fp32), and fp32 main params
+ two fp32 Adam moments sharded over the DP x CP ranks. MoE expert weights are split over
EP x ETP (not TP) and their optimizer state over the expert-data-parallel ranks
(TP x CP x DP / (ETP x EP)); the activation estimate stays the dense one. Activations follow Korthikanti et al.
(2022) with flash attention (no s^2 term): per layer s*h*34/t bytes with sequence parallelism,
s*h*(10 + 24/t) without, only the layer inputs (2*s*h/t) kept with full recomputation, plus
fp32 logits and their gradient (2 x 4*s*V/t). Everything else (CUDA context, NCCL, allocator
slack) is a fixed overhead per process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

GiB = 1024**3
CONTEXT_BYTES = 1 * GiB  # CUDA context + NCCL buffers of one process (rough, deliberately round)
HEADROOM = 0.95  # plan against 95% of the device (fragmentation)

__all__ = ["ModelShape", "MemoryPlan", "expert_param_count", "param_count", "plan_memory", "plan_from_config",
           "format_plan", "shape_from_hf_config"]


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


def expert_param_count(m: ModelShape) -> int:
    """Parameters of the MoE experts (SwiGLU, `moe_intermediate`) of every sparse layer."""
    return m.moe_layers * m.experts * 3 * m.hidden * m.moe_intermediate


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
    phases: dict = field(default_factory=dict)
    warnings: list = field(default_factory=list)

    @property
    def static(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        return not self.warnings


def plan_memory(shape: ModelShape, *, tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 1, ep: int = 1,
                etp: Optional[int] = None, param_bytes: int = 2,
                distributed_optimizer: bool = True, sequence_parallel: bool = False, tokens_per_micro_batch: int,
                recompute: bool = False, sglang_fraction: float = 0.0, server_tp: int = 1, colocated: bool = False,
                offload: bool = False, device_bytes: int, server_weight_bytes: Optional[int] = None) -> MemoryPlan:
    """The per-GPU plan (see the module docstring for every formula). ``server_weight_bytes``: one
    server's weights when not 2 bytes per parameter (FP8 servers: `fp8_memory`)."""
    etp = tp if etp is None else etp
    experts = expert_param_count(shape)
    dense_n, expert_n = (param_count(shape) - experts) / (tp * pp), experts / (ep * etp * pp)
    n = dense_n + expert_n
    shard = dp * cp if distributed_optimizer else 1
    expert_shard = max(tp * cp * dp / (etp * ep), 1.0) if distributed_optimizer else 1
    opt_bytes_per_param = 8 + (4 if param_bytes < 4 else 0)  # Adam moments (+ fp32 main params)
    s, h, t = tokens_per_micro_batch / cp, shape.hidden, tp
    layers = shape.layers / pp
    sp_div = t if sequence_parallel and t > 1 else 1
    per_layer = s * h * 34 / t if sp_div > 1 else s * h * (10 + 24 / t)
    acts = layers * 2 * s * h / sp_div + per_layer if recompute else layers * per_layer
    acts += 2 * 4 * s * shape.vocab / t
    pool = int(sglang_fraction * device_bytes) if colocated else 0
    weight_bytes = param_count(shape) * 2 if server_weight_bytes is None else server_weight_bytes
    server_weights = int(weight_bytes / server_tp) if colocated else 0
    optimizer = dense_n * opt_bytes_per_param / shard + expert_n * opt_bytes_per_param / expert_shard
    plan = MemoryPlan(params=int(n * param_bytes), grads=int(n * 4), optimizer=int(optimizer),
                      activations=int(acts), sglang_pool=pool, sglang_weights=server_weights,
                      overhead=CONTEXT_BYTES * (2 if colocated else 1), device=int(device_bytes), offload=offload)
    held_in_rollout = plan.overhead + (0 if offload else plan.static)
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
    from hapo_megatron.models.hf_config import (has_qk_norm, has_qkv_bias, head_dim_of, is_moe, moe_layer_pattern,
                                                num_kv_heads_of)
    moe = dict(experts=int(hf_config.num_experts), moe_intermediate=int(hf_config.moe_intermediate_size),
               moe_layers=sum(moe_layer_pattern(hf_config))) if is_moe(hf_config) else {}
    return ModelShape(**moe,hidden=int(hf_config.hidden_size), layers=int(hf_config.num_hidden_layers),
                      heads=int(hf_config.num_attention_heads), kv_heads=num_kv_heads_of(hf_config),
                      head_dim=head_dim_of(hf_config), intermediate=int(hf_config.intermediate_size),
                      vocab=int(hf_config.vocab_size),
                      tied_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                      qkv_bias=has_qkv_bias(hf_config), qk_norm=has_qk_norm(hf_config))


def plan_from_config(cfg, hf_config, *, world_size: int, device_bytes: int) -> MemoryPlan:
    """The plan of ``cfg`` on GPUs (its dtype, its offload choice) with ``world_size`` ranks on
    devices of ``device_bytes``."""
    from hapo_megatron.training.fp8_memory import fp8_server_weight_bytes
    from hapo_megatron.training.offload import offload_planned
    p, sg = cfg.parallel, cfg.rollout.sglang
    dp = world_size // p.model_parallel_size
    tokens = p.max_tokens_per_micro_batch or p.micro_batch_size * (cfg.data.max_prompt_length
                                                                    + cfg.rollout.max_response_length)
    colocated = cfg.rollout.engine == "sglang" and sg.colocate
    offload = offload_planned(cfg)
    shape = shape_from_hf_config(hf_config)
    fp8 = cfg.rollout.engine == "sglang" and cfg.rollout.quantization == "fp8"
    return plan_memory(shape, tp=p.tensor_model_parallel_size,
                       pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size, dp=max(dp, 1),
                       ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
                       param_bytes={"bf16": 2, "fp16": 2}.get(cfg.model.dtype, 4),
                       distributed_optimizer=p.use_distributed_optimizer, sequence_parallel=p.sequence_parallel,
                       tokens_per_micro_batch=tokens, recompute=cfg.model.recompute_activations,
                       sglang_fraction=sg.mem_fraction_static, server_tp=sg.server_tp_size, colocated=colocated,
                       offload=offload, device_bytes=device_bytes,
                       server_weight_bytes=fp8_server_weight_bytes(shape, param_count(shape)) if fp8 else None)


def format_plan(plan: MemoryPlan, title: Optional[str] = None) -> str:
    g = lambda b: f"{b / GiB:6.1f} GiB"  # noqa: E731
    lines = [title or "memory plan per GPU (estimate)",
             f"  trainer static  {g(plan.static)}  (params {g(plan.params).strip()}, fp32 grads "
             f"{g(plan.grads).strip()}, optimizer {g(plan.optimizer).strip()})",
             f"  activations     {g(plan.activations)}  (one micro-batch, estimate)",
             f"  SGLang pool     {g(plan.sglang_pool)}  (mem_fraction_static x device; weights "
             f"{g(plan.sglang_weights).strip()})",
             f"  overhead        {g(plan.overhead)}  (CUDA context per process)",
             f"  trainer state offloaded during generation: {'yes' if plan.offload else 'no'}"]
    for phase, need in plan.phases.items():
        lines.append(f"  {phase + ' peak':<16}{g(need)}  of {g(plan.device).strip()}")
    lines += [f"  WARNING: {w}" for w in plan.warnings] or ["  fits: yes"]
    return "\n".join(lines)
