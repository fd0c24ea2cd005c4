"""Token entropy, entropy statistics and the normalised entropy `h_hat`.

The math: docs/algorithm.md, section "Normalised entropy `h_hat`".

Pure torch. The statistics `(pivot, std, pos_max, neg_min)` are computed in float64 over the
log-entropies of a set of valid tokens and stored as Python floats, so they can be all-reduced,
logged, checkpointed (JSON) and shipped to rollout engines.

`h_hat_mode`:
- ``"signed"`` (default, the paper's design): ``h_hat = z / pos_max`` for ``z > 0`` and
  ``z / |neg_min|`` for ``z <= 0`` -> low-entropy tokens get a NEGATIVE `h_hat`.
- ``"reference"``: reproduces the public implementation's sign defect, ``z * (1 / neg_min)`` for
  ``z <= 0`` (``neg_min < 0``), so low-entropy tokens get a POSITIVE `h_hat`.
Both are clamped to ``[-1, 1]``.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence, Union

import torch

from hapo_megatron.algo.choices import H_HAT_MODES

#: floor on the entropy before the log, on the mean square deviation, and on |pos_max|, |neg_min|
ENTROPY_FLOOR = 1e-8
STD_SQ_FLOOR = 1e-8
Z_EXTREME_FLOOR = 1e-8

_FIELDS = ("pivot", "std", "pos_max", "neg_min")


def check_h_hat_mode(h_hat_mode: str) -> None:
    """The one check of ``h_hat_mode`` (the config, the engines and the SGLang processor call it)."""
    if h_hat_mode not in H_HAT_MODES:
        raise ValueError(f"h_hat_mode must be one of {H_HAT_MODES}, got {h_hat_mode!r}")


def _check_entropy_pivot(entropy_pivot: float) -> float:
    q = float(entropy_pivot)
    if not (0.0 < q < 1.0):
        raise ValueError(f"entropy_pivot must lie in the open interval (0, 1), got {entropy_pivot!r}")
    return q


def token_entropy(logits: torch.Tensor, temperature: Union[float, torch.Tensor]) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last dim.

    Args:
        logits: ``[..., V]`` (any float dtype). ``-inf`` entries (masked vocabulary) contribute 0.
        temperature: a positive float, or a tensor of shape ``logits.shape[:-1]`` (one per row).

    Returns:
        ``[...]`` float32 entropy (nats), differentiable. Stable for huge logits (uses
        ``log_softmax``). A row whose logits are all ``-inf`` gets entropy 0.
    """
    if not torch.is_tensor(logits) or logits.ndim < 1:
        raise ValueError("logits must be a tensor with at least 1 dim [..., V]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating tensor, got dtype {logits.dtype}")
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(compute_dtype)
    if torch.is_tensor(temperature):
        if temperature.shape != logits.shape[:-1]:
            raise ValueError(
                f"temperature tensor must have shape {tuple(logits.shape[:-1])}, got {tuple(temperature.shape)}"
            )
        if not bool(torch.all(temperature > 0)):
            raise ValueError("temperature must be > 0 everywhere")
        z = z / temperature.to(compute_dtype).unsqueeze(-1)
    else:
        if not (float(temperature) > 0 and math.isfinite(float(temperature))):
            raise ValueError(f"temperature must be a finite float > 0, got {temperature!r}")
        if float(temperature) != 1.0:
            z = z / float(temperature)
    return entropy_of_scaled_logits(z)


