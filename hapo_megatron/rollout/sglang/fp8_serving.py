"""What an FP8 rollout server needs before it starts (docs/fp8.md): the settings it can run
with, and the block-FP8 checkpoint it loads at launch (later weight syncs overwrite it)."""

from __future__ import annotations

import json
import os
import shutil

from hapo_megatron.config.base import KV_CACHE_DTYPES, ROLLOUT_QUANTIZATIONS
from hapo_megatron.config.validate import CPU_FP8_REFUSED, check_fp8_launch
from hapo_megatron.rollout.fp8_weights import write_fp8_checkpoint

#: SGLang 0.5.23 model classes whose loaders drop block-FP8 scales: LlamaForCausalLM renames every
#: ``.weight_scale_inv`` to ``.weight_scale`` (models/llama.py, both loaders), a parameter block-FP8
#: layers do not have, so the scales would stay at their placeholder (docs/fp8.md, "Which models")
FP8_UNSUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "SGLang 0.5.23's Llama loader renames weight_scale_inv to "
                                                     "weight_scale and drops block-FP8 scales"}


def check_choices(quantization: str, kv_cache_dtype: str) -> None:
    """ValueError naming an unknown ``quantization`` / ``kv_cache_dtype``."""
    if quantization not in ROLLOUT_QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {ROLLOUT_QUANTIZATIONS}, got {quantization!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def check_launch(quantization: str, *, device: str, dtype) -> None:
    """ValueError when servers cannot be launched with ``quantization`` on ``device`` in ``dtype``
    (`config.validate.check_fp8_launch`, which `validate_run` runs before any process group)."""
    check_fp8_launch(quantization, device=device, dtype=dtype)


def check_architecture(model_dir: str) -> None:
    """ValueError when SGLang cannot serve ``model_dir``'s architecture in block FP8
    (:data:`FP8_UNSUPPORTED_ARCHITECTURES`)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        archs = json.load(f).get("architectures") or []
    for arch in archs:
        if arch in FP8_UNSUPPORTED_ARCHITECTURES:
            raise ValueError(f"rollout.quantization='fp8' cannot serve {arch}: {FP8_UNSUPPORTED_ARCHITECTURES[arch]} "
                             "(docs/fp8.md, \"Which models\"); use rollout.quantization=none")


def serving_model_path(model_path: str, quantization: str, work_dir: str, *, tp_size: int = 1) -> str:
    """The directory servers start from: ``model_path`` itself, or with FP8 its block-FP8 copy
    written to ``work_dir/fp8_model`` (replaced if present) after :func:`check_architecture`."""
    if quantization == "none":
        return model_path
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"rollout.quantization='fp8' quantises the model's safetensors: {model_path!r} must be "
                         "a local model directory")
    check_architecture(model_path)
    out = os.path.join(work_dir, "fp8_model")
    shutil.rmtree(out, ignore_errors=True)
    return write_fp8_checkpoint(model_path, out, tp_size=tp_size)


__all__ = ["CPU_FP8_REFUSED", "FP8_UNSUPPORTED_ARCHITECTURES", "check_architecture", "check_choices", "check_launch",
           "serving_model_path"]
