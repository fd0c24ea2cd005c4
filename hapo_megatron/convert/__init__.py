"""HF <-> Megatron-Core conversion for Llama, Qwen2, Qwen3 and Qwen3-MoE (one adapter module per family).

Pure state-dict adapters (no process groups):
- `get_adapter(hf_config) -> ModelAdapter`
- `hf_to_mcore(hf_state, config, tp_rank, tp_size, pp_rank, pp_size, *, make_vocab_size_divisible_by=128)`
- `mcore_to_hf(shards, config)`: shards = one gathered state dict, {(tp_rank, pp_rank): state}
  or nested lists shards[pp_rank][tp_rank]
Live models and process groups:
- `load_hf_weights_into_mcore(model, hf_model_path_or_state, hf_config, *, tp_rank, tp_size, ...)`
- `export_hf_weights(model_chunks, hf_config, *, tp_group=None, pp_group=None, dtype=None)`:
  streaming `(hf_name, tensor)` generator for the weight sync and the HF export.
Files:
- `save_hf_checkpoint(named_tensors, out_dir, hf_config, ...)`, `load_hf_state_dict(path)`,
  `HFCheckpointReader(path)` (sharded safetensors + model.safetensors.index.json)
- `save_megatron_checkpoint(model_chunks, path, ...)`, `load_megatron_checkpoint(model_chunks, path)`
  (dist_checkpointing torch_dist)
Megatron-side names are the local layer spec ones; Transformer Engine's fused-norm names are
resolved on live models (`TE_ALIASES`).
"""

from __future__ import annotations

from typing import Mapping

import torch

from hapo_megatron.convert.adapters import ADAPTERS, get_adapter
from hapo_megatron.convert.base import TE_ALIASES, ModelAdapter, ParamMap, check_hf_state
from hapo_megatron.convert.hf_io import (
    HFCheckpointReader,
    copy_tokenizer_files,
    load_hf_state_dict,
    prepare_output_dir,
    save_hf_checkpoint,
)
from hapo_megatron.convert.qwen3_moe import fused_expert_state, per_expert_state
from hapo_megatron.convert.megatron_ckpt import load_megatron_checkpoint, read_hf_config, save_megatron_checkpoint
from hapo_megatron.convert.model_io import (
    export_hf_weights,
    gather_hf_state_dict,
    load_hf_weights_into_mcore,
    unwrap_model,
)
from hapo_megatron.models.gpt import DEFAULT_VOCAB_DIVISIBLE_BY, padded_vocab_size


def hf_to_mcore(hf_state: Mapping[str, torch.Tensor], config, tp_rank: int, tp_size: int, pp_rank: int,
                pp_size: int, *, make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
                ep_rank: int = 0, ep_size: int = 1, etp_rank: int | None = None,
                etp_size: int | None = None) -> dict:
    """Megatron state dict (local spec names, stage-local layer indices) of one (TP, PP) rank.

    `config` is the HF config; layers are split evenly over `pp_size` stages; the vocab is padded
    like `build_gpt_model` does (`padded_vocab_size`). MoE models: the experts of expert-parallel
    rank `ep_rank` of `ep_size`, each expert's FFN split over ETP (`etp_rank`/`etp_size`, None:
    TP's). HF expert tensors are per expert (the on-disk names; see `convert/qwen3_moe.py`).
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    if etp_size is not None and not 0 <= (etp_rank if etp_rank is not None else -1) < etp_size:
        raise ValueError(f"etp_rank={etp_rank} must be in [0, etp_size={etp_size})")
    padded = padded_vocab_size(config.vocab_size, tp_size, make_vocab_size_divisible_by)
    return get_adapter(config).hf_to_mcore(hf_state, tp_rank, tp_size, pp_rank, pp_size, padded, ep_rank=ep_rank,
                                           ep_size=ep_size, etp_rank=etp_rank, etp_size=etp_size)


def mcore_to_hf(shards, config) -> dict[str, torch.Tensor]:
    """HF state dict (HF order) from Megatron shards with stage-local layer indices.

    `shards`: one gathered state dict (TP1/PP1 layout), a mapping {(tp_rank, pp_rank): state}
    (with experts {(tp_rank, pp_rank, ep_rank, etp_rank): state}), or nested lists
    `shards[pp_rank][tp_rank]`.
    """
    if isinstance(shards, (list, tuple)):
        shards = {(t, p): s for p, row in enumerate(shards) for t, s in enumerate(row)}
    if isinstance(shards, Mapping) and shards and all(isinstance(k, str) for k in shards):
        shards = {(0, 0): shards}
    if not isinstance(shards, Mapping) or not shards:
        raise ValueError("shards must be a state dict, {(tp_rank, pp_rank): state} or [pp_rank][tp_rank] lists")
    return get_adapter(config).mcore_to_hf(shards)


__all__ = [
    "ADAPTERS", "HFCheckpointReader", "ModelAdapter", "ParamMap", "TE_ALIASES", "check_hf_state",
    "copy_tokenizer_files", "export_hf_weights", "fused_expert_state", "per_expert_state", "gather_hf_state_dict",
    "get_adapter", "hf_to_mcore",
    "load_hf_state_dict", "load_hf_weights_into_mcore", "load_megatron_checkpoint", "mcore_to_hf",
    "prepare_output_dir", "read_hf_config", "save_hf_checkpoint", "save_megatron_checkpoint", "unwrap_model",
]
