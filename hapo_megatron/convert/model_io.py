"""Moving weights between a live Megatron GPTModel and HF tensors (load and streaming export)."""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist

from hapo_megatron.convert.adapters import get_adapter
from hapo_megatron.convert.base import (TE_ALIASES, ModelAdapter, ParamMap, check_hf_state, grouped_expert_name,
                                        split_dim)
from hapo_megatron.convert.hf_io import HFCheckpointReader
from hapo_megatron.models.lora import is_lora_param, merged_weights
from hapo_megatron.parallel.collectives import all_gather_objects


def unwrap_model(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _as_chunks(model_chunks) -> list:
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    return [unwrap_model(c) for c in chunks]


def local_experts(chunk) -> list[int] | None:
    """Global indices of the experts this rank holds in `chunk`'s MoE layers (every MoE layer
    holds the same ones), None without MoE layers; read from the layers like `layer_number`."""
    held = {tuple(layer.mlp.local_expert_indices) for layer in chunk.decoder.layers
            if hasattr(layer.mlp, "local_expert_indices")}
    if len(held) > 1:
        raise ValueError(f"MoE layers of one chunk hold different experts: {sorted(held)}")
    return list(held.pop()) if held else None


def chunk_entries(adapter: ModelAdapter, chunk) -> list[tuple[ParamMap, torch.nn.Parameter]]:
    """(map, parameter) for every parameter of one GPTModel chunk; layers located by layer_number.

    Handles the Transformer Engine names (norms fused into the following linear). Raises
    ValueError for parameters no map covers; LoRA adapters (`models.lora`) have no HF tensor of
    their own (the export merges them into their layer's weight).
    """
    layers = [(j, layer.layer_number - 1) for j, layer in enumerate(chunk.decoder.layers)]
    maps = adapter.stage_maps(layers, chunk.pre_process, chunk.post_process, local_experts(chunk))
    params = dict(chunk.named_parameters())
    out, used = [], set()
    for pm in maps:
        name = pm.mcore
        if name not in params:
            prefix, _, suffix = name.rpartition("layers.")
            local, _, rest = suffix.partition(".")
            alias = f"{prefix}layers.{local}.{TE_ALIASES.get(rest, rest)}"
            name = alias if alias in params else name
        if name not in params and grouped_expert_name(pm.mcore) in params:
            name = grouped_expert_name(pm.mcore)  # TEGroupedMLP (moe_grouped_gemm): weight{j} of a GroupedLinear
        if name not in params:
            raise ValueError(f"model has no parameter {pm.mcore!r} (nor a Transformer Engine alias)")
        out.append((pm, params[name]))
        used.add(name)
    unknown = sorted(n for n in set(params) - used if not is_lora_param(n))
    if unknown:
        raise ValueError(f"model parameters without an HF mapping: {unknown}")
    return out


def load_hf_weights_into_mcore(model, hf_model_path_or_state, hf_config, *, tp_rank: int, tp_size: int,
                               pp_rank: int | None = None, pp_size: int | None = None,
                               etp_rank: int | None = None, etp_size: int | None = None,
                               progress: Callable[[str], None] | None = None) -> None:
    """Copy HF weights into this rank's Megatron model (one chunk or a list of chunks).

    `hf_model_path_or_state`: a safetensors directory (read one tensor at a time) or a state dict.
    The HF checkpoint is checked against `hf_config` first (ValueError listing missing, unexpected
    and wrongly shaped tensors). Layers are located by each layer's own global `layer_number`, so
    pp_rank/pp_size are informational (they are not needed to place layers, also with VPP). MoE
    experts are located the same way (each MoE layer's `local_expert_indices`); each expert's FFN
    is split over the expert-TP group: `etp_rank`/`etp_size` (None: the same as TP).
    """

    adapter = get_adapter(hf_config)
    adapter.check_tp(tp_size)
    etp_rank, etp_size = (tp_rank, tp_size) if etp_size is None else (etp_rank, etp_size)
    source = hf_model_path_or_state
    if isinstance(source, str):
        source = HFCheckpointReader(source)
    shape_of = source.shape if hasattr(source, "shape") else (lambda n: tuple(source[n].shape))
    check_hf_state(adapter, list(source.keys()), shape_of)
    wrong = []
    with torch.no_grad():
        for chunk in _as_chunks(model):
            for pm, param in chunk_entries(adapter, chunk):
                padded = param.shape[0] * tp_size if pm.kind == "vocab" else None
                rank, size = (etp_rank, etp_size) if pm.expert is not None else (tp_rank, tp_size)
                shard = adapter.to_mcore_shard(pm, [source[n] for n in pm.hf], rank, size, padded)
                if tuple(shard.shape) != tuple(param.shape):
                    wrong.append(f"{pm.mcore}: converted {tuple(shard.shape)} vs model {tuple(param.shape)}")
                    continue
                param.copy_(shard)
                if progress:
                    progress(pm.mcore)
    if wrong:
        raise ValueError("converted tensors do not fit the model (TP/PP layout or config mismatch):\n  "
                         + "\n  ".join(wrong))


def _gather_tp(param: torch.Tensor, kind: str, tp_group) -> torch.Tensor:
    """All TP shards of `param` concatenated along its split dim (`param` itself when replicated)."""
    return gather_tp_along(param, split_dim(kind), tp_group)


def gather_tp_along(param: torch.Tensor, dim, tp_group) -> torch.Tensor:
    """All TP shards of `param` concatenated along ``dim`` (None: replicated, a copy of `param`)."""
    size = dist.get_world_size(tp_group) if tp_group is not None else 1
    if dim is None or size == 1:
        return param.detach().clone()  # never hand out a view of a live parameter
    parts = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(parts, param.detach().contiguous(), group=tp_group)
    return torch.cat(parts, dim=dim)


def _gathered_shape(param: torch.Tensor, kind: str, tp_size: int) -> tuple[int, ...]:
    shape, dim = list(param.shape), split_dim(kind)
    if dim is not None:
        shape[dim] *= tp_size
    return tuple(shape)


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _rank(group) -> int:
    return dist.get_rank(group) if group is not None else 0


def _all_gather_entries(mine: list, group) -> list:
    everyone = all_gather_objects(mine, group) if group is not None else [mine]
    return [e for rank_entries in everyone for e in rank_entries]


def _export_plan(local: list[tuple[ParamMap, torch.Tensor]], tp_size: int, etp_size: int, pp_group,
                 ep_group) -> list[tuple]:
    """Every tensor's (order, owner_pp_rank, owner_ep_rank, map, gathered shape, dtype) in HF order.

    Expert weights are owned by one expert-parallel rank of their stage; dense ones by all of them
    (recorded as EP rank 0, whose copy is as good as any)."""
    me_pp, me_ep = _rank(pp_group), _rank(ep_group)
    mine = [(pm.order, me_pp, me_ep, pm, _gathered_shape(p, pm.kind, etp_size if pm.expert is not None else tp_size),
             p.dtype) for pm, p in local if pm.expert is not None or me_ep == 0]
    entries = _all_gather_entries(_all_gather_entries(mine, ep_group), pp_group)
    return sorted(entries, key=lambda e: e[0])


def _check_plan(adapter: ModelAdapter, plan: list[tuple]) -> None:
    """Every HF tensor once with its config shape: a missing `ep_group` / `etp_group` shows here
    (experts of other EP ranks missing, ETP-split experts too small), not as wrong weights."""
    got = {n: tuple(s) for _, _, _, pm, _, _ in plan for n, s in zip(pm.hf, pm.hf_shapes)}
    expected = adapter.hf_shapes()
    if adapter.tied:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(got))
    if missing:
        raise ValueError(f"export: {len(missing)} HF tensors held by no rank of the groups given (expert "
                         f"weights need ep_group=): {missing[:5]}")
    for _, _, _, pm, shape, _ in plan:
        if pm.kind == "vocab":
            continue  # padded rows; checked when the padding is cut
        want = pm.hf_shapes[0] if pm.kind in ("replicated", "row") else (
            sum(s[0] for s in pm.hf_shapes), *pm.hf_shapes[0][1:])
        if tuple(shape) != tuple(want):
            raise ValueError(f"export: {pm.mcore} gathers to {tuple(shape)}, the config says {tuple(want)} "
                             "(expert weights split over ETP need etp_group=)")


