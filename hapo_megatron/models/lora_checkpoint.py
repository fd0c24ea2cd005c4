"""What a LoRA run's checkpoint records about the model it adapts (docs/lora.md, "Checkpoints").

A LoRA run saves the adapters only (and their optimizer state): the frozen base is not in the
checkpoint, so resuming or converting it needs the same base weights again. ``lora.json`` beside
the dist_checkpointing files (``<checkpoint>/model/lora.json``) names the base model's path, a hash
of its weights and the adapters' settings; a resume under another base, or other adapter
settings, is refused with one line (`check_resume`), and `hapo convert megatron-to-hf` finds the
base there.

WHY a hash of the tensors and not of the files: the same weights resharded into other files (or
re-saved with other metadata) are the same base; any changed tensor byte is not. Each tensor's
bytes go through CRC32 (about 3 GB/s on one core, the checkpoint manifest's choice), the per-tensor
results with the names, dtypes and shapes through SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from typing import Any, Optional

from hapo_megatron.safetensors_files import tensor_files

LORA_RECORD = "lora.json"


def base_weights_hash(path: str) -> str:
    """A hash of every tensor of the HF model at ``path`` (names, dtypes, shapes, bytes), independent
    of how the tensors are split into files."""
    import torch
    from safetensors import safe_open
    files = tensor_files(path, field="model.hf_model_path",
                         why="a LoRA run needs the base model's safetensors weights")
    by_file: dict[str, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    per_tensor: dict[str, str] = {}
    for file, names in by_file.items():
        with safe_open(os.path.join(path, file), "pt") as f:
            for name in names:
                t = f.get_tensor(name).contiguous()
                crc = zlib.crc32(t.view(torch.uint8).numpy().tobytes()) if t.numel() else 0
                per_tensor[name] = f"{name}|{t.dtype}|{tuple(t.shape)}|{crc:08x}"
    return "sha256:" + hashlib.sha256("\n".join(per_tensor[n] for n in sorted(per_tensor)).encode()).hexdigest()


def lora_record(settings, base_path: str, base_hash: str) -> dict[str, Any]:
    """The content of ``lora.json`` for `models.lora.LoraSettings` ``settings`` on the base at ``base_path``."""
    return {"base_model_path": os.path.abspath(base_path), "base_weights_hash": base_hash,
            "rank": settings.rank, "alpha": settings.alpha, "dropout": settings.dropout,
            "target_modules": list(settings.targets), "init": settings.init}


def write_record(model_dir: str, record: dict[str, Any]) -> None:
    with open(os.path.join(model_dir, LORA_RECORD), "w") as f:
        json.dump(record, f, indent=1)


def read_record(model_dir: str) -> Optional[dict[str, Any]]:
    """The LoRA record of a checkpoint's ``model/`` directory (None: a full fine-tuning checkpoint)."""
    path = os.path.join(model_dir, LORA_RECORD)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def settings_of(record: dict[str, Any]):
    """The `models.lora.LoraSettings` a checkpoint's adapters were trained with."""
    from hapo_megatron.models.lora import LoraSettings
    return LoraSettings(rank=int(record["rank"]), alpha=float(record["alpha"]), dropout=float(record["dropout"]),
                        targets=tuple(record["target_modules"]), init=record["init"])


def resume_problem(ckpt: str, record: Optional[dict[str, Any]], settings, base_path: Optional[str],
                   base_hash: Optional[str]) -> Optional[str]:
    """Why a run with LoRA ``settings`` (None: off) on the base ``base_path`` (hash ``base_hash``)
    cannot resume from checkpoint ``ckpt`` with LoRA record ``record``, in one line (None: it can)."""
    if record is None:
        return None if settings is None else (
            f"model.lora.rank={settings.rank}: checkpoint {ckpt} was saved by a run without LoRA (no "
            f"{LORA_RECORD}); resume it with model.lora.rank=0")
    if settings is None:
        return (f"model.lora.rank=0: checkpoint {ckpt} holds only LoRA adapters (rank {record['rank']}) on the "
                f"base {record['base_model_path']}; resume it with the model.lora settings it was saved with")
    for field, mine, saved in (("rank", settings.rank, int(record["rank"])),
                               ("alpha", settings.alpha, float(record["alpha"])),
                               ("target_modules", list(settings.targets), list(record["target_modules"]))):
        if mine != saved:
            return f"model.lora.{field}={mine}: checkpoint {ckpt} was saved with {saved}"
    if base_hash != record["base_weights_hash"]:
        return (f"model.hf_model_path={base_path}: its weights (hash {base_hash}) are not the base the LoRA "
                f"checkpoint {ckpt} was trained on ({record['base_model_path']}, hash "
                f"{record['base_weights_hash']}); resume with that base model")
    return None


def check_resume(ckpt: Optional[str], settings, base_path: Optional[str]) -> None:
    """Refuse (ValueError, one line naming the field) to resume checkpoint ``ckpt`` (None: a fresh
    start) with LoRA ``settings`` (None: off) on the base model at ``base_path``."""
    if ckpt is None:
        return
    record = read_record(os.path.join(ckpt, "model"))
    needs_hash = record is not None and settings is not None
    problem = resume_problem(ckpt, record, settings, base_path,
                             base_weights_hash(base_path) if needs_hash and base_path else None)
    if problem:
        raise ValueError(problem)
