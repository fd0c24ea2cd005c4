"""The HF <-> Megatron-Core name and layout mapping shared by Llama, Qwen2 and Qwen3.

A `ParamMap` ties one Megatron parameter (local layer spec name, stage-local layer index) to the
HF tensors it is made of and a layout `kind`:

- "replicated": same tensor on every TP rank (norm weights, QK-norm).
- "row": row-parallel linear, split along dim 1 (linear_proj, linear_fc2).
- "vocab": vocab-parallel embedding / output layer, rows padded to the padded vocab with zeros,
  then split along dim 0; the padding is dropped again on export.
- "qkv": q, k, v fused per query group, `[groups * (q_per_group + 2) * d, H]`: group g holds its
  q heads, then its k head, then its v head; split along dim 0 (whole groups per TP rank).
- "fc1": gate and up fused; TP rank r holds `cat(gate_r, up_r)`, split along dim 0.

MoE expert weights (`ParamMap.expert` set) use the "fc1" / "row" layouts over the expert-TP
group (ETP) instead of TP; each expert-parallel rank holds whole experts, its `local_experts.{j}`
being global expert `experts[j]` of that rank (`stage_maps(..., experts=...)`). With
Transformer Engine's grouped MLP (moe_grouped_gemm, GPU) the same tensor is named
`experts.linear_fc1.weight{j}` (`grouped_expert_name`; the model I/O looks both names up).

All conversions are slicing and concatenation, so a round trip is bit-exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from hapo_megatron.config.validate import ModelSpec, check_layout
from hapo_megatron.models.hf_config import has_qkv_bias, head_dim_of, num_kv_heads_of

_SIZE_NAMES = {"tp": "tp_size", "pp": "pp_size", "ep": "ep_size", "etp": "etp_size"}  # the converter's arguments

KINDS = ("replicated", "row", "vocab", "qkv", "fc1")
# Transformer Engine spec fuses the pre-attention / pre-MLP norms into the following linear.
TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
# Expert weights: SequentialMLP (local spec; what the maps name) keeps one module per local expert,
# Transformer Engine's grouped MLP (TEGroupedMLP, moe_grouped_gemm on GPU) one GroupedLinear per
# projection with a parameter per local expert (`weight{j}`, the same [out, in] layout as expert
# j's linear). The two names of local expert j's projection:
_SEQUENTIAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$")


def grouped_expert_name(name: str) -> str | None:
    """``...mlp.experts.local_experts.{j}.linear_fc1.weight`` -> ``...mlp.experts.linear_fc1.weight{j}``
    (TEGroupedMLP's name of the same tensor); None for any other name."""
    m = _SEQUENTIAL_EXPERT.match(name)
    return f"{m.group(1)}.{m.group(3)}.weight{m.group(2)}" if m else None


def sequential_expert_name(name: str) -> str | None:
    """Inverse of `grouped_expert_name`: a TEGroupedMLP parameter name -> the SequentialMLP name
    the maps use; None for any other name."""
    m = _GROUPED_EXPERT.match(name)
    return f"{m.group(1)}.local_experts.{m.group(3)}.{m.group(2)}.weight" if m else None


# HF tensors that carry no weights (old checkpoints store RoPE buffers); ignored on load.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter and the HF tensors it is made of.

    `mcore`: local-spec name with the stage-local layer index; `hf`: HF names; `hf_shapes`: their
    shapes; `kind`: layout (see module docstring); `order`: position in the HF canonical order;
    `expert`: the global expert index of an MoE expert weight (split over ETP, not TP), else None.
    """

    mcore: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    kind: str
    order: tuple
    expert: int | None = None


def split_dim(kind: str) -> int | None:
    """Dimension along which a kind is split over TP (None: replicated)."""
    return None if kind == "replicated" else (1 if kind == "row" else 0)


class ModelAdapter:
    """Llama-style decoder mapping; subclasses switch on q/k/v biases and QK-norm."""

    arch = "llama"
    qk_norm = False

    def __init__(self, hf_config):
        self.hf_config = hf_config
        c = hf_config
        self.hidden = c.hidden_size
        self.ffn = c.intermediate_size
        self.heads = c.num_attention_heads
        self.groups = num_kv_heads_of(c)
        self.head_dim = head_dim_of(c)
        self.vocab = c.vocab_size
        self.num_layers = c.num_hidden_layers
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        self.spec = ModelSpec.of(c)
        self.qkv_bias = self._has_qkv_bias()

    def _has_qkv_bias(self) -> bool:
        return has_qkv_bias(self.hf_config)

    def check_tp(self, tp_size: int) -> None:
        """TP must split attention heads, query groups and the MLP evenly (Megatron's layout)."""
        check_layout(self.spec, tp=tp_size, names=_SIZE_NAMES)

    # ----------------------------------------------------------------------------- the maps
    def check_ep(self, ep_size: int, etp_size: int) -> None:
        """Expert parallelism needs experts; EP must split them evenly, ETP each expert's FFN (a
        dense model ignores `etp_size`)."""
        check_layout(self.spec, ep=ep_size, etp=etp_size if self.spec.is_moe else None, names=_SIZE_NAMES)

    def layer_maps(self, local: int, layer: int, experts: Sequence[int] | None = None) -> list[ParamMap]:
        """Maps of one decoder layer: `local` index inside the stage, `layer` global HF index;
        `experts`: the global experts this rank holds (MoE adapters; ignored by dense ones)."""
        m, h = f"decoder.layers.{local}.", f"model.layers.{layer}."
        H, F, d = self.hidden, self.ffn, self.head_dim
        q, kv = self.heads * d, self.groups * d
        key = lambda i: (1, layer, i)  # noqa: E731 - position inside the layer, HF module order
        out = [ParamMap(m + "input_layernorm.weight", (h + "input_layernorm.weight",), ((H,),), "replicated", key(7))]
        attn = h + "self_attn."
        out.append(ParamMap(m + "self_attention.linear_qkv.weight",
                            tuple(attn + f"{p}_proj.weight" for p in "qkv"), ((q, H), (kv, H), (kv, H)), "qkv", key(0)))
        if self.qkv_bias:
            out.append(ParamMap(m + "self_attention.linear_qkv.bias",
                                tuple(attn + f"{p}_proj.bias" for p in "qkv"), ((q,), (kv,), (kv,)), "qkv", key(1)))
        if self.qk_norm:
            out.append(ParamMap(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), ((d,),),
                                "replicated", key(3)))
            out.append(ParamMap(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), ((d,),),
                                "replicated", key(4)))
        out += [
            ParamMap(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), ((H, q),), "row", key(2)),
            ParamMap(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), ((H,),), "replicated",
                     key(8)),
            ParamMap(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                     ((F, H), (F, H)), "fc1", key(5)),
            ParamMap(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), ((H, F),), "row", key(6)),
        ]
        return out

    def stage_maps(self, layers: Sequence[tuple[int, int]], pre_process: bool, post_process: bool,
                   experts: Sequence[int] | None = None) -> list[ParamMap]:
        """Maps of one pipeline stage holding `layers` = [(local, global), ...] and, in MoE layers,
        the global `experts` (None: all)."""
        V, H = self.vocab, self.hidden
        out = []
        if pre_process:
            out.append(ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), ((V, H),), "vocab",
                                (0,)))
        for local, layer in layers:
            out += self.layer_maps(local, layer, experts)
        if post_process:
            out.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), ((H,),), "replicated", (2,)))
            if not self.tied:
                out.append(ParamMap("output_layer.weight", ("lm_head.weight",), ((V, H),), "vocab", (3,)))
            elif not pre_process:
                # Tied weights on a last stage without the embedding: Megatron keeps a copy.
                out.append(ParamMap("output_layer.weight", ("model.embed_tokens.weight",), ((V, H),), "vocab", (3,)))
        return out

    def uniform_stage_maps(self, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> list[ParamMap]:
        """Maps of stage `pp_rank` when the layers are split evenly over `pp_size` stages (and the
        experts of MoE layers evenly over `ep_size` ranks)."""
        if pp_size <= 0 or not 0 <= pp_rank < pp_size:
            raise ValueError(f"pp_rank={pp_rank} must be in [0, pp_size={pp_size})")
        check_layout(self.spec, pp=pp_size, names=_SIZE_NAMES)
        per = self.num_layers // pp_size
        layers = [(j, pp_rank * per + j) for j in range(per)]
        return self.stage_maps(layers, pp_rank == 0, pp_rank == pp_size - 1, self.experts_of(ep_rank, ep_size))

    def experts_of(self, ep_rank: int, ep_size: int) -> list[int] | None:
        """Global experts held by expert-parallel rank `ep_rank` (None: a dense model)."""
        self.check_ep(ep_size, 1)
        return None

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor name of the model with its shape, in canonical order (no tied lm_head)."""
        shapes = {}
        for pm in sorted(self.uniform_stage_maps(0, 1), key=lambda p: p.order):
            shapes.update(zip(pm.hf, pm.hf_shapes))
        return shapes

    # ------------------------------------------------------------------- tensor conversions
    def to_mcore_shard(self, pm: ParamMap, hf: Sequence[torch.Tensor], tp_rank: int, tp_size: int,
                       padded_vocab: int | None = None) -> torch.Tensor:
        """This TP rank's Megatron shard of `pm` from its HF tensors (in `pm.hf` order)."""
        if pm.kind == "replicated":
            return hf[0].clone()
        if pm.kind == "row":
            return hf[0].chunk(tp_size, dim=1)[tp_rank].clone()
        if pm.kind == "vocab":
            full = hf[0]
            pad = (padded_vocab or full.shape[0]) - full.shape[0]
            if pad < 0:
                raise ValueError(f"padded_vocab={padded_vocab} is smaller than the vocab {full.shape[0]}")
            if pad:
                full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])])
            return full.chunk(tp_size, dim=0)[tp_rank].clone()
        if pm.kind == "fc1":
            return torch.cat([t.chunk(tp_size, dim=0)[tp_rank] for t in hf])
        if pm.kind == "qkv":
            return self._fuse_qkv(hf).chunk(tp_size, dim=0)[tp_rank].clone()
        raise ValueError(f"unknown kind {pm.kind!r}")

    def to_hf(self, pm: ParamMap, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """HF tensors of `pm` from all its TP shards (rank order); inverse of to_mcore_shard."""
        if pm.kind == "replicated":
            return [shards[0]]
        if pm.kind == "row":
            return [torch.cat(list(shards), dim=1)]
        if pm.kind == "vocab":
            return [torch.cat(list(shards), dim=0)[: self.vocab]]
        if pm.kind == "fc1":
            halves = [s.chunk(2, dim=0) for s in shards]
            return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
        if pm.kind == "qkv":
            return self._split_qkv(torch.cat(list(shards), dim=0))
        raise ValueError(f"unknown kind {pm.kind!r}")

    def _fuse_qkv(self, qkv: Sequence[torch.Tensor]) -> torch.Tensor:
        """[heads*d, ...], [groups*d, ...] x2 -> [groups*(q_per_group+2)*d, ...] grouped by query group."""
        q, k, v = qkv
        g, d, rest = self.groups, self.head_dim, q.shape[1:]
        per = self.heads // g
        fused = torch.cat([q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
        return fused.reshape(g * (per + 2) * d, *rest)

    def _split_qkv(self, fused: torch.Tensor) -> list[torch.Tensor]:
        g, d, rest = self.groups, self.head_dim, fused.shape[1:]
        per = self.heads // g
        q, k, v = fused.reshape(g, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
        return [q.reshape(g * per * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)]

    # -------------------------------------------------------------------- whole state dicts
    def hf_to_mcore(self, hf_state: Mapping[str, torch.Tensor], tp_rank: int, tp_size: int, pp_rank: int,
                    pp_size: int, padded_vocab: int | None = None, *, ep_rank: int = 0, ep_size: int = 1,
                    etp_rank: int | None = None, etp_size: int | None = None) -> dict[str, torch.Tensor]:
        """Megatron state dict (local spec names) of TP rank `tp_rank`, pipeline stage `pp_rank`
        and, for MoE models, expert-parallel rank `ep_rank` / expert-TP rank `etp_rank` (None: TP's)."""
        etp_rank, etp_size = (tp_rank, tp_size) if etp_size is None else (etp_rank, etp_size)
        self.check_tp(tp_size)
        self.check_ep(ep_size, etp_size)
        check_hf_state(self, hf_state.keys(), lambda n: tuple(hf_state[n].shape))
        out = {}
        for pm in self.uniform_stage_maps(pp_rank, pp_size, ep_rank, ep_size):
            rank, size = (etp_rank, etp_size) if pm.expert is not None else (tp_rank, tp_size)
            out[pm.mcore] = self.to_mcore_shard(pm, [hf_state[n] for n in pm.hf], rank, size, padded_vocab)
        return out

    def mcore_to_hf(self, shards: Mapping[tuple, Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """HF state dict (canonical order) from every shard, keyed (tp_rank, pp_rank) or, with
        experts, (tp_rank, pp_rank, ep_rank, etp_rank): dense weights are read from any shard of
        their (tp, pp) coordinates, expert weights from any of their (pp, ep, etp) ones."""
        keys = [k if len(k) == 4 else (k[0], k[1], 0, 0) for k in shards]
        shards = dict(zip(keys, shards.values()))
        dense = {(t, p): s for (t, p, _, _), s in shards.items()}
        expert = {(p, e, r): s for (_, p, e, r), s in shards.items()}
        tp_size, pp_size = 1 + max(k[0] for k in keys), 1 + max(k[1] for k in keys)
        ep_size, etp_size = 1 + max(k[2] for k in keys), 1 + max(k[3] for k in keys)
        self.check_ep(ep_size, etp_size)
        missing = [(t, p) for t in range(tp_size) for p in range(pp_size) if (t, p) not in dense]
        missing += [(p, e, r) for p in range(pp_size) for e in range(ep_size) for r in range(etp_size)
                    if (p, e, r) not in expert]
        if missing:
            raise ValueError(f"shards: missing (tp_rank, pp_rank) / (pp_rank, ep_rank, etp_rank) entries {missing}")
        items = []
        for pp_rank in range(pp_size):
            for ep_rank in range(ep_size):
                for pm in self.uniform_stage_maps(pp_rank, pp_size, ep_rank, ep_size):
                    if (pm.mcore == "output_layer.weight" and self.tied) or (pm.expert is None and ep_rank):
                        continue  # the tied copy of the embedding; dense weights once
                    holders = ([expert[(pp_rank, ep_rank, r)] for r in range(etp_size)] if pm.expert is not None
                               else [dense[(t, pp_rank)] for t in range(tp_size)])
                    if any(pm.mcore not in h for h in holders):
                        raise ValueError(f"shards: {pm.mcore} (HF {pm.hf[0]}) is missing; the shards do not "
                                         f"form a TP {tp_size} x PP {pp_size} x EP {ep_size} x ETP {etp_size} layout")
                    parts = [h[pm.mcore] for h in holders]
                    items.append((pm.order, pm.hf, self.to_hf(pm, parts)))
        out = {}
        for _, names, tensors in sorted(items, key=lambda x: x[0]):
            out.update(zip(names, tensors))
        return out


def check_hf_state(adapter: ModelAdapter, names, shape_of) -> None:
    """ValueError listing missing, unexpected and wrongly shaped HF tensors (vs the config)."""
    expected = adapter.hf_shapes()
    names = set(names)
    ignored = {n for n in names if n.endswith(IGNORED_HF_SUFFIXES)}
    if adapter.tied:
        ignored.add("lm_head.weight")  # some tied checkpoints still store the copy
    missing = [n for n in expected if n not in names]
    unexpected = sorted(names - set(expected) - ignored)
    wrong = [f"{n}: checkpoint {tuple(shape_of(n))} vs config {s}" for n, s in expected.items()
             if n in names and tuple(shape_of(n)) != tuple(s)]
    problems = []
    for title, items in (("missing tensors", missing), ("unexpected tensors", unexpected), ("wrong shapes", wrong)):
        if items:
            shown = "\n    ".join(items[:30]) + (f"\n    ... and {len(items) - 30} more" if len(items) > 30 else "")
            problems.append(f"  {title} ({len(items)}):\n    {shown}")
    if problems:
        raise ValueError(f"HF checkpoint does not match the {adapter.arch} config:\n" + "\n".join(problems))

