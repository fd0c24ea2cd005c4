"""Exact global entropy statistics over data x context parallel ranks, and global token counts.

`global_entropy_stats(entropy, mask, group=...)` returns what
`hapo_megatron.algo.compute_entropy_stats` returns on the concatenation of every rank's valid
tokens, without gathering the entropies, in exactly 6 collectives whatever the token count:

1. MAX all-reduce of `[max x, -min x]` (float64; `x = log(max(H, 1e-8))`).
2-5. Radix select of the pivot: the float64 `x` map to order-preserving 64-bit integer keys;
   four rounds each SUM-all-reduce a 65536-bin histogram of the next 16 key bits among the
   tokens whose higher bits match the prefix chosen so far, and pick the bin holding the
   target rank `k = round(q * (n - 1))`. After four rounds all 64 bits are known: the pivot
   is exactly the k-th smallest `x` (ties and duplicates included). The first histogram also
   gives the global count `n`.
6. SUM all-reduce of an exact fixed-point accumulator of `sum (x - pivot)^2`: every float64
   term `d^2` is split into 32-bit integer limbs of one 2^-1126-scaled super-accumulator
   (`int64 [69]`), so the global sum is exact and independent of the order and of the
   layout; it is rounded once to float64 (correct rounding, like `math.fsum`).

`max d = max x - pivot` and `min d` (subtraction and division by `std > 0` are monotone, so the
extremes of `z` come from the extremes of `x`) finish the statistics through
`algo.stats_from_reductions`, the same float64 code as the single-process path.

Exactness: `pivot` is bit-identical to the single-process value. `std`, `pos_max`, `neg_min`
are bit-identical to the single-process formula evaluated with a correctly rounded sum
(`math.fsum`) and identical across every layout; `compute_entropy_stats` sums `d^2` with
torch's float64 `sum`, whose rounding may differ from the correctly rounded sum by a few ulp
(relative ~1e-16 per term order), so against it the agreement is to relative 1e-14.
"""

from __future__ import annotations

import warnings
from fractions import Fraction
from typing import Optional

import torch
import torch.distributed as dist

from hapo_megatron.algo.entropy import (
    EntropyStats,
    _check_entropy_pivot,
    log_entropy,
    nearest_rank_index,
    stats_from_reductions,
)
from hapo_megatron.algo.forking import check_forking_rho, forking_rank
from hapo_megatron.parallel.collectives import all_reduce_tensor

_DIGIT_BITS = 16
_ROUNDS = 64 // _DIGIT_BITS
_BINS = 1 << _DIGIT_BITS
# Exact float64 accumulation: |v| = m * 2^(e - 53) with m < 2^53 and e - 53 >= -1126.
_FX_OFFSET = 1126
_LIMB_BITS = 32
_NUM_LIMBS = (2048 + _FX_OFFSET) // _LIMB_BITS + 3
_LIMB_MASK = (1 << _LIMB_BITS) - 1


def _active(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _all_reduce(t: torch.Tensor, group, op=None) -> torch.Tensor:
    if _active(group):
        all_reduce_tensor(t, group, op)  # checks the device against the group's backend
    return t


def global_token_count(mask: torch.Tensor, *, group=None) -> int:
    """Number of nonzero entries of `mask` summed over the ranks of `group` (one all-reduce)."""
    n = torch.tensor([int((mask.detach() != 0).sum())], dtype=torch.int64, device=mask.device)
    return int(_all_reduce(n, group)[0])


def global_sum(values: torch.Tensor, *, group=None) -> torch.Tensor:
    """SUM all-reduce of a copy of `values` over `group` (the input is untouched)."""
    return _all_reduce(values.detach().clone(), group)


# ---- order-preserving keys of float64 values -------------------------------------------------

def _float_to_key(x: torch.Tensor) -> torch.Tensor:
    """float64 -> int64 keys whose *unsigned* order (after flipping the sign bit) is x's order."""
    bits = (x + 0.0).view(torch.int64)  # + 0.0 turns -0.0 into +0.0
    # Negative floats: flip magnitude bits so larger magnitude -> smaller key. Then flip the sign
    # bit so that the 64-bit pattern read as unsigned is monotone in x.
    flipped = torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)
    return flipped ^ (-(1 << 63))


def _key_to_float(key: int) -> float:
    """Inverse of `_float_to_key` for one key given as an unsigned Python int in [0, 2^64)."""
    signed = key - (1 << 64) if key >= (1 << 63) else key  # the int64 pattern
    bits = signed ^ (-(1 << 63))  # undo the sign-bit flip
    if bits < 0:
        bits ^= 0x7FFFFFFFFFFFFFFF
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64)[0])


def _digit(keys: torch.Tensor, round_idx: int) -> torch.Tensor:
    shift = 64 - _DIGIT_BITS * (round_idx + 1)
    return (keys >> shift) & (_BINS - 1)


def _select_pivot(keys: torch.Tensor, entropy_pivot: float, group, rank_of=None) -> tuple[Optional[int], int]:
    """Radix select of the `entropy_pivot` nearest-rank quantile: (unsigned key or None, n);
    `rank_of(n)` instead picks the element of that 0-based ascending rank."""
    cand = keys
    prefix = 0
    k = None
    n = 0
    for r in range(_ROUNDS):
        hist = torch.bincount(_digit(cand, r), minlength=_BINS) if cand.numel() else \
            torch.zeros(_BINS, dtype=torch.int64, device=keys.device)
        hist = _all_reduce(hist.to(torch.int64), group)
        if r == 0:
            n = int(hist.sum())
            if n == 0:
                return None, 0
            k = nearest_rank_index(n, entropy_pivot) if rank_of is None else rank_of(n)
        cum = torch.cumsum(hist, 0)
        b = int(torch.searchsorted(cum, torch.tensor([k], dtype=cum.dtype, device=cum.device),
                                   right=True)[0])
        k -= int(cum[b - 1]) if b > 0 else 0
        prefix = (prefix << _DIGIT_BITS) | b
        cand = cand[_digit(cand, r) == b]
    return prefix, n


