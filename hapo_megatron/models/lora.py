"""LoRA adapters on Megatron-Core's tensor-parallel linear layers (``model.lora``; docs/lora.md).

A targeted layer computes ``y = W x + (alpha / r) * B A x`` with the base weight ``W`` frozen and
only ``A`` ``[r, in]`` and ``B`` ``[out, r]`` trained. Fused Megatron layers get one adapter per HF
projection, so the merged weight splits into HF's own ``W_p + (alpha / r) B_p A_p``:
``linear_qkv`` holds q, k, v (their rows interleaved per query group, as `convert.base` fuses
them), ``linear_fc1`` gate and up (``cat(gate_r, up_r)`` on TP rank r), ``linear_proj`` o and
``linear_fc2`` down.

Tensor parallelism (the same numbers as one rank, to float32 rounding):

- column-parallel (q/k/v, gate/up): ``A`` replicated, ``B`` sharded along its output like ``W``.
  ``h = A x`` enters the TP region like the base input (``copy_to``: its gradient is all-reduced,
  so every rank gets the whole ``dA``); under sequence parallelism ``h = A x_local`` is computed on
  the rank's tokens and all-gathered (``[s, b, r]``, small), its gradient reduce-scattered, and
  ``A``'s gradient (a partial sum over the sequence chunks) is all-reduced over TP by
  ``finalize_model_grads`` (the ``sequence_parallel`` attribute, like the norms' weights).
- row-parallel (o, down): ``A`` sharded along its input like ``W``, ``B`` replicated. The rank's
  partial ``A_r x_r`` is all-reduced (``[s, b, r]``; reduce-scattered under sequence parallelism,
  ``B``'s gradient then all-reduced by ``finalize_model_grads``). WHY not inside the base
  layer's own all-reduce (``W_r x_r + B A_r x_r`` reduced once): that would need the partial sum
  before Transformer Engine's reduction, which TE's layers do not expose; the extra collective
  carries ``r`` values per token against the base layer's ``hidden``.

The adapters are subclasses of the layer classes of the spec (`lora_decoder_spec`), so the base
parameters keep their names (conversion, checkpoints) and the adapters live under ``<layer>.lora``.
Dropout (``model.lora.dropout``) applies only in passes that compute gradients (never to the
log-prob passes) and draws from the default generator.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from hapo_megatron.config.sections import LORA_MODULE_PARTS, LoraConfig, lora_hf_targets

LORA_PREFIX = "lora."  # the adapters' parameter names inside a layer: <layer>.lora.a_<part> / b_<part>


@dataclass(frozen=True)
class LoraSettings:
    """What the layers need of ``model.lora`` (built by `lora_settings`; rank > 0)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    """HF projection names (q_proj ... down_proj)."""
    init: str

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def parts(self, role: str) -> tuple[str, ...]:
        """The targeted HF projections of Megatron layer ``role`` (linear_qkv, ...)."""
        return tuple(p for p in LORA_MODULE_PARTS[role] if p in self.targets)


def lora_settings(cfg: LoraConfig) -> Optional[LoraSettings]:
    """The settings of a ``model.lora`` section; None when LoRA is off (rank 0)."""
    if cfg.rank == 0:
        return None
    return LoraSettings(rank=cfg.rank, alpha=float(cfg.alpha), dropout=float(cfg.dropout),
                        targets=lora_hf_targets(cfg.target_modules), init=cfg.init)


def check_lora(cfg: LoraConfig, hf_config) -> None:
    """``model.lora`` against the model (at start, before any process group): a MoE model's
    expert layers as targets, a rank above a targeted layer's smaller side. ValueError naming the field."""
    if cfg.rank == 0:
        return
    from hapo_megatron.config.sections import LORA_MLP_TARGETS
    from hapo_megatron.config.validate import ModelSpec
    from hapo_megatron.models.hf_config import head_dim_of, num_kv_heads_of
    targets = lora_hf_targets(cfg.target_modules)
    if ModelSpec.of(hf_config).is_moe and set(targets) & set(LORA_MLP_TARGETS):
        raise ValueError(f"model.lora.target_modules: {', '.join(t for t in targets if t in LORA_MLP_TARGETS)} "
                         "would put adapters on MoE expert layers, which LoRA does not support yet; target the "
                         "attention only (q_proj, k_proj, v_proj, o_proj)")
    h, f, d = hf_config.hidden_size, hf_config.intermediate_size, head_dim_of(hf_config)
    q, kv = hf_config.num_attention_heads * d, num_kv_heads_of(hf_config) * d
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
    for t in targets:
        if cfg.rank > min(shapes[t]):
            raise ValueError(f"model.lora.rank={cfg.rank} exceeds the smaller side of {t} {shapes[t]}: at most "
                             f"{min(shapes[t])}")