def entropy_of_scaled_logits(z: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(z)`` over the last dim (no checks, no temperature), ``[...]`` float32."""
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    # p * logp is 0 * -inf = nan where p == 0 (masked or underflowed entries): zero the log
    # first so both the value and its gradient stay finite.
    safe_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    ent = -(p * safe_logp).sum(dim=-1)
    # all -inf row: log_softmax is nan everywhere -> define entropy 0
    ent = torch.nan_to_num(ent, nan=0.0)
    return ent.to(torch.float32)


@dataclass(frozen=True)
class EntropyStats:
    """The entropy statistics of a token set (docs/algorithm.md, "Normalised entropy"), as Python floats.

    Attributes:
        pivot: the ``entropy_pivot`` quantile of the log-entropies.
        std: RMS of ``log_entropy - pivot`` (floor ``sqrt(1e-8)``), > 0.
        pos_max: largest positive ``z`` (floor 1e-8), > 0.
        neg_min: smallest negative ``z`` (ceiling -1e-8), < 0.

    The neutral statistics (:meth:`neutral`) have ``pos_max = +inf`` and ``neg_min = -inf`` so that
    every entropy maps to ``h_hat == 0`` in both modes without a flag. JSON has no infinity, so
    :meth:`to_dict` encodes non-finite values as the strings ``"inf"`` / ``"-inf"`` and
    :meth:`from_dict` accepts those strings (``json.dumps(s.to_dict(), allow_nan=False)`` works).
    """

    pivot: float
    std: float
    pos_max: float
    neg_min: float

    def __post_init__(self) -> None:
        for name in _FIELDS:
            v = getattr(self, name)
            if torch.is_tensor(v):
                v = v.item()
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise ValueError(f"EntropyStats.{name} must be a float, got {v!r}") from None
            if math.isnan(v):
                raise ValueError(f"EntropyStats.{name} must not be NaN")
            object.__setattr__(self, name, v)
        if not math.isfinite(self.pivot):
            raise ValueError(f"EntropyStats.pivot must be finite, got {self.pivot}")
        if not (self.std > 0 and math.isfinite(self.std)):
            raise ValueError(f"EntropyStats.std must be finite and > 0, got {self.std}")
        if not self.pos_max > 0:
            raise ValueError(f"EntropyStats.pos_max must be > 0, got {self.pos_max}")
        if not self.neg_min < 0:
            raise ValueError(f"EntropyStats.neg_min must be < 0, got {self.neg_min}")

    @classmethod
    def neutral(cls) -> "EntropyStats":
        """Statistics mapping every entropy to ``h_hat = 0`` (used when no token is valid)."""
        return cls(pivot=0.0, std=1.0, pos_max=math.inf, neg_min=-math.inf)

    @property
    def is_neutral(self) -> bool:
        return math.isinf(self.pos_max) and math.isinf(self.neg_min)

    def to_dict(self) -> dict:
        """JSON-safe dict; non-finite floats become the strings "inf" / "-inf"."""
        out = {}
        for k, v in asdict(self).items():
            out[k] = v if math.isfinite(v) else ("inf" if v > 0 else "-inf")
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "EntropyStats":
        """Inverse of :meth:`to_dict` (also accepts plain floats, extra keys are rejected)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"EntropyStats.from_dict expects a mapping, got {type(d).__name__}")
        missing = [k for k in _FIELDS if k not in d]
        extra = [k for k in d if k not in _FIELDS]
        if missing or extra:
            raise ValueError(f"EntropyStats dict: missing keys {missing}, unknown keys {extra}")
        return cls(**{k: float(d[k]) for k in _FIELDS})

    def as_tuple(self) -> tuple:
        return (self.pivot, self.std, self.pos_max, self.neg_min)


def nearest_rank_index(num_items: int, entropy_pivot: float) -> int:
    """0-based ascending rank of the ``entropy_pivot`` quantile: ``round(q * (n - 1))``.

    Python's ``round`` (ties to even), as the spec says. Distributed callers use this to find the
    global pivot with an exact selection over ranks.
    """
    q = _check_entropy_pivot(entropy_pivot)
    if int(num_items) < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    return int(round(q * (int(num_items) - 1)))


def log_entropy(entropy: torch.Tensor) -> torch.Tensor:
    """``log(max(H, 1e-8))`` in float64 (the quantity the statistics are taken over)."""
    return torch.log(entropy.detach().to(torch.float64).clamp_min(ENTROPY_FLOOR))


def stats_from_reductions(pivot: float, sum_sq_dev: float, count: int, max_dev: float, min_dev: float) -> EntropyStats:
    """Finish the statistics from reductions of ``d = log_entropy - pivot`` over the token set.

    Args:
        pivot: the quantile (a float), sum_sq_dev: ``sum d^2``, count: ``|S| >= 1``,
        max_dev / min_dev: ``max d`` / ``min d``.
    Exactly what :func:`compute_entropy_stats` computes (``max z = max d / std`` since division by a
    positive number is monotone), so a distributed caller that all-reduces SUM(d^2), count,
    MAX(d), MIN(d) gets bit-identical stats.
    """
    if int(count) < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    std = math.sqrt(max(float(sum_sq_dev) / int(count), STD_SQ_FLOOR))
    pos_max = max(float(max_dev) / std, Z_EXTREME_FLOOR) if float(max_dev) > 0 else Z_EXTREME_FLOOR
    neg_min = min(float(min_dev) / std, -Z_EXTREME_FLOOR) if float(min_dev) < 0 else -Z_EXTREME_FLOOR
    return EntropyStats(pivot=float(pivot), std=std, pos_max=pos_max, neg_min=neg_min)


