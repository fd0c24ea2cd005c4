"""Megatron dist_checkpointing (torch_dist) checkpoints of model weights.

Layout of `<path>`: the dist_checkpointing files (written by every rank; they reshard to any
TP/PP on load), plus `hf/` (the HF config and tokenizer files, so `megatron-to-hf` and the
trainer know the architecture) and `hapo_model.json` (how it was written). The state dict key
is "model" for one model chunk and "model0", "model1", ... for virtual-pipeline chunks, as in
Megatron-LM.
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from hapo_megatron.convert.hf_io import copy_tokenizer_files
from hapo_megatron.convert.model_io import _as_chunks
from hapo_megatron.compat.processes import children_allowed

META_NAME = "hapo_model.json"
HF_SUBDIR = "hf"


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sharded_state_dict(chunks: list) -> dict:
    if len(chunks) == 1:
        return {"model": chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}


def save_megatron_checkpoint(model_chunks, path: str, *, hf_config=None, tokenizer_src: str | None = None,
                             meta: dict | None = None) -> None:
    """Save the model weights of every rank to `path` (collective: every rank calls it).

    `hf_config` and the tokenizer files of `tokenizer_src` are stored under `path/hf/`; `meta`
    (e.g. tp, pp, dtype) in `path/hapo_model.json`.
    """
    from megatron.core import dist_checkpointing

    chunks = _as_chunks(model_chunks)
    if _is_rank0():
        os.makedirs(path, exist_ok=True)
    _barrier()
    with children_allowed():
        dist_checkpointing.save(_sharded_state_dict(chunks), path)
    if _is_rank0():
        if hf_config is not None:
            os.makedirs(os.path.join(path, HF_SUBDIR), exist_ok=True)
            hf_config.save_pretrained(os.path.join(path, HF_SUBDIR))
            copy_tokenizer_files(tokenizer_src, os.path.join(path, HF_SUBDIR))
        with open(os.path.join(path, META_NAME), "w") as f:
            json.dump({"format": "torch_dist", **(meta or {})}, f, indent=2, default=str)
    _barrier()


def load_megatron_checkpoint(model_chunks, path: str, *, strict: bool = True) -> None:
    """Load weights saved by `save_megatron_checkpoint` into this rank's chunks (any TP/PP)."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path):
        raise ValueError(f"megatron_path: {path!r} is not a directory")
    chunks = _as_chunks(model_chunks)
    state = dist_checkpointing.load(_sharded_state_dict(chunks), path)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for key, chunk in zip(keys, chunks):
        chunk.load_state_dict(state[key], strict=strict)


def read_hf_config(megatron_path: str):
    """The HF config stored with a Megatron checkpoint (`path/hf/config.json`)."""
    from transformers import AutoConfig

    hf_dir = os.path.join(megatron_path, HF_SUBDIR)
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ValueError(f"megatron_path: no HF config in {hf_dir!r}; pass --hf-config-path")
    return AutoConfig.from_pretrained(hf_dir)


def load_lora_adapters(model, path: str) -> None:
    """Load the adapters of a LoRA training checkpoint's ``model/`` directory into ``model`` (one
    chunk built with the same `models.lora.LoraSettings`; its base weights loaded already): the
    checkpoint holds the adapters only (`models.lora_checkpoint`)."""
    from megatron.core import dist_checkpointing

    from hapo_megatron.models.lora import is_lora_param
    wanted = {k: v for k, v in model.sharded_state_dict().items() if is_lora_param(k)}
    state = dist_checkpointing.load({"model": wanted}, path)["model"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    lost = [k for k in missing if is_lora_param(k)]
    if lost or unexpected:
        raise ValueError(f"megatron_path: the LoRA checkpoint {path!r} lacks adapters {lost[:3]} "
                         f"(unexpected: {list(unexpected)[:3]})")
