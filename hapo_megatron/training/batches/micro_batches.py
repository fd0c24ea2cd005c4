"""Turn per-sequence rollout data into micro-batches, balanced across data-parallel ranks.

Every rank holds the same per-sequence metadata (token ids, reward, advantage, group), so every
rank computes the same assignment from it: no collective is needed to agree on who trains on what.

Token layout of one sequence of prompt length P and response length R (tokens ``x_0..x_{P+R-1}``):
position ``t`` reads ``x_t`` and predicts ``labels[t] = x_{t+1}``; only positions whose label is a
response token count, i.e. ``loss_mask[t] = 1`` for ``t in [P-1, P+R-2]``. Per-response-token
values (rollout logprob, temperature) are placed at the position that predicts that token.
Sequences are right-padded (causal attention never looks at the padding).

Two layouts (`MicroBatch`): padded, one sequence per row, or packed (``pack=True``): sequences
concatenated in one row up to ``max_tokens_per_micro_batch`` *real* tokens, each padded only to
the multiple the kernels need (`PadMultiples`), positions restarting per sequence. Which
sequences go to which rank and micro-batch is `plan_micro_batches`, a pure function of the
lengths; `token_efficiency` measures what the layout costs (real / computed tokens).

Every rank runs the same number of micro-batches (`equalize_micro_batch_counts`): with expert
parallelism each MoE layer's token dispatch is a collective over ranks of different data-parallel
replicas, once per micro-batch, so one rank running fewer would leave the others waiting. The
shorter lists get empty entries, built as all-masked fillers (`dummy_sequence`) that change no
loss, gradient or metric (docs/moe.md, "Micro-batch counts").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from hapo_megatron.models.routing_replay import NO_ROUTE
from hapo_megatron.parallel.micro_batch import MicroBatch

PAD_ID = 0


@dataclass
class SequenceData:
    """One prompt+response sequence with its per-response-token data.

    ``rollout_logprobs`` and ``temperatures`` have one entry per response token (may be empty:
    then zeros / 1.0 are used). ``advantage`` is the sequence's (token-constant) advantage.
    ``routed_experts``: the engine's experts of positions ``0 .. P + R - 2`` (`Sample.routed_experts`,
    flat or ``[positions, layers, top_k]``; empty: none, the actor routes by itself).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float = 0.0
    rollout_logprobs: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    routed_experts: Any = ()
    token_mask: Any = ()  # per response token, 1 = trains (empty: every token does; mask_prefix)
    index: int = -1  # position in the step's batch; -1 marks a dummy (all-masked) filler

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def balance_partitions(lengths: Sequence[int], num_parts: int, *, equal_size: bool = True) -> list[list[int]]:
    """Deterministically split sequence indices into ``num_parts`` parts of similar token count.

    Greedy longest-first: sort by (-length, index) and give each sequence to the lightest part
    (ties: lowest part id). With ``equal_size`` the part sizes differ by at most one. Each part's
    indices are returned in ascending order. Pure function of its inputs (same on every rank).
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    n = len(lengths)
    base, extra = divmod(n, num_parts)  # with equal_size: `extra` parts get base+1 items
    loads = [0] * num_parts
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    big_used = 0

    def can_take(p: int) -> bool:
        if not equal_size:
            return True
        size = len(parts[p])
        return size < base or (size == base and big_used < extra)

    for i in sorted(range(n), key=lambda j: (-int(lengths[j]), j)):
        best = min((p for p in range(num_parts) if can_take(p)), key=lambda p: (loads[p], p))
        if equal_size and len(parts[best]) == base:
            big_used += 1
        parts[best].append(i)
        loads[best] += int(lengths[i])
    return [sorted(p) for p in parts]


def split_micro_batches(seqs: Sequence[SequenceData], *, micro_batch_size: int,
                        max_tokens_per_micro_batch: int | None) -> list[list[SequenceData]]:
    """Group one rank's sequences into micro-batches (order kept).

    With ``max_tokens_per_micro_batch`` the grouping is by padded token count
    (``len(mb) * max_len <= max_tokens``, at least one sequence per micro-batch); otherwise
    by ``micro_batch_size`` sequences.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    out: list[list[SequenceData]] = []
    cur: list[SequenceData] = []
    cur_max = 0
    for s in seqs:
        if max_tokens_per_micro_batch is not None:
            new_max = max(cur_max, s.num_tokens)
            if cur and new_max * (len(cur) + 1) > max_tokens_per_micro_batch:
                out.append(cur)
                cur, new_max = [], s.num_tokens
            cur.append(s)
            cur_max = new_max
        else:
            cur.append(s)
            if len(cur) == micro_batch_size:
                out.append(cur)
                cur = []
    if cur:
        out.append(cur)
    return out