# ------------------------------------------------------------------------------------ layouts
def _qkv_sizes(config, tp: int) -> dict[str, int]:
    d = config.kv_channels
    return {"q_proj": config.num_attention_heads * d // tp, "k_proj": config.num_query_groups * d // tp,
            "v_proj": config.num_query_groups * d // tp}


def part_out_sizes(role: str, config, tp: int) -> dict[str, int]:
    """This TP rank's output width of every HF projection of a column-parallel layer."""
    if role == "linear_qkv":
        return _qkv_sizes(config, tp)
    if role == "linear_fc1":
        return {"gate_proj": config.ffn_hidden_size // tp, "up_proj": config.ffn_hidden_size // tp}
    raise ValueError(f"{role} is not a column-parallel LoRA target")


def assemble(role: str, parts: dict[str, torch.Tensor], config, tp: int) -> torch.Tensor:
    """The fused layer's local output (last dim) from its projections' (q, k, v interleaved per
    query group, as `convert.base.ModelAdapter._fuse_qkv`; gate then up)."""
    if role == "linear_fc1":
        return torch.cat([parts["gate_proj"], parts["up_proj"]], dim=-1)
    groups = config.num_query_groups // tp
    lead = parts["q_proj"].shape[:-1]
    q, k, v = (parts[p].reshape(*lead, groups, -1) for p in ("q_proj", "k_proj", "v_proj"))
    return torch.cat([q, k, v], dim=-1).reshape(*lead, -1)


def _init_a(a_full: torch.Tensor, init: str, rank: int) -> None:
    """peft's ``init_lora_weights``: kaiming-uniform (a = sqrt(5), nn.Linear's) or N(0, 1/r)."""
    if init == "gaussian":
        torch.nn.init.normal_(a_full, std=1.0 / rank)
    else:
        torch.nn.init.kaiming_uniform_(a_full, a=math.sqrt(5))


class LoraAdapter(torch.nn.Module):
    """The low-rank update of one tensor-parallel linear layer (see the module docstring).

    Parameters ``a_<part>`` ``[r, in_local]`` and ``b_<part>`` ``[out_local, r]`` for each targeted
    HF projection. ``A`` is drawn whole from the default CPU generator (the same on every TP rank,
    as Megatron's CPU initialisation) and sliced, ``B`` starts at zero: the model starts as the base.
    """

    def __init__(self, settings: LoraSettings, *, role: str, parallel: str, config, in_full: int,
                 out_full: int, tp_group, tp_rank: int, tp_size: int, device):
        super().__init__()
        self.settings, self.role, self.parallel, self.config = settings, role, parallel, config
        self.tp_group, self.tp_rank, self.tp_size = tp_group, tp_rank, tp_size
        self.sequence_parallel = bool(config.sequence_parallel) and tp_size > 1
        self.enabled = True
        self.part_names = settings.parts(role)
        r, dtype = settings.rank, config.params_dtype
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        for part in self.part_names:
            a_full = torch.empty(r, in_full, dtype=torch.float32)
            _init_a(a_full, settings.init, r)
            if parallel == "row":
                a = a_full.chunk(tp_size, dim=1)[tp_rank]
                b = torch.zeros(out_full, r)
            else:
                a = a_full
                b = torch.zeros(part_out_sizes(role, config, tp_size)[part], r)
            a = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            b = torch.nn.Parameter(b.to(device=device, dtype=dtype))
            sharded, replicated = (a, b) if parallel == "row" else (b, a)
            set_tensor_model_parallel_attributes(sharded, True, 1 if parallel == "row" else 0, 1)
            if self.sequence_parallel:  # its gradient sums over the sequence chunks: TP all-reduce
                replicated.sequence_parallel = True
            self.register_parameter(f"a_{part}", a)
            self.register_parameter(f"b_{part}", b)

    def tp_axis(self, name: str) -> Optional[int]:
        """The dimension along which parameter ``name`` (a_q_proj, ...) is split over TP; None: replicated."""
        if self.parallel == "row":
            return 1 if name.startswith("a_") else None
        return 0 if name.startswith("b_") else None

    def _a(self, part: str) -> torch.nn.Parameter:
        return getattr(self, f"a_{part}")

    def _b(self, part: str) -> torch.nn.Parameter:
        return getattr(self, f"b_{part}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The scaled update of the layer's output for its input ``x`` (the base layer's, normed
        for layers with a fused norm): ``[s, b, out/tp]`` column-parallel, the base output's
        shape row-parallel."""
        from megatron.core.tensor_parallel import mappings as m
        if self.settings.dropout and self.training and torch.is_grad_enabled():
            x = F.dropout(x, p=self.settings.dropout)
        a = torch.cat([self._a(p) for p in self.part_names])  # [parts * r, in_local]
        h = torch.matmul(x, a.t().to(x.dtype))
        g = self.tp_group if self.tp_size > 1 else None
        if self.parallel == "row":
            if g is not None:
                h = (m.reduce_scatter_to_sequence_parallel_region(h, group=g) if self.sequence_parallel
                     else m.reduce_from_tensor_model_parallel_region(h, group=g))
            return torch.matmul(h, self._b(self.part_names[0]).t().to(h.dtype)) * self.settings.scaling
        if g is not None:
            h = (m.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=g)
                 if self.sequence_parallel else m.copy_to_tensor_model_parallel_region(h, group=g))
        outs = {p: torch.matmul(hp, self._b(p).t().to(hp.dtype))
                for p, hp in zip(self.part_names, h.split(self.settings.rank, dim=-1))}
        return self._fused(outs, h) * self.settings.scaling

    def _fused(self, outs: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        if self.role not in ("linear_qkv", "linear_fc1"):
            return outs[self.part_names[0]]
        sizes = part_out_sizes(self.role, self.config, self.tp_size)
        full = {p: outs[p] if p in outs else like.new_zeros(*like.shape[:-1], n) for p, n in sizes.items()}
        return assemble(self.role, full, self.config, self.tp_size)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """This rank's ``(alpha / r) B A`` in the base weight's local layout ``[out_local, in_local]``
        (float32; the merged weight of the export)."""
        s = self.settings.scaling
        if self.parallel == "row":
            p = self.part_names[0]
            return self._b(p).float() @ self._a(p).float() * s
        sizes = part_out_sizes(self.role, self.config, self.tp_size)
        in_size = self._a(self.part_names[0]).shape[1]
        rows = {p: (self._b(p).float() @ self._a(p).float()) if p in self.part_names
                else torch.zeros(n, in_size, device=self._a(self.part_names[0]).device) for p, n in sizes.items()}
        if self.role not in ("linear_qkv", "linear_fc1"):
            return rows[self.part_names[0]] * s
        return assemble(self.role, {p: t.t() for p, t in rows.items()}, self.config, self.tp_size).t() * s


# ------------------------------------------------------------------------------ the layer classes
def _normed_input(layer, x: torch.Tensor) -> torch.Tensor:
    """The input of a Transformer Engine layer with a fused norm after that norm (its own weight,
    eps and kind), for the adapter: TE does not hand out the normed input it computes."""
    w = layer.layer_norm_weight
    w = w + 1 if getattr(layer, "zero_centered_gamma", False) else w
    if getattr(layer, "normalization", "RMSNorm") == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), w, getattr(layer, "layer_norm_bias", None), layer.eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + layer.eps)).to(x.dtype) * w


class _LoraLayer:
    """Mixin over a tensor-parallel linear class: the base forward plus ``self.lora(x)``."""

    lora_settings: LoraSettings
    lora_role: str
    lora_parallel: str
    lora_fused_norm: bool = False

    def _add_lora(self, input_size: int, output_size: int, config, tp_group) -> None:
        from megatron.core.utils import get_pg_rank, get_pg_size, get_tensor_model_parallel_group_if_none
        tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        device = next(p for p in self.parameters() if p is not None).device
        self.lora = LoraAdapter(self.lora_settings, role=self.lora_role, parallel=self.lora_parallel, config=config,
                                in_full=input_size, out_full=output_size, tp_group=tp_group,
                                tp_rank=get_pg_rank(tp_group), tp_size=get_pg_size(tp_group), device=device)

    def forward(self, x, *args, **kwargs):
        out, bias = super().forward(x, *args, **kwargs)
        if not self.lora.enabled:
            return out, bias
        return out + self.lora(_normed_input(self, x) if self.lora_fused_norm else x).to(out.dtype), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base layer's, with the TP-sharded adapter matrices sharded along their split dim."""
        from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name, p in self.lora.named_parameters():
            axis = self.lora.tp_axis(name)
            if axis is not None:
                key = f"{prefix}{LORA_PREFIX}{name}"
                out[key] = make_tp_sharded_tensor_for_checkpoint(p, key, axis, prepend_offsets=sharded_offsets,
                                                                 tp_group=self.lora.tp_group,
                                                                 dp_cp_group=(metadata or {}).get("dp_cp_group"))
        return out


def _lora_class(base: type, settings: LoraSettings, role: str) -> type:
    parallel = "row" if role in ("linear_proj", "linear_fc2") else "column"
    fused_norm = "LayerNorm" in base.__name__

    def __init__(self, input_size, output_size, *args, **kwargs):
        base.__init__(self, input_size, output_size, *args, **kwargs)
        self._add_lora(input_size, output_size, kwargs["config"], kwargs.get("tp_group"))

    return type(f"Lora{base.__name__}", (_LoraLayer, base),
                {"__init__": __init__, "lora_settings": settings, "lora_role": role, "lora_parallel": parallel,
                 "lora_fused_norm": fused_norm})


def _with_lora_layer(layer_spec, settings: LoraSettings):
    """A copy of one TransformerLayer spec whose targeted linear layers carry adapters."""
    spec = copy.copy(layer_spec)
    spec.submodules = copy.copy(spec.submodules)
    for owner, roles in (("self_attention", ("linear_qkv", "linear_proj")), ("mlp", ("linear_fc1", "linear_fc2"))):
        block = copy.copy(getattr(spec.submodules, owner))
        subs = copy.copy(getattr(block, "submodules", None))
        if subs is None or not any(hasattr(subs, r) for r in roles):
            continue  # a MoE layer's experts: refused by `check_lora` before any model is built
        for role in roles:
            if settings.parts(role):
                setattr(subs, role, _lora_class(getattr(subs, role), settings, role))
        block.submodules = subs
        setattr(spec.submodules, owner, block)
    return spec


def lora_decoder_spec(spec, settings: Optional[LoraSettings]):
    """``spec`` (a TransformerLayer spec or a block spec's) with adapters on the targeted layers;
    ``spec`` itself when LoRA is off."""
    if settings is None:
        return spec
    if hasattr(spec, "layer_specs"):
        spec = copy.copy(spec)
        spec.layer_specs = [_with_lora_layer(s, settings) for s in spec.layer_specs]
        return spec
    return _with_lora_layer(spec, settings)


# --------------------------------------------------------------------------- using a LoRA model
def lora_layers(model) -> Iterator[torch.nn.Module]:
    """Every layer with an adapter in ``model`` (a chunk or a list of chunks, wrapped or not)."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        for mod in chunk.modules():
            if isinstance(mod, _LoraLayer):
                yield mod


def is_lora_param(name: str) -> bool:
    return f".{LORA_PREFIX}" in f".{name}"


def freeze_base(model) -> int:
    """``requires_grad=False`` on every parameter but the adapters' (before DDP and the optimizer
    are built: neither then holds anything of them); returns the number of trainable values."""
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_param(name))
        n += p.numel() if p.requires_grad else 0
    return n


@contextlib.contextmanager
def adapters_disabled(model):
    """Inside, every adapter of ``model`` is skipped: the layers compute exactly the base model
    (the KL reference without a second copy of the model)."""
    layers = list(lora_layers(model))
    before = [layer.lora.enabled for layer in layers]
    for layer in layers:
        layer.lora.enabled = False
    try:
        yield
    finally:
        for layer, was in zip(layers, before):
            layer.lora.enabled = was


def merged_weights(model) -> dict[int, LoraAdapter]:
    """``id(layer.weight) -> adapter`` of every adapted layer: what the export merges
    (`convert.model_io.export_hf_weights`)."""
    return {id(layer.weight): layer.lora for layer in lora_layers(model)}
