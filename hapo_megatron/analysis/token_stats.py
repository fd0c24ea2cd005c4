"""Summable token diagnostics of HAPO (`TokenDiagnostics`), shared by training and offline analysis.

What the paper looks at to explain HAPO: the entropy histogram and the pivot, the share of
high-entropy tokens, clip fractions by side (left/right) and by entropy class (high/low), the
tokens most often clipped on each side (formatting vs reasoning tokens), the advantage magnitude
before/after redistribution by branch, the sampling temperatures and the response lengths.

`TokenDiagnostics` accumulates all of it in summable form (sums, counts, fixed-bin histograms,
token-id counters), so micro-batches, updates and ranks merge exactly with `merge()` /
`all_reduce()`; `summary()` turns it into a flat `{"diag/<name>": float}` dict for the metric
sinks. The clip flags and the redistributed advantages it counts are the loss's own
(`algo.PolicyTokenFields`); nothing here recomputes them.

Pure python/torch; `torch.distributed` only inside `all_reduce`.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

from hapo_megatron.parallel.collectives import all_gather_objects, all_reduce_tensor

# Fixed log-spaced entropy bins (nats): 4 per decade from 1e-6 to 10, plus an underflow bin
# [0, 1e-6) in front and an overflow bin [10, inf) at the end, so histograms of every step and
# every rank add up bin by bin.
ENTROPY_BIN_EDGES: tuple[float, ...] = tuple(10.0 ** (e / 4.0) for e in range(-24, 5))
NUM_ENTROPY_BINS = len(ENTROPY_BIN_EDGES) + 1

_CLASSES = ("high", "low")  # entropy class: h_hat > 0 is "high", h_hat <= 0 is "low"


def entropy_histogram(entropy: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Counts of `entropy[mask]` in the fixed bins: int64 `[NUM_ENTROPY_BINS]`.

    Bin 0 is `[0, 1e-6)`, bin i is `[edge[i-1], edge[i])`, the last is `[10, inf)`.
    """
    values = _select(entropy, mask).double()
    edges = torch.tensor(ENTROPY_BIN_EDGES, dtype=torch.float64)
    idx = torch.bucketize(values, edges, right=True)
    return torch.bincount(idx, minlength=NUM_ENTROPY_BINS).to(torch.int64)


