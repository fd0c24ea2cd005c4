"""Which HF tensors an FP8 rollout server holds in FP8, and the streams / checkpoints that carry
them (docs/fp8.md).

Quantised (blockwise, :mod:`hapo_megatron.rollout.fp8`): the weights of the linear layers SGLang
builds with its FP8 linear / MoE method, in every family the converters map (convert/base.py,
convert/qwen3_moe.py): ``self_attn.{q,k,v,o}_proj.weight``, ``mlp.{gate,up,down}_proj.weight``
and the Qwen3-MoE experts ``mlp.experts.{e}.{gate,up,down}_proj.weight``. Each is sent as the
pair ``<module>.weight`` (float8_e4m3fn) + ``<module>.weight_scale_inv`` (float32), the names an
FP8 checkpoint has on disk, so SGLang's loader fuses them exactly as it fuses the weights.

Kept in the export dtype: embeddings, the output layer, every norm (QK-norm included), the q/k/v
biases, and the MoE routers ``mlp.gate.weight`` (SGLang 0.5.23 builds the Qwen3-MoE router with
``quant_config=None``, and the routing replay needs the router the trainer has).
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable, Iterator, Mapping

import torch

from hapo_megatron.config.base import ROLLOUT_QUANTIZATIONS as QUANTIZATIONS
from hapo_megatron.rollout.fp8 import BLOCK, quantize_blockwise, scale_shape

SCALE_SUFFIX = "weight_scale_inv"
_FP8_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj"
                         r"|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$")
# column-parallel layers SGLang fuses (qkv_proj, gate_up_proj, the experts' w13): every part's rows
# must be whole blocks; row-parallel ones (o_proj, down_proj, the experts' w2) split columns over TP
_FUSED_ROWS = re.compile(r"\.(self_attn\.[qkv]_proj|(gate|up)_proj)\.weight$")
_ROW_PARALLEL = re.compile(r"\.(self_attn\.o_proj|down_proj)\.weight$")


def is_fp8_weight(name: str) -> bool:
    """Whether the HF tensor ``name`` is held in FP8 by an FP8 server (module docstring)."""
    return bool(_FP8_WEIGHT.match(name))


def scale_name(weight_name: str) -> str:
    """``...q_proj.weight`` -> ``...q_proj.weight_scale_inv``."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"not a weight name: {weight_name!r}")
    return weight_name[: -len("weight")] + SCALE_SUFFIX


def quantization_config(block: tuple[int, int] = BLOCK) -> dict:
    """The ``quantization_config`` of an FP8 checkpoint's config.json, as SGLang's ``Fp8Config``
    and transformers' ``FineGrainedFP8Config`` read it (fp32 scales, not UE8M0)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [int(b) for b in block]}


def quantize_named_tensors(named: Iterable[tuple[str, torch.Tensor]],
                           block: tuple[int, int] = BLOCK) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight-sync stream of an FP8 server: :func:`is_fp8_weight` tensors become the pair
    ``(name, q)``, ``(scale_name(name), weight_scale_inv)`` (on the tensor's device), the rest
    pass through unchanged. Lazy: one tensor is quantised at a time."""
    for name, tensor in named:
        if is_fp8_weight(name):
            q, scale = quantize_blockwise(tensor, block)
            yield name, q
            yield scale_name(name), scale
        else:
            yield name, tensor


def bucket_by_dtype(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list]:
    """Buckets of at most ``bucket_bytes`` (a larger tensor alone), each of ONE dtype: an FP8
    stream alternates float8 weights, float32 scales and bf16 norms, and cutting a bucket at every
    dtype change (``weight_sync.bucket_named_tensors``) would send one tensor per request. One
    pending bucket per dtype; every tensor keeps its own name, so the order does not matter to the
    server (``load_weights`` places each by name; the FP8 post-processing runs once at the end of
    the update session). Each byte offset is a multiple of the dtype's size, which SGLang's
    flattened-bucket reader requires (``weight_sync/tensor_bucket.py``)."""
    if int(bucket_bytes) <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    pending: dict[torch.dtype, tuple[list, int]] = {}
    for name, t in named:
        n = int(t.numel()) * int(t.element_size())
        items, size = pending.get(t.dtype, ([], 0))
        if items and size + n > bucket_bytes:
            yield items
            items, size = [], 0
        items.append((name, t))
        pending[t.dtype] = (items, size + n)
    for items, _ in pending.values():
        if items:
            yield items