def pack_bins(items: Sequence[int], lengths: Sequence[int], num_bins: int) -> list[list[int]]:
    """Longest-first into the lightest of ``num_bins`` bins (ties: lowest bin), ``items`` indexing
    ``lengths``; each bin's items ascending, empty bins dropped. Pure function of its inputs."""
    loads = [0] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in sorted(items, key=lambda j: (-int(lengths[j]), j)):
        best = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[best].append(i)
        loads[best] += int(lengths[i])
    return [sorted(b) for b in bins if b]


def _fits(bins: list[list[int]], lengths: Sequence[int], budget: int) -> bool:
    # a sequence longer than the budget gets a micro-batch of its own (as the padded path does)
    return all(len(b) == 1 or sum(int(lengths[i]) for i in b) <= budget for b in bins)


def plan_micro_batches(lengths: Sequence[int], *, dp_size: int, micro_batch_size: int,
                       max_tokens_per_micro_batch: int | None,
                       pack: bool = False) -> list[list[list[int]]]:
    """Sequence indices of every data-parallel rank's micro-batches: ``plan[rank][mb]``.

    Padded: `balance_partitions` (equal counts, balanced tokens), then `split_micro_batches`.
    Packed: ranks balanced by tokens (`balance_partitions` without equal counts), then every rank
    splits its sequences into the same number ``k`` of micro-batches with `pack_bins`, ``k`` the
    smallest count that keeps every micro-batch of every rank within ``max_tokens_per_micro_batch``
    real tokens (so micro-batches are balanced within and across ranks). Identical on every rank.
    Both end with `equalize_micro_batch_counts`: an empty entry ``[]`` is a filler micro-batch.
    """
    if pack and max_tokens_per_micro_batch is None:
        raise ValueError("packing needs max_tokens_per_micro_batch (the real-token budget of a row)")
    n = len(lengths)
    parts = balance_partitions(lengths, dp_size, equal_size=not pack)
    if not pack:
        plan = []
        for p in parts:
            groups = split_micro_batches([_Len(int(lengths[i])) for i in p], micro_batch_size=micro_batch_size,
                                         max_tokens_per_micro_batch=max_tokens_per_micro_batch)
            starts = [sum(len(g) for g in groups[:j]) for j in range(len(groups))]
            plan.append([p[a:a + len(g)] for a, g in zip(starts, groups)])
        return equalize_micro_batch_counts(plan)
    budget = int(max_tokens_per_micro_batch)
    loads = [sum(int(lengths[i]) for i in p) for p in parts]
    k = max(1, -(-max(loads, default=0) // budget))
    while True:
        plan = [pack_bins(p, lengths, k) for p in parts]
        if all(_fits(bins, lengths, budget) for bins in plan) or k >= max(n, 1):
            return equalize_micro_batch_counts(plan)
        k += 1


def equalize_micro_batch_counts(plan: list[list[list[int]]]) -> list[list[list[int]]]:
    """``plan`` with every rank's list padded by empty micro-batches ``[]`` (fillers) to the
    longest list, at least one each. WHY every data-parallel rank and not only an expert-parallel
    group's: the plan of every rank is known everywhere, and the rule needs no group layout."""
    k = max([1] + [len(rank) for rank in plan])
    return [[list(b) for b in rank] + [[] for _ in range(k - len(rank))] for rank in plan]


class _Len:  # what split_micro_batches reads of a sequence: its token count
    def __init__(self, num_tokens: int):
        self.num_tokens = num_tokens


@dataclass(frozen=True)
class PadMultiples:
    """What a micro-batch's lengths must be multiples of, for the kernels: ``pad_multiple``, a
    padded row (sequence parallelism splits it over TP, context parallelism into ``2 * cp``
    chunks); ``seq_multiple`` / ``row_multiple``, each sequence of a packed row / the row: with
    context parallelism each sequence splits into ``2 * cp`` equal chunks (TE's THD split); with
    sequence parallelism each CP rank's share of the row splits over TP (the row: a multiple of
    ``tp * cp``). The row padding is added to its last sequence, so ``row_multiple`` is a
    multiple of ``seq_multiple``. Passed on as keywords: ``**pads.kwargs()``."""

    pad_multiple: int = 1
    seq_multiple: int = 1
    row_multiple: int = 1

    @staticmethod
    def of(*, tp_size: int, cp_size: int, sequence_parallel: bool) -> "PadMultiples":
        tp = tp_size if sequence_parallel and tp_size > 1 else 1  # sequence parallelism splits over TP
        cp = 2 * cp_size if cp_size > 1 else 1  # each sequence in 2 * cp chunks
        return PadMultiples(pad_multiple=math.lcm(tp, cp), seq_multiple=cp,
                            row_multiple=math.lcm(cp, tp * cp_size if tp > 1 else 1))

    def kwargs(self) -> dict[str, int]:
        return {"pad_multiple": self.pad_multiple, "seq_multiple": self.seq_multiple,
                "row_multiple": self.row_multiple}


def collate_packed(seqs: Sequence[SequenceData], *, seq_multiple: int = 1, row_multiple: int = 1) -> MicroBatch:
    """Concatenate sequences into one packed row (`MicroBatch` with ``cu_seqlens``).

    Each sequence keeps the token layout of `collate` within its span (labels shifted inside the
    sequence, never across), padded to a multiple of ``seq_multiple``; the last span also takes
    the padding that makes the row a multiple of ``row_multiple`` (itself a multiple of
    ``seq_multiple``). ``position_ids`` restart at 0 in every span.
    """
    if not seqs:
        raise ValueError("seqs must not be empty")
    if row_multiple % max(seq_multiple, 1):
        raise ValueError(f"row_multiple ({row_multiple}) must be a multiple of seq_multiple ({seq_multiple})")
    spans = [_round_up(max(x.num_tokens, 2), max(1, seq_multiple)) for x in seqs]
    spans[-1] += _round_up(sum(spans), max(1, row_multiple)) - sum(spans)
    rows = collate(seqs, pad_multiple=1)
    width = rows.seq_len
    cu = [0]
    for length in spans:
        cu.append(cu[-1] + length)
    total = cu[-1]
    seg = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(spans))
    pos = torch.arange(total) - torch.tensor(cu[:-1])[seg]
    take = pos < width  # positions of a span beyond the longest sequence are padding

    def pack(t: torch.Tensor, fill) -> torch.Tensor:  # [b, s, ...] rows -> [1, total, ...]
        out = torch.full((total,) + tuple(t.shape[2:]), fill, dtype=t.dtype)
        out[take] = t[seg[take], pos[take]]
        return out.unsqueeze(0)

    routes = rows.routed_experts
    return MicroBatch(
        input_ids=pack(rows.input_ids, PAD_ID), position_ids=pos.unsqueeze(0), labels=pack(rows.labels, PAD_ID),
        loss_mask=pack(rows.loss_mask, 0.0), advantages=pack(rows.advantages, 0.0),
        rollout_logprobs=pack(rows.rollout_logprobs, 0.0), temperatures=pack(rows.temperatures, 1.0),
        seq_index=rows.seq_index, engine_temperatures=rows.engine_temperatures,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), segment_ids=seg.unsqueeze(0),
        routed_experts=pack(routes, NO_ROUTE) if routes is not None else None,
        padding_mask=pack(rows.padding_mask, True))


