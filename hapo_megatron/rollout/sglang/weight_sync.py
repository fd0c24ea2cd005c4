"""Weight-sync building blocks shared by the SGLang engine: bucketing of the streamed HF-named
tensors (``hapo_megatron.convert.export_hf_weights`` output) and the payloads of SGLang's
weight-update endpoints. Everything here is pure (CPU-testable) except the two helpers marked
"needs SGLang", which only wrap SGLang's own serialisation classes.

SGLang endpoints (checked on 0.5.23, ``sglang/srt/entrypoints/http_server.py`` and
``managers/io_struct.py``):

- ``POST /update_weights_from_tensor`` ``{"serialized_named_tensors": [str per server TP rank],
  "load_format": "flattened_bucket", "flush_cache": bool}``; each string is
  ``MultiprocessingSerializer.serialize({"flattened_tensor": t, "metadata": [...]}, output_str=True)``
  (base64 of a ``ForkingPickler`` dump: CUDA tensors travel as CUDA-IPC handles, so sender and
  server share the node); TP rank ``i`` deserialises entry ``i``.
- ``POST /init_weights_update_group`` ``{"master_address", "master_port", "rank_offset",
  "world_size", "group_name", "backend"}``; then per bucket ``POST /update_weights_from_distributed``
  ``{"names", "dtypes", "shapes", "group_name", "load_format": "flattened_bucket", "flush_cache"}``
  while the trainer broadcasts the flattened uint8 bucket from rank 0 of that group.
- ``POST /update_weights_from_disk`` ``{"model_path", "load_format", "flush_cache"}``.
- LoRA adapter mode (``rollout.sglang.lora_sync: adapter``, docs/lora.md): ``POST
  /load_lora_adapter_from_tensors`` ``{"lora_name", "config_dict", "serialized_named_tensors": [str
  per server TP rank], "load_format": "flattened_bucket"}`` (``LoadLoRAAdapterFromTensorsReqInput``;
  the config is peft's ``adapter_config.json``, the tensors peft-named ``...lora_A.weight`` /
  ``...lora_B.weight``, whole: each TP rank slices its share, ``managers/tp_worker.py``). A name
  loads once (the registry refuses a second load under a loaded name, ``lora/lora_registry.py``),
  so every sync loads a new name and ``POST /unload_lora_adapter`` ``{"lora_name"}`` drops the
  previous one (the unload waits until no request uses it); ``/generate`` requests name the
  adapter in ``lora_path``.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Iterable, Iterator, Optional

import torch

NamedTensor = tuple[str, torch.Tensor]


def tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements."""
    return int(t.numel()) * int(t.element_size())