def check_servable(shapes: Mapping[str, tuple[int, ...]], tp_size: int = 1,
                   block: tuple[int, int] = BLOCK) -> None:
    """ValueError listing the FP8 weights SGLang's block-FP8 layers refuse at ``--tp-size``
    ``tp_size`` (``Fp8LinearMethod.validate_block_quant_shapes``): each part of a fused
    column-parallel layer (q, k, v; gate, up) must have whole blocks of rows on every TP rank, and
    with TP > 1 a row-parallel layer's columns per rank must be whole blocks."""
    bad = []
    for name, shape in shapes.items():
        if not is_fp8_weight(name):
            continue
        rows, cols = shape
        if _FUSED_ROWS.search(name) and (rows % tp_size or (rows // tp_size) % block[0]):
            bad.append(f"{name} {tuple(shape)}: {rows} rows / TP {tp_size} is not a multiple of {block[0]}")
        if tp_size > 1 and _ROW_PARALLEL.search(name) and (cols % tp_size or (cols // tp_size) % block[1]):
            bad.append(f"{name} {tuple(shape)}: {cols} columns / TP {tp_size} is not a multiple of {block[1]}")
    if bad:
        shown = "\n  ".join(bad[:10]) + (f"\n  ... and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise ValueError(f"rollout.quantization='fp8': SGLang's {block[0]}x{block[1]} block-FP8 layers cannot hold "
                         f"these weights (docs/fp8.md, \"Which models\"):\n  {shown}")


def server_weight_bytes(shapes: Mapping[str, tuple[int, ...]], *, quantization: str,
                        dtype_bytes: int = 2, block: tuple[int, int] = BLOCK) -> int:
    """Bytes of one server's copy of the weights (all TP ranks together): ``dtype_bytes`` per
    parameter, and with ``fp8`` 1 byte per parameter of the :func:`is_fp8_weight` tensors plus
    their float32 scales (4 bytes per block)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    total = 0
    for name, shape in shapes.items():
        numel = 1
        for s in shape:
            numel *= int(s)
        if quantization == "fp8" and is_fp8_weight(name):
            sn, sk = scale_shape(tuple(shape), block)
            total += numel + 4 * sn * sk
        else:
            total += numel * int(dtype_bytes)
    return total


def write_fp8_checkpoint(model_dir: str, out_dir: str, *, shard_bytes: int = 2 << 30, tp_size: int = 1,
                         block: tuple[int, int] = BLOCK) -> str:
    """The FP8 checkpoint FP8 servers start from: ``model_dir``'s (safetensors) weights with the
    :func:`is_fp8_weight` tensors quantised, its config.json marked with the
    :func:`quantization_config`, its tokenizer files copied. Checks the shapes first
    (:func:`check_servable`). Returns ``out_dir``."""
    from hapo_megatron.convert.hf_io import HFCheckpointReader
    from hapo_megatron.rollout.sglang.weight_sync import write_hf_checkpoint

    reader = HFCheckpointReader(model_dir)
    check_servable({n: reader.shape(n) for n in reader}, tp_size, block)
    named = ((n, reader[n]) for n in reader)
    write_hf_checkpoint(quantize_named_tensors(named, block), out_dir, shard_bytes=shard_bytes,
                        config_dir=model_dir)
    mark_fp8_config(out_dir, block)
    return out_dir


def dequantized_state_dict(model_dir: str, dtype: torch.dtype = torch.float32,
                           block: tuple[int, int] = BLOCK) -> dict[str, torch.Tensor]:
    """Every tensor of a block-FP8 checkpoint (:func:`write_fp8_checkpoint`, a disk sync), each
    FP8 weight dequantised with its ``weight_scale_inv`` (for transformers, which needs
    ``accelerate`` for its own FP8 loader), the others cast to ``dtype``. ValueError on a weight
    without its scale or a scale without its weight."""
    from hapo_megatron.convert.hf_io import HFCheckpointReader
    from hapo_megatron.rollout.fp8 import FP8_DTYPE, dequantize_blockwise

    reader = HFCheckpointReader(model_dir)
    names = set(reader)
    out = {}
    for name in reader:
        if name.endswith("." + SCALE_SUFFIX):
            if name[: -len(SCALE_SUFFIX)] + "weight" not in names:
                raise ValueError(f"{model_dir}: {name} has no weight")
            continue
        t = reader[name]
        if t.dtype == FP8_DTYPE:
            if scale_name(name) not in names:
                raise ValueError(f"{model_dir}: FP8 tensor {name} has no {SCALE_SUFFIX}")
            out[name] = dequantize_blockwise(t, reader[scale_name(name)], block, dtype)
        else:
            out[name] = t.to(dtype)
    return out


def mark_fp8_config(model_dir: str, block: tuple[int, int] = BLOCK) -> None:
    """Add :func:`quantization_config` to ``model_dir/config.json`` (which must exist)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{model_dir} has no config.json to mark as an FP8 checkpoint")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(block)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


__all__ = ["QUANTIZATIONS", "SCALE_SUFFIX", "is_fp8_weight", "scale_name", "quantization_config",
           "quantize_named_tensors", "bucket_by_dtype", "check_servable", "server_weight_bytes",
           "mark_fp8_config", "write_fp8_checkpoint",
           "dequantized_state_dict"]
