"""EDGE-GRPO's entropy-driven advantage (EDA; Zhang et al., arXiv 2507.21848; docs/algorithm.md,
"EDGE-GRPO").

Each response ``i`` of a group ``g`` has its mean token entropy ``P_i`` (over its valid tokens, the
policy that generated the batch, at the base temperature). Its advantage is divided by ``P_i``
normalised by the group's mean:

    A_i' = A_i / (P_i / mean_{j in g} P_j) = A_i * mean_{j in g} P_j / P_i

so among correct responses (``A > 0``) the confident (low-entropy) ones get more credit, and among
wrong ones (``A < 0``) the confident ones get the larger penalty: the advantage's sign carries the
correctness. The group mean counts the responses with a valid token; ``P_i`` is floored at
``EDA_ENTROPY_FLOOR``; a response without a valid token keeps factor 1.
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

from hapo_megatron.algo.advantages import group_index

#: floor of a response's mean entropy in the division (a fully deterministic response)
EDA_ENTROPY_FLOOR = 1e-6


def sequence_entropy_sums(entropy: torch.Tensor, mask: torch.Tensor, seq_of_token: torch.Tensor,
                          num_seqs: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float64 ``[num_seqs]`` sums of the valid tokens' entropies and their counts, by the
    sequence index of each token (``seq_of_token``, same shape; negative = no sequence)."""
    valid = (mask.detach() != 0) & (seq_of_token >= 0)
    idx = seq_of_token[valid].long()
    e = entropy.detach().to(torch.float64)[valid]
    sums = torch.zeros(num_seqs, dtype=torch.float64, device=entropy.device).index_add_(0, idx, e)
    cnt = torch.zeros(num_seqs, dtype=torch.float64, device=entropy.device).index_add_(
        0, idx, torch.ones_like(e))
    return sums, cnt


def eda_scales(entropy_sums: torch.Tensor, lengths: torch.Tensor, group_ids: Sequence) -> torch.Tensor:
    """Float64 ``[N]``: each response's factor ``mean_g P / P_i`` (1 for a response without a valid
    token), ``P_i = entropy_sums_i / lengths_i``."""
    s, n = entropy_sums.to(torch.float64), lengths.to(torch.float64)
    has = n > 0
    p = torch.where(has, s / n.clamp_min(1.0), torch.zeros_like(s)).clamp_min(0.0)
    gidx, ng = group_index(group_ids, s.shape[0], s.device)
    gsum = torch.zeros(ng, dtype=torch.float64, device=s.device).index_add_(0, gidx, torch.where(has, p, 0.0 * p))
    gcnt = torch.zeros(ng, dtype=torch.float64, device=s.device).index_add_(0, gidx, has.to(torch.float64))
    gmean = gsum / gcnt.clamp_min(1.0)
    return torch.where(has, gmean[gidx] / p.clamp_min(EDA_ENTROPY_FLOOR), torch.ones_like(s))