def bucket_named_tensors(named_tensors: Iterable[NamedTensor], bucket_bytes: int, *,
                         split_on_dtype: bool = True) -> Iterator[list[NamedTensor]]:
    """Group a stream of ``(name, tensor)`` into consecutive buckets of at most ``bucket_bytes``.

    Order is preserved (concatenating the buckets gives the input). A tensor larger than
    ``bucket_bytes`` forms a bucket of its own. With ``split_on_dtype`` a new bucket starts when the
    dtype changes, so each flattened bucket is a single dtype (SGLang's receive side views byte
    slices as the dtype, which needs aligned offsets). Consumes the input lazily: at most one
    bucket is held at a time.
    """
    if int(bucket_bytes) <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[NamedTensor] = []
    size = 0
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and torch.is_tensor(item[1])):
            raise ValueError(f"named_tensors must yield (str, Tensor) pairs, got {type(item).__name__}")
        name, t = item
        n = tensor_nbytes(t)
        dtype_change = split_on_dtype and bucket and bucket[-1][1].dtype != t.dtype
        if bucket and (size + n > bucket_bytes or dtype_change):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)`` with one item of look-ahead (to flush caches only once)."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for cur in it:
        yield prev, False
        prev = cur
    yield prev, True


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16 -> "bfloat16"`` (SGLang resolves it with ``getattr(torch, name)``)."""
    return str(dtype).replace("torch.", "")


def flatten_bucket(bucket: list[NamedTensor]) -> tuple[torch.Tensor, list[dict]]:
    """Concatenate a bucket into one uint8 tensor ``[sum nbytes]`` plus per-tensor metadata
    ``{"name", "shape", "dtype", "start", "end"}`` (byte offsets), in bucket order."""
    if not bucket:
        raise ValueError("bucket must not be empty")
    parts, meta, offset = [], [], 0
    for name, t in bucket:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        meta.append({"name": name, "shape": list(t.shape), "dtype": t.dtype,
                     "start": offset, "end": offset + flat.numel()})
        parts.append(flat)
        offset += flat.numel()
    return torch.cat(parts), meta


def unflatten_bucket(flat: torch.Tensor, meta: list[dict]) -> list[NamedTensor]:
    """Inverse of :func:`flatten_bucket` (views into ``flat``)."""
    return [(m["name"], flat[m["start"]:m["end"]].view(m["dtype"]).reshape(m["shape"])) for m in meta]


def distributed_update_payload(bucket: list[NamedTensor], *, group_name: str, flush_cache: bool) -> dict:
    """Body of ``POST /update_weights_from_distributed`` announcing one flattened bucket."""
    return {
        "names": [n for n, _ in bucket],
        "dtypes": [dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "load_format": "flattened_bucket",
        "flush_cache": bool(flush_cache),
    }


def init_group_payload(*, master_address: str, master_port: int, rank_offset: int, world_size: int,
                       group_name: str, backend: str = "nccl") -> dict:
    """Body of ``POST /init_weights_update_group`` for one server (its TP ranks take
    ``rank_offset .. rank_offset + tp - 1``; the trainer's sender is rank 0)."""
    return {"master_address": master_address, "master_port": int(master_port),
            "rank_offset": int(rank_offset), "world_size": int(world_size),
            "group_name": group_name, "backend": backend}


def tensor_update_payload(serialized_per_rank: list[str], *, flush_cache: bool) -> dict:
    """Body of ``POST /update_weights_from_tensor`` (one serialised bucket per server TP rank)."""
    if not serialized_per_rank or not all(isinstance(s, str) for s in serialized_per_rank):
        raise ValueError("serialized_per_rank must be a non-empty list of base64 strings")
    return {"serialized_named_tensors": list(serialized_per_rank), "load_format": "flattened_bucket",
            "flush_cache": bool(flush_cache)}


def serialize_bucket_for_sglang(bucket: list[NamedTensor], num_ranks: int = 1) -> tuple[list[str], torch.Tensor]:
    """``num_ranks`` entries of ``serialized_named_tensors`` (needs SGLang): the bucket flattened
    ONCE and serialised once per server TP rank, and the flattened tensor they refer to, which the
    caller keeps alive until the server has answered.

    One serialisation per TP rank, never one shared string: each TP rank deserialises only its
    own entry (SGLang 0.5.23 ``managers/tp_worker.py`` ``deserialize_own_rank``), and every
    CUDA serialisation takes its own producer-side CUDA-IPC reference (``storage._share_cuda_()``
    in ``torch/multiprocessing/reductions.py``), which that rank's consumer releases; a string
    shared by several ranks would be released several times for one reference, so the bucket
    could be freed and reused while another rank still reads it. SGLang's own engine does the same
    (``entrypoints/engine.py`` ``_serialize_tensors_per_rank``).

    The body is SGLang's own ``FlattenedTensorBucket`` dict (what its ``load_format=
    "flattened_bucket"`` reader expects), pickled one of two ways:

    - CUDA tensors: ``MultiprocessingSerializer`` (``ForkingPickler``: CUDA-IPC handles, nothing
      copied) after SGLang's torch-reduction patch, which names devices by UUID so the server maps
      them correctly (applied only here: the patch assumes CUDA tensors).
    - CPU tensors: plain ``pickle`` BY VALUE (the bytes travel in the request). ``ForkingPickler``
      would send shared-memory file descriptors, which a CPU server's scheduler cannot receive
      (SGLang 0.5.23 died with ``AuthenticationError: digest sent was rejected``). The server's
      ``SafeUnpickler`` accepts this form: it allows ``torch._utils._rebuild_tensor_v2`` and routes
      ``torch.storage._load_from_bytes`` to its restricted loader.
    """
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    if int(num_ranks) < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    on_cuda = any(t.is_cuda for _, t in bucket)
    fb = FlattenedTensorBucket(named_tensors=[(n, t.detach().contiguous()) for n, t in bucket])
    data = {"flattened_tensor": fb.get_flattened_tensor(), "metadata": fb.get_metadata()}
    if on_cuda:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        blobs = [MultiprocessingSerializer.serialize(data, output_str=True) for _ in range(int(num_ranks))]
    else:
        blobs = [serialize_by_value(data) for _ in range(int(num_ranks))]
    return blobs, data["flattened_tensor"]


def lora_adapter_payload(named_tensors: list[NamedTensor], config: dict, *, lora_name: str,
                         num_ranks: int = 1) -> tuple[dict, torch.Tensor]:
    """Body of ``POST /load_lora_adapter_from_tensors`` (needs SGLang) for the adapter matrices
    ``named_tensors`` (peft names, one dtype) and peft ``config``, and the flattened tensor the body
    refers to (kept alive until the server has answered, as `serialize_bucket_for_sglang`)."""
    if not named_tensors:
        raise ValueError("lora_adapter_payload: no adapter tensors")
    bad = [n for n, _ in named_tensors if not n.endswith((".lora_A.weight", ".lora_B.weight"))]
    if bad:
        raise ValueError(f"lora_adapter_payload: not peft LoRA names: {bad[:3]}")
    blobs, flat = serialize_bucket_for_sglang(named_tensors, num_ranks)
    return {"lora_name": lora_name, "config_dict": dict(config), "serialized_named_tensors": blobs,
            "load_format": "flattened_bucket"}, flat


def lora_adapter_name(version: int) -> str:
    """The name of the policy's adapter at sync ``version`` on the servers (a new one per sync)."""
    return f"hapo-policy-{int(version)}"


def serialize_by_value(obj: Any) -> str:
    """``obj`` pickled with its tensors' bytes inline, base64-encoded (SGLang's HTTP wire form)."""
    import base64
    import pickle

    return base64.b64encode(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def write_hf_checkpoint(named_tensors: Iterable[NamedTensor], out_dir: str, *, shard_bytes: int,
                        config_dir: Optional[str] = None) -> list[str]:
    """Stream HF-named tensors into a sharded safetensors checkpoint (for ``/update_weights_from_disk``).

    Writes ``model-00001.safetensors`` ... and ``model.safetensors.index.json``; copies the
    ``*.json`` / tokenizer files of ``config_dir`` (the original model directory) so the directory
    is loadable. Returns the shard file names in order.
    """
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    if config_dir and os.path.isdir(config_dir):
        for f in os.listdir(config_dir):
            if (f.endswith((".json", ".model", ".txt", ".tiktoken")) and "safetensors.index" not in f
                    and os.path.isfile(os.path.join(config_dir, f))):
                shutil.copy2(os.path.join(config_dir, f), os.path.join(out_dir, f))
    shards, weight_map, total = [], {}, 0
    for bucket in bucket_named_tensors(named_tensors, shard_bytes, split_on_dtype=False):
        fname = f"model-{len(shards) + 1:05d}.safetensors"
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in bucket}
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total += tensor_nbytes(t)
        shards.append(fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return shards


__all__ = ["bucket_named_tensors", "with_last", "tensor_nbytes", "dtype_name", "flatten_bucket",
           "unflatten_bucket", "distributed_update_payload", "init_group_payload",
           "tensor_update_payload", "serialize_bucket_for_sglang", "serialize_by_value", "write_hf_checkpoint"]
