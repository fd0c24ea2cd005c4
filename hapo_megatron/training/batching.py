"""Turn per-sequence rollout data into padded micro-batches, balanced across data-parallel ranks.

Every rank holds the same per-sequence metadata (token ids, reward, advantage, group), so every
rank computes the same assignment from it: no collective is needed to agree on who trains on what.

Token layout of one sequence of prompt length P and response length R (tokens ``x_0..x_{P+R-1}``):
position ``t`` reads ``x_t`` and predicts ``labels[t] = x_{t+1}``; only positions whose label is a
response token count, i.e. ``loss_mask[t] = 1`` for ``t in [P-1, P+R-2]``. Per-response-token
values (rollout logprob, temperature) are placed at the position that predicts that token.
Sequences are right-padded (causal attention never looks at the padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from hapo_megatron.parallel.micro_batch import MicroBatch

PAD_ID = 0


@dataclass
class SequenceData:
    """One prompt+response sequence with its per-response-token data.

    ``rollout_logprobs`` and ``temperatures`` have one entry per response token (may be empty:
    then zeros / 1.0 are used). ``advantage`` is the sequence's (token-constant) advantage.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float = 0.0
    rollout_logprobs: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
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


def split_micro_batches(seqs: Sequence[SequenceData], *, micro_batch_size: int = 1,
                        max_tokens_per_micro_batch: int | None = None) -> list[list[SequenceData]]:
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


def _round_up(x: int, m: int) -> int:
    return ((x + m - 1) // m) * m


def collate(seqs: Sequence[SequenceData], *, pad_multiple: int = 1) -> MicroBatch:
    """Pad sequences into a `MicroBatch` of ``[b, s]`` tensors.

    Sets ``input_ids``, ``position_ids``, ``labels`` (int64), ``loss_mask``, ``advantages``,
    ``rollout_logprobs``, ``temperatures`` (float32), ``seq_index`` ``[b]`` (int64, -1 for
    dummies) and ``engine_temperatures`` ``[b]`` (the sequence came with temperatures). ``s`` is
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
    for i, x in enumerate(seqs):
        toks = torch.tensor(list(x.prompt_ids) + list(x.response_ids), dtype=torch.long)
        n, p, r = len(toks), len(x.prompt_ids), len(x.response_ids)
        input_ids[i, :n] = toks
        labels[i, : n - 1] = toks[1:]
        if r == 0 or x.index < 0 or p == 0:
            continue
        sl = slice(p - 1, p - 1 + r)  # positions predicting the response tokens
        loss_mask[i, sl] = 1.0
        advantages[i, sl] = float(x.advantage)
        if x.rollout_logprobs:
            rollout_lp[i, sl] = torch.tensor(x.rollout_logprobs, dtype=torch.float32)
        if x.temperatures:
            temps[i, sl] = torch.tensor(x.temperatures, dtype=torch.float32)
    return MicroBatch(
        input_ids=input_ids,
        position_ids=torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous(),
        labels=labels, loss_mask=loss_mask, advantages=advantages, rollout_logprobs=rollout_lp,
        temperatures=temps, seq_index=torch.tensor([x.index for x in seqs], dtype=torch.long),
        engine_temperatures=torch.tensor([x.index >= 0 and len(x.temperatures) > 0 for x in seqs],
                                         dtype=torch.bool))


def dummy_sequence(template: SequenceData) -> SequenceData:
    """An all-masked filler so a data-parallel rank never gets an empty mini-batch."""
    return SequenceData(prompt_ids=list(template.prompt_ids[:1]) or [PAD_ID],
                        response_ids=list(template.response_ids[:1]), index=-1)


def build_rank_micro_batches(seqs: Sequence[SequenceData], *, dp_rank: int, dp_size: int,
                             micro_batch_size: int = 1, max_tokens_per_micro_batch: int | None = None,
                             pad_multiple: int = 1) -> list[MicroBatch]:
    """This data-parallel rank's padded micro-batches for one (mini-)batch of sequences.

    The split is `balance_partitions` by token count (identical on every rank); a rank left
    without a sequence gets one all-masked dummy so every rank runs at least one micro-batch.
    """
    if not seqs:
        raise ValueError("seqs must not be empty")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    parts = balance_partitions([x.num_tokens for x in seqs], dp_size)
    mine = [seqs[i] for i in parts[dp_rank]] or [dummy_sequence(seqs[0])]
    groups = split_micro_batches(mine, micro_batch_size=micro_batch_size,
                                 max_tokens_per_micro_batch=max_tokens_per_micro_batch)
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
