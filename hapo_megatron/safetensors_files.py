"""Which safetensors file of a Hugging Face model directory holds each tensor: the one home of the
index / single-file lookup (`convert.hf_io.HFCheckpointReader` reads tensors through it,
`models.lora_checkpoint` hashes a LoRA run's base with it)."""

from __future__ import annotations

import json
import os

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def tensor_files(path: str, *, field: str = "hf_model_path", why: str = "only safetensors checkpoints are "
                 "supported") -> dict[str, str]:
    """name -> safetensors file (relative to ``path``), from ``model.safetensors.index.json`` or
    the keys of ``model.safetensors``. A directory with neither is a one-line ValueError naming
    ``field`` and ``why``."""
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    single = os.path.join(path, SINGLE_NAME)
    if not os.path.isfile(single):
        raise ValueError(f"{field}: no {INDEX_NAME} or {SINGLE_NAME} in {path!r} ({why})")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: SINGLE_NAME for k in f.keys()}


__all__ = ["INDEX_NAME", "SINGLE_NAME", "tensor_files"]
