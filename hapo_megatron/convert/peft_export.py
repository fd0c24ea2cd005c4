"""A LoRA model's adapters as a PEFT adapter directory (`hapo convert megatron-to-hf --lora-format peft`).

``adapter_model.safetensors`` holds, for every adapted HF projection of layer ``i``,
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`` ``[r, in]`` and
``.lora_B.weight`` ``[out, r]`` (the names `peft.PeftModel.save_pretrained` writes for a causal
LM, the adapter name left out); ``adapter_config.json`` a LORA config with ``r``, ``lora_alpha``
(peft's scaling ``lora_alpha / r`` is `models.lora`'s) and the target projections.
`peft.PeftModel.from_pretrained(base, dir)` then computes the trained policy.

The matrices are whole: a column-parallel layer's ``B`` (q/k/v, gate/up) is gathered over TP along
its output, a row-parallel layer's ``A`` (o, down) along its input; each TP rank's share of a
projection is a contiguous block of HF's rows (heads and FFN columns split in order), so the
gather is a concatenation in rank order.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from hapo_megatron.convert.model_io import gather_tp_along
from hapo_megatron.models.lora import lora_layers

ADAPTER_WEIGHTS, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
_OWNER = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}


def peft_state_dict(model_chunks, *, tp_group=None, pp_group=None) -> dict[str, torch.Tensor]:
    """Every adapter matrix of the model under its peft name, whole, on every rank (collective
    over TP and PP)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for block in chunk.modules():
            if not isinstance(block, TransformerLayer):
                continue
            for layer in lora_layers(block):
                prefix = f"base_model.model.model.layers.{block.layer_number - 1}.{_OWNER[layer.lora_role]}"
                for part in layer.lora.part_names:
                    for kind, mat in (("A", "a"), ("B", "b")):
                        name = f"{mat}_{part}"
                        out[f"{prefix}.{part}.lora_{kind}.weight"] = gather_tp_along(
                            getattr(layer.lora, name), layer.lora.tp_axis(name), tp_group).float().cpu()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        stages: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(stages, out, group=pp_group)
        out = {k: v for stage in stages for k, v in stage.items()}
    return out


def peft_config(settings, base_model_path: str) -> dict:
    """``adapter_config.json`` for `models.lora.LoraSettings` ``settings``."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path,
            "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
            "target_modules": sorted(settings.targets), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "inference_mode": True, "init_lora_weights": True,
            "modules_to_save": None}


def save_peft_adapter(state: dict[str, torch.Tensor], settings, out_dir: str, *, base_model_path: str,
                      dtype: torch.dtype) -> None:
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in sorted(state.items())},
              os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(settings, base_model_path), f, indent=2)