def export_hf_weights(model_chunks, hf_config, *, tp_group=None, pp_group=None, ep_group=None, etp_group=None,
                      dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for the whole model, one tensor at a time, in HF order.

    Every rank of the TP x PP grid (with MoE: x EP x ETP) must call it and consume it fully (it
    runs collectives); every rank yields every tensor. Each parameter is all-gathered over
    `tp_group` (expert weights: over `etp_group`, the expert-TP group) on its owning stage (expert
    weights: then broadcast over `ep_group` from the expert-parallel rank holding the expert), then
    broadcast over `pp_group` from that stage; at most one full parameter is alive at a time.
    Tensors are on the parameters' device, cast to `dtype` when given, with the vocab padding
    removed; the tied `lm_head.weight` is not yielded (HF omits it too). A layer with LoRA
    adapters (`models.lora`) yields its merged weight ``W + (alpha / r) B A`` (summed in float32 on
    each rank's shard, then cast to the weight's dtype), so engines serve the LoRA model as is. Groups left None have
    size 1; a MoE model split over EP / ETP without its group raises ValueError.
    """

    adapter = get_adapter(hf_config)
    chunks = _as_chunks(model_chunks)
    local = [(pm, p) for c in chunks for pm, p in chunk_entries(adapter, c)
             if not (adapter.tied and pm.mcore == "output_layer.weight")]
    by_order = {pm.order: p for pm, p in local}
    adapters = merged_weights(chunks)
    tp_size, etp_size = _size(tp_group), _size(etp_group)
    me_pp, me_ep = _rank(pp_group), _rank(ep_group)
    device = next(iter(chunks[0].parameters())).device
    plan = _export_plan(local, tp_size, etp_size, pp_group, ep_group)
    _check_plan(adapter, plan)
    for order, owner_pp, owner_ep, pm, shape, param_dtype in plan:
        dim = split_dim(pm.kind)
        expert = pm.expert is not None
        if owner_pp == me_pp and (not expert or owner_ep == me_ep):
            full = _gather_tp(_merged(by_order[order], adapters), pm.kind, etp_group if expert else tp_group)
        else:
            full = torch.empty(shape, dtype=param_dtype, device=device)
        if expert and owner_pp == me_pp and _size(ep_group) > 1:
            dist.broadcast(full, src=dist.get_global_rank(ep_group, owner_ep), group=ep_group)
        if _size(pp_group) > 1:
            dist.broadcast(full, src=dist.get_global_rank(pp_group, owner_pp), group=pp_group)
        shards = [full] if dim is None else list(full.chunk(etp_size if expert else tp_size, dim=dim))
        for name, tensor in zip(pm.hf, adapter.to_hf(pm, shards)):
            yield name, tensor.to(dtype=dtype or tensor.dtype).contiguous()


def _merged(param: torch.Tensor, adapters: dict) -> torch.Tensor:
    """``param``, or its layer's merged LoRA weight (this rank's shard) when it has adapters."""
    adapter = adapters.get(id(param))
    if adapter is None or not adapter.enabled:
        return param
    with torch.no_grad():
        return (param.float() + adapter.delta_weight()).to(param.dtype)


def gather_hf_state_dict(model_chunks, hf_config, **kw) -> dict[str, torch.Tensor]:
    """The whole HF state dict (CPU) from `export_hf_weights`; for tests and small models."""
    return {n: t.cpu() for n, t in export_hf_weights(model_chunks, hf_config, **kw)}