def token_efficiency(plan: list[list[list[int]]], lengths: Sequence[int], *, pack: bool,
                     pad_multiple: int = 1, seq_multiple: int = 1, row_multiple: int = 1) -> dict[str, float]:
    """Real tokens / computed tokens of a `plan_micro_batches` plan over all ranks, the layout
    `build_rank_micro_batches` makes of it (``computed``: rows x padded length, or packed row
    lengths), the micro-batches per rank and the fillers among them (an empty entry, or a rank
    without any: one all-masked `dummy_sequence` of 2 tokens)."""
    real = computed = fillers = 0
    filler_tokens = _round_up(2, max(pad_multiple, row_multiple) if pack else pad_multiple)
    for bins in plan:
        for b in bins or [[]]:
            if not b:
                computed += filler_tokens
                fillers += 1
                continue
            ls = [int(lengths[i]) for i in b]
            real += sum(ls)
            if pack:
                spans = sum(_round_up(max(x, 2), seq_multiple) for x in ls)
                computed += _round_up(spans, row_multiple)
            else:
                computed += len(ls) * _round_up(max(max(ls), 2), pad_multiple)
    counts = [max(len(b), 1) for b in plan]
    return {"real_tokens": float(real), "computed_tokens": float(computed),
            "token_efficiency": real / computed if computed else 1.0,
            "micro_batches_per_rank_max": float(max(counts)), "micro_batches_per_rank_min": float(min(counts)),
            "filler_micro_batches": float(fillers)}


