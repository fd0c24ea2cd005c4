"""Each rank's share of a step's kept rollout: every sequence's per-sequence fields (`SequenceMeta`:
rewards, lengths, groups, for advantages, metrics and diagnostics) and the per-token data of only
the sequences it trains on (`RankBatch`).

Which sequences a data-parallel rank trains on is a pure function of the per-sequence metadata
(`step_plan`: PPO mini-batches, then `batching.plan_micro_batches` in each), so rank 0 computes
every rank's part and sends it to that rank alone (`stages.rollout`); ranks of the same DP
group at other TP/PP/CP positions get the same part, except for a MoE model's routes, of which a
pipeline stage gets its own layers (`route_share`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from hapo_megatron.training.batches.micro_batches import SequenceData, plan_micro_batches, split_mini_batches
from hapo_megatron.training.batches.rollout_batch import RolloutBatch


@dataclass
class SequenceMeta:
    """Per-sequence fields of a `RolloutBatch` (the same names), without its per-token data."""

    group_ids: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    accs: list[bool] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    data_sources: list[str] = field(default_factory=list)
    prompt_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    response_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # [B, 2]: the first prompt and the first response token (-1: none), what a rank's all-masked
    # filler copies (`batching.dummy_sequence`) without holding the sequence
    head_ids: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))

    @staticmethod
    def of(batch: RolloutBatch) -> "SequenceMeta":
        return SequenceMeta(group_ids=list(batch.group_ids), scores=list(batch.scores), accs=list(batch.accs),
                            rewards=list(batch.rewards), finish_reasons=list(batch.finish_reasons),
                            data_sources=list(batch.data_sources), prompt_lengths=batch.prompt_lengths.copy(),
                            response_lengths=batch.response_lengths.copy(),
                            head_ids=np.stack([_first(batch.prompt_ids), _first(batch.response_ids)], axis=1))

    def __len__(self) -> int:
        return len(self.group_ids)

    @property
    def num_tokens(self) -> np.ndarray:
        """Prompt + response tokens of each sequence."""
        return self.prompt_lengths + self.response_lengths

    def head(self, i: int) -> SequenceData:
        """Sequence ``i`` cut to its first prompt and first response token: enough for a filler."""
        p, r = (int(x) for x in self.head_ids[i])
        return SequenceData(prompt_ids=[p] if p >= 0 else [], response_ids=[r] if r >= 0 else [], index=int(i))


def _first(rows) -> np.ndarray:
    """Each row's first value, -1 for an empty row."""
    lengths = rows.lengths
    out = np.full(len(lengths), -1, np.int64)
    out[lengths > 0] = rows.flat[rows.offsets[:-1][lengths > 0]]
    return out


@dataclass
class RankBatch:
    """One rank's share: ``meta`` of every sequence, the per-token data (``tokens``, a
    `RolloutBatch` of those rows) of the sequences ``held`` (global indices, ascending)."""

    meta: SequenceMeta
    held: np.ndarray
    tokens: RolloutBatch

    @staticmethod
    def whole(batch: RolloutBatch) -> "RankBatch":
        return RankBatch(SequenceMeta.of(batch), np.arange(len(batch)), batch)

    def __len__(self) -> int:
        return len(self.meta)

    def sequence(self, i: int, advantage: float = 0.0) -> SequenceData:
        """Global sequence ``i`` (it must be held) for the layout, its rows as array views."""
        k = int(np.searchsorted(self.held, i))
        if k >= len(self.held) or self.held[k] != i:
            raise KeyError(f"sequence {i} is not held by this rank (it holds {len(self.held)} of {len(self)})")
        t = self.tokens
        return SequenceData(prompt_ids=t.prompt_ids[k], response_ids=t.response_ids[k], advantage=float(advantage),
                            rollout_logprobs=t.rollout_logprobs[k], temperatures=t.temperatures[k],
                            routed_experts=t.column("routed_experts")[k], index=int(i))


# one PPO mini-batch: its sequences (global indices) and plan[rank][micro_batch] (positions in them)
MiniPlan = tuple[list[int], list[list[list[int]]]]


def step_plan(meta: SequenceMeta, *, ppo_mini_batch_size: int, dp_size: int, micro_batch_size: int,
              max_tokens_per_micro_batch: Optional[int], pack: bool) -> list[MiniPlan]:
    """The step's PPO mini-batches (`split_mini_batches`, groups in order) and each one's
    micro-batch plan over the DP ranks (`plan_micro_batches` of the sequences' token counts).
    The same on every rank."""
    minis = split_mini_batches(list(dict.fromkeys(meta.group_ids)), meta.group_ids, ppo_mini_batch_size)
    tokens = meta.num_tokens
    return [(idx, plan_micro_batches([int(tokens[i]) for i in idx], dp_size=dp_size, micro_batch_size=micro_batch_size,
                                     max_tokens_per_micro_batch=max_tokens_per_micro_batch, pack=pack))
            for idx in minis]


def held_sequences(plans: Sequence[MiniPlan], dp_rank: int) -> np.ndarray:
    """Global indices (ascending) of the sequences DP rank ``dp_rank`` trains on."""
    out = sorted(idx[j] for idx, plan in plans for b in plan[dp_rank] for j in b)
    return np.asarray(out, dtype=np.int64)


def split_for_ranks(batch: RolloutBatch, plans: Sequence[MiniPlan], dp_size: int) -> list[RolloutBatch]:
    """Each DP rank's per-token part of ``batch`` (with its `held_sequences`), as `RankBatch.tokens`."""
    return [batch.select(held_sequences(plans, d)) for d in range(dp_size)]


__all__ = ["MiniPlan", "RankBatch", "SequenceMeta", "held_sequences", "split_for_ranks", "step_plan"]
