"""Qwen3-MoE: Qwen3 attention (QK-norm) with sparse MoE blocks (a router and `num_experts` SwiGLU
experts of `moe_intermediate_size`) in the layers `moe_layer_pattern` marks, dense MLPs elsewhere.

HF names are the on-disk (safetensors) ones, one tensor per expert: `mlp.gate.weight [E, H]`,
`mlp.experts.{e}.{gate,up,down}_proj.weight`. transformers 5 fuses the experts in memory
(`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`) and converts on
save/load; `per_expert_state` / `fused_expert_state` do the same for live state dicts.
Megatron (local spec, SequentialMLP): `mlp.router.weight`, and per local expert j
`mlp.experts.local_experts.{j}.linear_fc1.weight` (gate and up fused like a dense fc1, split over
ETP) and `linear_fc2.weight` (row-parallel over ETP).
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

import torch

from hapo_megatron.convert.base import ParamMap
from hapo_megatron.convert.qwen3 import Qwen3Adapter
from hapo_megatron.models.hf_config import moe_layer_pattern

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Qwen3MoeAdapter(Qwen3Adapter):
    arch = "qwen3_moe"

    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.num_experts = int(hf_config.num_experts)
        self.moe_ffn = int(hf_config.moe_intermediate_size)
        self.sparse = moe_layer_pattern(hf_config)

    def experts_of(self, ep_rank: int, ep_size: int) -> list[int]:
        self.check_ep(ep_size, 1)
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank={ep_rank} must be in [0, ep_size={ep_size})")
        per = self.num_experts // ep_size
        return list(range(ep_rank * per, (ep_rank + 1) * per))

    def layer_maps(self, local: int, layer: int, experts: Sequence[int] | None = None) -> list[ParamMap]:
        maps = super().layer_maps(local, layer)
        if not self.sparse[layer]:
            return maps
        m, h = f"decoder.layers.{local}.mlp.", f"model.layers.{layer}.mlp."
        H, F = self.hidden, self.moe_ffn
        maps = [pm for pm in maps if ".mlp." not in pm.mcore]
        maps.append(ParamMap(m + "router.weight", (h + "gate.weight",), ((self.num_experts, H),), "replicated",
                             (1, layer, 5)))
        for j, e in enumerate(range(self.num_experts) if experts is None else experts):
            mm, hh = f"{m}experts.local_experts.{j}.", f"{h}experts.{e}."
            maps.append(ParamMap(mm + "linear_fc1.weight", (hh + "gate_proj.weight", hh + "up_proj.weight"),
                                 ((F, H), (F, H)), "fc1", (1, layer, 6, e, 0), expert=e))
            maps.append(ParamMap(mm + "linear_fc2.weight", (hh + "down_proj.weight",), ((H, F),), "row",
                                 (1, layer, 6, e, 1), expert=e))
        return maps


def per_expert_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A live transformers Qwen3-MoE state dict with its fused experts split per expert (the
    on-disk names the adapter uses); other tensors pass through. gate_up_proj `[E, 2I, H]` holds
    gate in rows [:I] and up in rows [I:] of each expert (as transformers' own conversion)."""
    out = {}
    for name, tensor in state.items():
        match = _FUSED.match(name)
        if not match:
            out[name] = tensor
            continue
        prefix, kind = match.groups()
        for e, w in enumerate(tensor.unbind(0)):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = w
            else:
                gate, up = w.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
    return out


def fused_expert_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `per_expert_state`: per-expert tensors stacked into transformers' in-memory
    `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` (for `load_state_dict` of a live model)."""
    out, experts = {}, {}
    for name, tensor in state.items():
        match = _PER_EXPERT.match(name)
        if not match:
            out[name] = tensor
            continue
        prefix, e, kind = match.groups()
        experts.setdefault(prefix, {}).setdefault(int(e), {})[kind] = tensor
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))) or any(len(by_expert[e]) != 3 for e in ids):
            raise ValueError(f"{prefix}: experts must be 0..E-1, each with gate/up/down_proj; got {ids}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
    return out