def compute_entropy_stats(entropy: torch.Tensor, mask: torch.Tensor, entropy_pivot: float) -> EntropyStats:
    """Entropy statistics over the valid tokens (docs/algorithm.md, "Normalised entropy"), in float64.

    Args:
        entropy: ``[...]`` per-token entropies (any float dtype, e.g. ``[B, T]``).
        mask: same shape, bool or 0/1; nonzero = valid token.
        entropy_pivot: quantile ``q`` in (0, 1).

    Returns:
        :class:`EntropyStats`. With no valid token: :meth:`EntropyStats.neutral` and a warning.
    """
    q = _check_entropy_pivot(entropy_pivot)
    if not torch.is_tensor(entropy) or not torch.is_tensor(mask):
        raise ValueError("entropy and mask must be tensors")
    if entropy.shape != mask.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != entropy shape {tuple(entropy.shape)}")
    x = log_entropy(entropy)[mask.detach() != 0]
    n = int(x.numel())
    if n == 0:
        warnings.warn("compute_entropy_stats: no valid token; returning neutral statistics (h_hat = 0)")
        return EntropyStats.neutral()
    if not bool(torch.isfinite(x).all()):
        raise ValueError("entropy has non-finite values at valid (mask != 0) positions")
    k = nearest_rank_index(n, q)
    pivot = torch.kthvalue(x, k + 1).values  # kthvalue is 1-based
    d = x - pivot
    return stats_from_reductions(
        pivot=pivot.item(), sum_sq_dev=math.fsum((d * d).tolist()), count=n,  # correctly rounded: layout-independent
        max_dev=d.max().item(), min_dev=d.min().item(),
    )


StatsLike = Union[EntropyStats, Mapping[str, Any], Sequence[Any]]


def _stats_values(stats: StatsLike):
    """(pivot, std, pos_max, neg_min), each a float or 0-dim tensor."""
    if isinstance(stats, EntropyStats):
        return stats.as_tuple()
    if isinstance(stats, Mapping):
        return EntropyStats.from_dict(stats).as_tuple()
    if isinstance(stats, (tuple, list)) and len(stats) == 4:
        return tuple(stats)
    raise ValueError(f"stats must be EntropyStats, a dict or a 4-tuple, got {type(stats).__name__}")


def h_hat_from_log_entropy(x: torch.Tensor, stats: StatsLike, h_hat_mode: str) -> torch.Tensor:
    """``h_hat`` (float64, clamped to [-1, 1]) from float64 log-entropies ``x`` (internal)."""
    check_h_hat_mode(h_hat_mode)
    pivot, std, pos_max, neg_min = _stats_values(stats)
    z = (x - pivot) / std
    pos = z / pos_max
    if h_hat_mode == "signed":
        neg = z / abs(neg_min)
    else:  # the public implementation: scale_neg = 1 / neg_min (< 0) -> positive h_hat
        neg = z * (1.0 / neg_min)
    h = torch.where(z > 0, pos, neg).clamp(-1.0, 1.0)
    return h + 0.0  # turn -0.0 into 0.0


def normalize_entropy(entropy: torch.Tensor, stats: StatsLike, h_hat_mode: str) -> torch.Tensor:
    """Normalised entropy ``h_hat`` in ``[-1, 1]`` (docs/algorithm.md, "Normalised entropy `h_hat`").

    Args:
        entropy: ``[...]`` entropies (float tensor, or a float).
        stats: :class:`EntropyStats`, its dict, or a 4-tuple ``(pivot, std, pos_max, neg_min)`` of
            floats or 0-dim tensors.
        h_hat_mode: ``"signed"`` or ``"reference"`` (see module docstring).

    Returns:
        ``[...]`` float32, detached (h_hat never carries gradient).
    """
    check_h_hat_mode(h_hat_mode)
    if not torch.is_tensor(entropy):
        entropy = torch.tensor(float(entropy))
    vals = _stats_values(stats)
    vals = tuple(v.detach().to(torch.float64) if torch.is_tensor(v) else float(v) for v in vals)
    return h_hat_from_log_entropy(log_entropy(entropy), vals, h_hat_mode).to(torch.float32)