def _round_up(x: int, m: int) -> int:
    return ((x + m - 1) // m) * m


def collate(seqs: Sequence[SequenceData], *, pad_multiple: int = 1) -> MicroBatch:
    """Pad sequences into a `MicroBatch` of ``[b, s]`` tensors.

    Sets ``input_ids``, ``position_ids``, ``labels`` (int64), ``loss_mask``, ``advantages``,
    ``rollout_logprobs``, ``temperatures`` (float32), ``padding_mask`` (bool: past a sequence's
    tokens, and all of a dummy's), ``seq_index`` ``[b]`` (int64, -1 for dummies) and
    ``engine_temperatures`` ``[b]`` (the sequence came with temperatures). ``s`` is
    the longest sequence rounded up to ``pad_multiple`` (e.g. TP size with sequence parallelism,
    2*CP with context parallelism).
    """
    if not seqs:
        raise ValueError("seqs must not be empty")
    b = len(seqs)
    s = _round_up(max(max(x.num_tokens for x in seqs), 2), max(1, pad_multiple))
    input_ids = torch.full((b, s), PAD_ID, dtype=torch.long)
    labels = torch.full((b, s), PAD_ID, dtype=torch.long)
    loss_mask = torch.zeros(b, s)
    advantages = torch.zeros(b, s)
    rollout_lp = torch.zeros(b, s)
    temps = torch.ones(b, s)
    padding = torch.ones(b, s, dtype=torch.bool)
    for i, x in enumerate(seqs):  # rows may be lists or numpy arrays (a `Ragged` row): one conversion each
        toks = torch.from_numpy(np.concatenate([np.asarray(x.prompt_ids, dtype=np.int64).reshape(-1),
                                                np.asarray(x.response_ids, dtype=np.int64).reshape(-1)]))
        n, p, r = len(toks), len(x.prompt_ids), len(x.response_ids)
        input_ids[i, :n] = toks
        labels[i, : n - 1] = toks[1:]
        padding[i, :n] = x.index < 0  # a dummy's tokens are padding for the routers
        if r == 0 or x.index < 0 or p == 0:
            continue
        sl = slice(p - 1, p - 1 + r)  # positions predicting the response tokens
        loss_mask[i, sl] = 1.0
        if len(x.token_mask):
            loss_mask[i, sl] = torch.from_numpy(np.asarray(x.token_mask, dtype=np.float32).reshape(-1))
        advantages[i, sl] = float(x.advantage)
        if len(x.rollout_logprobs):
            rollout_lp[i, sl] = torch.from_numpy(np.asarray(x.rollout_logprobs, dtype=np.float32).reshape(-1))
        if len(x.temperatures):
            temps[i, sl] = torch.from_numpy(np.asarray(x.temperatures, dtype=np.float32).reshape(-1))
    return MicroBatch(
        input_ids=input_ids, routed_experts=collate_routes(seqs, s),
        position_ids=torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous(),
        labels=labels, loss_mask=loss_mask, advantages=advantages, rollout_logprobs=rollout_lp,
        temperatures=temps, padding_mask=padding, seq_index=torch.tensor([x.index for x in seqs], dtype=torch.long),
        engine_temperatures=torch.tensor([x.index >= 0 and len(x.temperatures) > 0 for x in seqs],
                                         dtype=torch.bool))


def collate_routes(seqs: Sequence[SequenceData], width: int) -> Optional[torch.Tensor]:
    """``[b, width, L * k]`` int16 of the sequences' `SequenceData.routed_experts` (position ``t``:
    the experts of input token ``t``), `NO_ROUTE` where a sequence has none; None when no
    sequence has routes. Every sequence with routes must have them for positions ``0 .. n - 2``."""
    flat = [np.asarray(x.routed_experts, dtype=np.int16).reshape(-1) for x in seqs]
    if not any(r.size for r in flat):
        return None
    first = next(i for i, r in enumerate(flat) if r.size)
    per_position = flat[first].size // max(seqs[first].num_tokens - 1, 1)  # layers x top-k
    bad = [x.index for x, r in zip(seqs, flat) if r.size and r.size != (x.num_tokens - 1) * per_position]
    if bad or per_position == 0:
        raise ValueError(f"routed_experts of sequences {bad or [seqs[first].index]} do not cover positions "
                         f"0 .. n-2 with {per_position} experts each (layers x top-k of the other sequences)")
    out = torch.full((len(seqs), width, per_position), NO_ROUTE, dtype=torch.int16)
    for i, (x, r) in enumerate(zip(seqs, flat)):
        if r.size:
            out[i, : x.num_tokens - 1] = torch.from_numpy(r.reshape(x.num_tokens - 1, -1))
    return out


def dummy_sequence(template: SequenceData) -> SequenceData:
    """An all-masked filler micro-batch's sequence (index -1: no loss, no metric; its tokens are
    padding for the MoE routers): the first prompt and response token of ``template``."""
    return SequenceData(prompt_ids=[int(t) for t in template.prompt_ids[:1]] or [PAD_ID],
                        response_ids=[int(t) for t in template.response_ids[:1]], index=-1)


def build_rank_micro_batches(seqs: Sequence[SequenceData], *, dp_rank: int, dp_size: int,
                             micro_batch_size: int, max_tokens_per_micro_batch: int | None,
                             pad_multiple: int = 1, pack: bool = False, seq_multiple: int = 1,
                             row_multiple: int = 1) -> list[MicroBatch]:
    """This data-parallel rank's micro-batches for one (mini-)batch of sequences: padded
    (`collate`, rows padded to ``pad_multiple``) or packed rows (`collate_packed` with
    ``seq_multiple`` / ``row_multiple``, see `PadMultiples`).

    The split is `plan_micro_batches` (identical on every rank, the same number of micro-batches
    on every rank): its empty entries become all-masked fillers copied from ``seqs[0]``.
    """
    if not seqs:
        raise ValueError("seqs must not be empty")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    plan = plan_micro_batches([x.num_tokens for x in seqs], dp_size=dp_size, micro_batch_size=micro_batch_size,
                              max_tokens_per_micro_batch=max_tokens_per_micro_batch, pack=pack)
    return collate_micro_batches([[seqs[i] for i in b] for b in plan[dp_rank]], seqs[0], pad_multiple=pad_multiple,
                                 pack=pack, seq_multiple=seq_multiple, row_multiple=row_multiple)


def collate_micro_batches(groups: Sequence[Sequence[SequenceData]], template: SequenceData, *,
                          pad_multiple: int = 1, pack: bool = False, seq_multiple: int = 1,
                          row_multiple: int = 1) -> list[MicroBatch]:
    """One micro-batch per group of sequences (a rank's part of a `plan_micro_batches` plan),
    padded or packed as in `build_rank_micro_batches`; an empty group (and no group at all) is one
    all-masked filler built from ``template`` (the mini-batch's first sequence, `dummy_sequence`)."""
    groups = [list(g) for g in groups] or [[]]
    if any(not g for g in groups):
        if template is None:
            raise ValueError("a filler micro-batch (an empty group) needs a template sequence")
        groups = [g or [dummy_sequence(template)] for g in groups]
    if pack:
        return [collate_packed(g, seq_multiple=seq_multiple, row_multiple=row_multiple) for g in groups]
    return [collate(g, pad_multiple=pad_multiple) for g in groups]


def split_mini_batches(group_order: Sequence[int], group_of_seq: Sequence[int],
                       prompts_per_mini_batch: int) -> list[list[int]]:
    """Sequence indices of each PPO mini-batch: consecutive chunks of ``prompts_per_mini_batch`` groups.

    ``group_order`` lists group ids in training order; every sequence of a group lands in the
    same mini-batch. The last mini-batch may be smaller.
    """
    if prompts_per_mini_batch < 1:
        raise ValueError(f"prompts_per_mini_batch must be >= 1, got {prompts_per_mini_batch}")
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(group_of_seq):
        by_group.setdefault(int(g), []).append(i)
    out = []
    for k in range(0, len(group_order), prompts_per_mini_batch):
        idx = [i for g in group_order[k:k + prompts_per_mini_batch] for i in by_group.get(int(g), [])]
        if idx:
            out.append(idx)
    return out