def entropy_pivot(entropy: torch.Tensor, mask: torch.Tensor | None = None,
                  *, q: float) -> float:
    """The entropy at the pivot quantile (nearest rank `round(q * (n - 1))`, docs/algorithm.md).

    Returns nats (not log-entropy); NaN when there is no valid token.
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q}")
    values = _select(entropy, mask).double().clamp_min(1e-8)
    if values.numel() == 0:
        return float("nan")
    rank = round(q * (values.numel() - 1))
    return float(torch.sort(values).values[rank])


def _select(t: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return t.reshape(-1)
    if mask.shape != t.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != tensor shape {tuple(t.shape)}")
    return t[mask.bool()]


def _zeros(n: int = 2) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float64)


@dataclass
class TokenDiagnostics:
    """Summable token diagnostics. Index 0 of every `[2]` tensor is the high-entropy class
    (h_hat > 0), index 1 the low-entropy class (h_hat <= 0)."""

    entropy_hist: torch.Tensor = field(
        default_factory=lambda: torch.zeros(NUM_ENTROPY_BINS, dtype=torch.int64))
    entropy_sum: float = 0.0
    num_tokens: int = 0
    tokens_by_class: torch.Tensor = field(default_factory=_zeros)
    clip_tokens: int = 0                                       # tokens with clip flags
    clip_low: torch.Tensor = field(default_factory=_zeros)    # count per class
    clip_high: torch.Tensor = field(default_factory=_zeros)
    clip_dual: torch.Tensor = field(default_factory=_zeros)
    clip_class_tokens: torch.Tensor = field(default_factory=_zeros)
    adv_abs_before: torch.Tensor = field(default_factory=_zeros)  # sum |A| per class
    adv_abs_after: torch.Tensor = field(default_factory=_zeros)   # sum |A'| per class
    adv_ratio_sum: torch.Tensor = field(default_factory=_zeros)   # sum |A'|/|A| (A != 0)
    adv_ratio_count: torch.Tensor = field(default_factory=_zeros)
    temp_sum: torch.Tensor = field(default_factory=_zeros)        # per class
    temp_sumsq: float = 0.0
    temp_count: torch.Tensor = field(default_factory=_zeros)
    temp_min: float = math.inf
    temp_max: float = -math.inf
    num_responses: int = 0
    length_sum: float = 0.0
    length_sumsq: float = 0.0
    length_min: float = math.inf
    length_max: float = -math.inf
    num_truncated: int = 0
    clipped_low_tokens: Counter = field(default_factory=Counter)
    clipped_high_tokens: Counter = field(default_factory=Counter)

    # ------------------------------------------------------------------ accumulation
    def update_tokens(self, *, entropy: torch.Tensor | None = None,
                      h_hat: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                      token_ids: torch.Tensor | None = None,
                      clip_low: torch.Tensor | None = None, clip_high: torch.Tensor | None = None,
                      clip_dual: torch.Tensor | None = None,
                      adv_before: torch.Tensor | None = None,
                      adv_after: torch.Tensor | None = None,
                      temperatures: torch.Tensor | None = None) -> "TokenDiagnostics":
        """Add a batch of tokens. Every given tensor has the shape of `mask` (`[B, T]` or
        `[N]`); without `mask` every element is valid. The split by entropy class needs
        `h_hat`: `summary()` reports per-class numbers only when some batch brought it. The
        clip flags and advantages go to `update_policy` (call that alone for further updates of
        tokens already added)."""
        ref = next((t for t in (entropy, h_hat, token_ids, clip_low, adv_before, temperatures)
                    if t is not None), None)
        if ref is None:
            return self
        sel = self._checked_selector(ref, mask, entropy=entropy, h_hat=h_hat, token_ids=token_ids,
                                     temperatures=temperatures)
        classes = self._classes(sel, ref, h_hat)
        n = int(sel(ref).numel())
        if entropy is not None:
            e = sel(entropy).double()
            self.entropy_hist += entropy_histogram(e)
            self.entropy_sum += float(e.sum())
            self.num_tokens += n
        if h_hat is not None:
            self.tokens_by_class += torch.tensor([float(c.sum()) for c in classes],
                                                 dtype=torch.float64)
        if temperatures is not None:
            t = sel(temperatures).double()
            self.temp_sum += torch.stack([t[c].sum() for c in classes])
            self.temp_count += torch.tensor([float(c.sum()) for c in classes],
                                            dtype=torch.float64)
            self.temp_sumsq += float((t * t).sum())
            if t.numel():
                self.temp_min = min(self.temp_min, float(t.min()))
                self.temp_max = max(self.temp_max, float(t.max()))
        return self.update_policy(h_hat=h_hat, mask=mask, token_ids=token_ids, clip_low=clip_low,
                                  clip_high=clip_high, clip_dual=clip_dual, adv_before=adv_before,
                                  adv_after=adv_after)

    def update_policy(self, *, h_hat: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                      token_ids: torch.Tensor | None = None,
                      clip_low: torch.Tensor | None = None, clip_high: torch.Tensor | None = None,
                      clip_dual: torch.Tensor | None = None,
                      adv_before: torch.Tensor | None = None,
                      adv_after: torch.Tensor | None = None) -> "TokenDiagnostics":
        """Add what one policy update did to a batch of tokens: which clip bound was active and
        the advantage before/after redistribution (by entropy class of `h_hat`). Called once per
        update, so a token trained on in two PPO epochs counts twice here (and once in the
        token counts of `update_tokens`)."""
        ref = next((t for t in (clip_low, clip_high, clip_dual, adv_before) if t is not None), None)
        if ref is None:
            return self
        sel = self._checked_selector(ref, mask, h_hat=h_hat, token_ids=token_ids, clip_low=clip_low,
                                     clip_high=clip_high, clip_dual=clip_dual, adv_before=adv_before,
                                     adv_after=adv_after)
        classes = self._classes(sel, ref, h_hat)
        if clip_low is not None or clip_high is not None or clip_dual is not None:
            self._update_clips(sel, classes, int(sel(ref).numel()), token_ids, clip_low, clip_high, clip_dual)
        if adv_before is not None and adv_after is not None:
            self._update_adv(sel(adv_before).double(), sel(adv_after).double(), classes)
        return self

    @staticmethod
    def _checked_selector(ref: torch.Tensor, mask: torch.Tensor | None, **tensors):
        for name, t in tensors.items():
            if t is not None and t.shape != ref.shape:
                raise ValueError(f"{name} shape {tuple(t.shape)} != {tuple(ref.shape)}")
        return (lambda t: _select(t, mask)) if mask is not None else (lambda t: t.reshape(-1))

    @staticmethod
    def _classes(sel, ref: torch.Tensor, h_hat: torch.Tensor | None):
        n = int(sel(ref).numel())
        high = sel(h_hat) > 0 if h_hat is not None else torch.zeros(n, dtype=torch.bool)
        return high, ~high

    def _update_clips(self, sel, classes, n, token_ids, clip_low, clip_high, clip_dual):
        empty = torch.zeros(n, dtype=torch.bool)
        flags = {side: (sel(f).bool() if f is not None else empty)
                 for side, f in (("low", clip_low), ("high", clip_high), ("dual", clip_dual))}
        self.clip_tokens += n
        self.clip_class_tokens += torch.tensor([float(c.sum()) for c in classes],
                                               dtype=torch.float64)
        for side, acc in (("low", self.clip_low), ("high", self.clip_high),
                          ("dual", self.clip_dual)):
            acc += torch.tensor([float((flags[side] & c).sum()) for c in classes],
                                dtype=torch.float64)
        if token_ids is not None:
            ids = sel(token_ids).long()
            self.clipped_low_tokens.update(ids[flags["low"]].tolist())
            self.clipped_high_tokens.update(ids[flags["high"]].tolist())

    def _update_adv(self, a: torch.Tensor, a2: torch.Tensor, classes):
        nz = a.abs() > 0
        for i, c in enumerate(classes):
            self.adv_abs_before[i] += a[c].abs().sum()
            self.adv_abs_after[i] += a2[c].abs().sum()
            m = c & nz
            self.adv_ratio_sum[i] += (a2[m].abs() / a[m].abs()).sum()
            self.adv_ratio_count[i] += float(m.sum())

    def update_responses(self, lengths: Sequence[int] | torch.Tensor,
                         truncated: Sequence[bool] | torch.Tensor | None = None
                         ) -> "TokenDiagnostics":
        """Add response lengths `[B]` and whether each hit the length limit `[B]`."""
        lens = torch.as_tensor(lengths, dtype=torch.float64).reshape(-1)
        if truncated is not None:
            tr = torch.as_tensor(truncated, dtype=torch.bool).reshape(-1)
            if tr.shape != lens.shape:
                raise ValueError(f"truncated has {tr.numel()} entries, lengths {lens.numel()}")
            self.num_truncated += int(tr.sum())
        if lens.numel():
            self.num_responses += lens.numel()
            self.length_sum += float(lens.sum())
            self.length_sumsq += float((lens * lens).sum())
            self.length_min = min(self.length_min, float(lens.min()))
            self.length_max = max(self.length_max, float(lens.max()))
        return self

    # ------------------------------------------------------------------ merging
    _SUM_FIELDS = ("entropy_hist", "entropy_sum", "num_tokens", "tokens_by_class",
                   "clip_tokens", "clip_low", "clip_high", "clip_dual", "clip_class_tokens",
                   "adv_abs_before", "adv_abs_after", "adv_ratio_sum", "adv_ratio_count",
                   "temp_sum", "temp_sumsq", "temp_count", "num_responses", "length_sum",
                   "length_sumsq", "num_truncated")

    def merge(self, other: "TokenDiagnostics") -> "TokenDiagnostics":
        """Add `other` into `self` (micro-batches, steps or ranks)."""
        for name in self._SUM_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.temp_min = min(self.temp_min, other.temp_min)
        self.temp_max = max(self.temp_max, other.temp_max)
        self.length_min = min(self.length_min, other.length_min)
        self.length_max = max(self.length_max, other.length_max)
        self.clipped_low_tokens = self.clipped_low_tokens + other.clipped_low_tokens
        self.clipped_high_tokens = self.clipped_high_tokens + other.clipped_high_tokens
        return self

    def all_reduce(self, group=None, device: torch.device | str = "cpu") -> "TokenDiagnostics":
        """Merge the accumulators of every rank of `group` in place (every rank gets the sum).

        Counts and sums travel in one float64 SUM all-reduce, extremes in one MAX all-reduce
        (both on `device`: NCCL groups need a CUDA one), the clipped-token counters through
        `all_gather_object` (they are small)."""
        import torch.distributed as dist

        flat = torch.cat([torch.as_tensor(getattr(self, n), dtype=torch.float64).reshape(-1)
                          for n in self._SUM_FIELDS]).to(device)
        all_reduce_tensor(flat, group)  # checks the device against the group's backend
        flat = flat.cpu()
        offset = 0
        for name in self._SUM_FIELDS:
            cur = getattr(self, name)
            size = cur.numel() if isinstance(cur, torch.Tensor) else 1
            chunk = flat[offset:offset + size]
            offset += size
            if isinstance(cur, torch.Tensor):
                setattr(self, name, chunk.round().to(cur.dtype) if not cur.is_floating_point()
                        else chunk.clone())
            else:
                setattr(self, name, int(round(float(chunk))) if isinstance(cur, int)
                        else float(chunk))
        ext = torch.tensor([-self.temp_min, self.temp_max, -self.length_min, self.length_max],
                           dtype=torch.float64, device=device)
        all_reduce_tensor(ext, group, dist.ReduceOp.MAX)
        ext = ext.cpu()
        self.temp_min, self.temp_max = -float(ext[0]), float(ext[1])
        self.length_min, self.length_max = -float(ext[2]), float(ext[3])
        gathered = all_gather_objects((dict(self.clipped_low_tokens), dict(self.clipped_high_tokens)), group)
        self.clipped_low_tokens = sum((Counter(lo) for lo, _ in gathered), Counter())
        self.clipped_high_tokens = sum((Counter(hi) for _, hi in gathered), Counter())
        return self

    # ------------------------------------------------------------------ reporting
    def summary(self, prefix: str = "diag", pivot: float | None = None) -> dict[str, float]:
        """Flat metrics. Rates are fractions of the relevant tokens; NaN-free (empty -> 0).

        `pivot` (nats), when known (e.g. `exp(EntropyStats.pivot)`), is reported as
        `<prefix>/entropy_pivot`.
        """
        out: dict[str, float] = {}
        p = prefix + "/"
        if self.num_tokens:
            out[p + "entropy_mean"] = self.entropy_sum / self.num_tokens
        if pivot is not None:
            out[p + "entropy_pivot"] = float(pivot)
        cls_total = float(self.tokens_by_class.sum())
        if cls_total:
            out[p + "high_entropy_share"] = float(self.tokens_by_class[0]) / cls_total
        if self.clip_tokens:
            for side in ("low", "high", "dual"):
                counts = getattr(self, "clip_" + side)
                out[f"{p}clipfrac_{side}"] = float(counts.sum()) / self.clip_tokens
                for i, cname in enumerate(_CLASSES if cls_total else ()):
                    denom = float(self.clip_class_tokens[i])
                    out[f"{p}clipfrac_{side}_{cname}"] = float(counts[i]) / denom if denom else 0.0
        for i, cname in enumerate(_CLASSES if cls_total else ()):
            if float(self.adv_ratio_count[i]):
                out[f"{p}adv_ratio_{cname}"] = float(self.adv_ratio_sum[i] / self.adv_ratio_count[i])
            if float(self.adv_abs_before[i]):
                out[f"{p}adv_abs_ratio_of_sums_{cname}"] = float(
                    self.adv_abs_after[i] / self.adv_abs_before[i])
        n_t = float(self.temp_count.sum())
        if n_t:
            mean_t = float(self.temp_sum.sum()) / n_t
            out[p + "temperature_mean"] = mean_t
            out[p + "temperature_std"] = math.sqrt(max(self.temp_sumsq / n_t - mean_t ** 2, 0.0))
            out[p + "temperature_min"] = self.temp_min
            out[p + "temperature_max"] = self.temp_max
            for i, cname in enumerate(_CLASSES if cls_total else ()):
                if float(self.temp_count[i]):
                    out[f"{p}temperature_mean_{cname}"] = float(self.temp_sum[i] / self.temp_count[i])
        if self.num_responses:
            mean_l = self.length_sum / self.num_responses
            out[p + "response_length_mean"] = mean_l
            out[p + "response_length_std"] = math.sqrt(
                max(self.length_sumsq / self.num_responses - mean_l ** 2, 0.0))
            out[p + "response_length_min"] = self.length_min
            out[p + "response_length_max"] = self.length_max
            out[p + "response_truncated_ratio"] = self.num_truncated / self.num_responses
        return out

    def histogram(self) -> list[dict[str, float]]:
        """The entropy histogram as rows `{"lo", "hi", "count", "fraction"}`."""
        total = int(self.entropy_hist.sum())
        edges = (0.0,) + ENTROPY_BIN_EDGES + (math.inf,)
        return [{"lo": edges[i], "hi": edges[i + 1], "count": int(c),
                 "fraction": int(c) / total if total else 0.0}
                for i, c in enumerate(self.entropy_hist.tolist())]

    def top_clipped_tokens(self, side: str, k: int = 20, tokenizer=None) -> list[dict]:
        """The `k` token ids clipped most often on `side` ("low" | "high"), with counts and,
        given a tokenizer, their decoded text."""
        if side not in ("low", "high"):
            raise ValueError(f"side must be 'low' or 'high', got {side!r}")
        counter = self.clipped_low_tokens if side == "low" else self.clipped_high_tokens
        rows = []
        for tok, count in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:k]:
            row = {"token_id": int(tok), "count": int(count)}
            if tokenizer is not None:
                row["text"] = tokenizer.decode([int(tok)])
            rows.append(row)
        return rows