# ---- exact float64 summation -----------------------------------------------------------------

def _exact_limbs(v: torch.Tensor) -> torch.Tensor:
    """Exact fixed-point representation of `sum(v)` (finite float64 `[n]`) as int64 limbs.

    Limb i weighs 2^(32 i - 1126); each term adds four pieces < 2^32, so limbs cannot overflow
    below 2^31 terms in total."""
    acc = torch.zeros(_NUM_LIMBS, dtype=torch.int64, device=v.device)
    v = v[v != 0]
    if v.numel() == 0:
        return acc
    mant, exp = torch.frexp(v)  # v = mant * 2^exp, 0.5 <= |mant| < 1
    sign = torch.where(mant < 0, -1, 1).to(torch.int64)
    m = torch.ldexp(mant.abs(), torch.tensor(53, device=v.device)).to(torch.int64)  # exact, < 2^53
    s = exp.to(torch.int64) - 53 + _FX_OFFSET  # >= 0 for every float64 incl. subnormals
    idx, shift = s // _LIMB_BITS, s % _LIMB_BITS
    lo = (m & _LIMB_MASK) << shift  # < 2^63
    hi = (m >> _LIMB_BITS) << shift  # < 2^52
    for piece, off in ((lo & _LIMB_MASK, 0), (lo >> _LIMB_BITS, 1),
                       (hi & _LIMB_MASK, 1), (hi >> _LIMB_BITS, 2)):
        acc.index_add_(0, idx + off, sign * piece)
    return acc


def _limbs_to_float(acc: torch.Tensor) -> float:
    """Correctly rounded float64 value of an exact limb accumulator."""
    total = 0
    for i, limb in enumerate(acc.tolist()):
        total += int(limb) << (_LIMB_BITS * i)
    return float(Fraction(total, 1 << _FX_OFFSET))


def exact_global_sum(values: torch.Tensor, *, group=None) -> float:
    """Correctly rounded float64 sum of finite `values` over all ranks (one all-reduce).

    Independent of the order of terms and of how they are split across ranks (= `math.fsum`)."""
    return _limbs_to_float(_all_reduce(_exact_limbs(values.detach().reshape(-1).double()), group))


# ---- the statistics ------------------------------------------------------------------------

def global_entropy_stats(entropy: torch.Tensor, mask: torch.Tensor, *, group=None,
                         entropy_pivot: float) -> EntropyStats:
    """Entropy statistics over every valid token of every rank of `group` (exact; 6 collectives).

    Args:
        entropy: `[...]` this rank's per-token entropies (any float dtype).
        mask: same shape, bool or 0/1; nonzero = valid. A rank may have no valid token (it
            still participates and gets the same answer).
        group: the ranks whose token sets together make the statistics' token set, each token
            held by exactly one rank: the trainer passes `ParallelGroups.dp` because its
            old-log-prob pass gathers CP chunks (every CP rank holds whole sequences); a
            caller whose ranks hold CP chunks passes `dp_cp`. None = this process.
        entropy_pivot: quantile `q` in (0, 1).

    Returns:
        `EntropyStats`, identical on every rank. No valid token anywhere: `EntropyStats.neutral()`
        and a warning.
    """
    _check_entropy_pivot(entropy_pivot)
    if not torch.is_tensor(entropy) or not torch.is_tensor(mask):
        raise ValueError("entropy and mask must be tensors")
    if entropy.shape != mask.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != entropy shape {tuple(entropy.shape)}")
    x = log_entropy(entropy)[mask.detach() != 0]
    if not bool(torch.isfinite(x).all()):
        raise ValueError("entropy has non-finite values at valid (mask != 0) positions")

    ext = torch.full((2,), float("-inf"), dtype=torch.float64, device=x.device)
    if x.numel():
        ext[0], ext[1] = x.max(), -x.min()
    ext = _all_reduce(ext, group, dist.ReduceOp.MAX if _active(group) else None).tolist()

    key, n = _select_pivot(_float_to_key(x), entropy_pivot, group)
    if key is None:
        warnings.warn("global_entropy_stats: no valid token on any rank; returning neutral "
                      "statistics (h_hat = 0)")
        return EntropyStats.neutral()
    pivot = _key_to_float(key)
    d = x - pivot
    sum_sq = exact_global_sum(d * d, group=group)
    return stats_from_reductions(pivot=pivot, sum_sq_dev=sum_sq, count=n,
                                 max_dev=ext[0] - pivot, min_dev=-ext[1] - pivot)


def global_forking_threshold(entropy: torch.Tensor, mask: torch.Tensor, *, group=None,
                             rho: float) -> Optional[float]:
    """`algo.forking_threshold` over every valid token of every rank of `group` (exact: the radix
    select above, 4 collectives; `group` as for `global_entropy_stats`). None when no rank has a
    valid token. Identical on every rank and for every layout."""
    check_forking_rho(rho)
    if not torch.is_tensor(entropy) or not torch.is_tensor(mask) or entropy.shape != mask.shape:
        raise ValueError("entropy and mask must be tensors of the same shape")
    x = log_entropy(entropy)[mask.detach() != 0]
    key, _ = _select_pivot(_float_to_key(x), 0.5, group, rank_of=lambda n: forking_rank(n, rho))
    return None if key is None else _key_to_float(key)
