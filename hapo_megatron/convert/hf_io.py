"""Hugging Face checkpoints on disk: lazy safetensors reading, streaming sharded saving."""

from __future__ import annotations

import copy
import json
import os
import shutil
from typing import Callable, Iterable, Iterator, Mapping

import torch

from hapo_megatron.safetensors_files import INDEX_NAME, tensor_files
# Files next to the weights that a loadable HF model directory needs besides config.json.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


class HFCheckpointReader(Mapping):
    """Read-only mapping name -> tensor over a safetensors checkpoint, one tensor read at a time.

    Accepts a directory with `model.safetensors.index.json` (sharded) or `model.safetensors`.
    `shape(name)` reads only the header.
    """

    def __init__(self, path: str):
        self.path = path
        self._file_of = tensor_files(path)
        self._handles: dict = {}

    def _handle(self, name: str):
        from safetensors import safe_open

        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.path, file), "pt")
        return self._handles[file]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise KeyError(name)
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def load_hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors HF checkpoint directory (sharded or not)."""
    reader = HFCheckpointReader(path)
    return {name: reader[name] for name in reader}


def prepare_output_dir(path: str, overwrite: bool) -> None:
    """Create `path`; an existing non-empty one is an error unless `overwrite` (then it is emptied)."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        if not overwrite:
            raise FileExistsError(f"output directory {path!r} exists and is not empty; pass --overwrite to replace it")
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    os.makedirs(path, exist_ok=True)


def copy_tokenizer_files(src: str | None, dst: str) -> list[str]:
    """Copy the tokenizer / generation-config files that exist in `src` to `dst`; returns their names."""
    copied = []
    if not src or not os.path.isdir(src):
        return copied
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    return copied


def save_hf_checkpoint(named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str, hf_config=None, *,
                       tokenizer_src: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       dtype: torch.dtype | None = None, overwrite: bool = False,
                       progress: Callable[[str], None] | None = None) -> dict:
    """Write `(hf_name, tensor)` pairs as sharded safetensors + `model.safetensors.index.json`.

    Streaming: at most one shard (`max_shard_bytes`) is held in memory. `hf_config` is saved as
    config.json (with `torch_dtype` set to the saved dtype), tokenizer files are copied from
    `tokenizer_src`. Returns the index dict.
    """
    from safetensors.torch import save_file

    prepare_output_dir(out_dir, overwrite)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, total, files, weight_map = 0, 0, [], {}
    saved_dtype = None

    def flush():
        nonlocal shard, shard_bytes
        tmp = f"tmp-{len(files):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, tmp), metadata={"format": "pt"})
        files.append((tmp, list(shard)))
        shard, shard_bytes = {}, 0

    for name, tensor in named_tensors:
        if name in weight_map or name in shard:
            raise ValueError(f"named_tensors: duplicate tensor {name!r}")
        tensor = tensor.detach().to("cpu", dtype=dtype or tensor.dtype).contiguous()
        saved_dtype = saved_dtype or tensor.dtype
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name] = tensor
        shard_bytes += size
        total += size
        weight_map[name] = None
        if progress:
            progress(name)
    if shard:
        flush()
    for i, (tmp, names) in enumerate(files):  # final names need the shard count
        final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, final))
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out_dir, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2)
    if hf_config is not None:
        hf_config = copy.deepcopy(hf_config)
        if saved_dtype is not None:  # transformers 5 names it `dtype`, 4.x `torch_dtype`
            setattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", saved_dtype)
        hf_config.save_pretrained(out_dir)
    copy_tokenizer_files(tokenizer_src, out_dir)
    return index
