"""Benchmark evaluation: avg@k and pass@k accuracy per data source.

Used by the trainer for periodic validation and by `hapo eval`. The protocol of the paper is
the default (``rollout.val_n``, ``val_temperature``, ``val_top_p``;
``SamplingParams.from_config(validation=True)``): n = 8 samples per question at temperature 0.5,
top-p 0.7, never the adaptive temperature.

Definitions (per prompt with `n` sampled responses, `c` of them correct):
- `avg@k`: mean accuracy of the first `k` samples (k <= n). `avg@n` is the usual "avg@8"
  number of the paper; it is also the unbiased estimate of `pass@1`.
- `pass@k`: the unbiased estimator `1 - C(n-c, k) / C(n, k)` (the probability that at least one
  of k samples drawn without replacement from the n is correct), computed as a product of
  ratios so it never forms huge binomials.
Both are averaged over the prompts of a data source. `eval/all/<metric>` is the unweighted mean
over data sources (benchmarks count equally, as in the paper's "average" column).

The pure aggregation (`pass_at_k`, `avg_at_k`, `aggregate_results`) imports nothing heavy;
`evaluate()` drives any `RolloutEngine` (HF or SGLang).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

logger = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt: `1 - C(n-c, k) / C(n, k)`.

    Computed as `1 - prod_{i=n-c+1}^{n} (1 - k / i)` in log space (exact for small n, no
    overflow for large n). Needs `0 <= c <= n` and `1 <= k <= n`.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    if c == 0:
        return 0.0
    log_fail = math.fsum(math.log1p(-k / i) for i in range(n - c + 1, n + 1))
    return -math.expm1(log_fail)


def avg_at_k(correct: Sequence[float], k: int) -> float:
    """Mean accuracy of the first `k` samples of one prompt (`correct` are 0/1 or bools)."""
    if not 1 <= k <= len(correct):
        raise ValueError(f"k must be in [1, {len(correct)}], got {k}")
    return math.fsum(float(x) for x in correct[:k]) / k


def default_k_values(n: int) -> tuple[int, ...]:
    """Powers of two below `n`, plus `n` itself: (1, 2, 4, 8) for n = 8."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) < n]
    return tuple(ks + [n])


@dataclass
class PromptResult:
    """Scored samples of one prompt (lists have one entry per sample)."""

    uid: str
    data_source: str
    ground_truth: str
    acc: list[bool]
    scores: list[float]
    response_lengths: list[int]
    truncated: list[bool] = field(default_factory=list)
    preds: list[str | None] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _mean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return math.fsum(xs) / len(xs) if xs else float("nan")


def aggregate_results(results: Sequence[PromptResult], k_values: Sequence[int] | None = None,
                      prefix: str = "eval") -> dict[str, float]:
    """Per-data-source metrics from scored prompts.

    Keys: `<prefix>/<source>/avg@k`, `pass@k` (for every k <= that source's smallest n),
    `reward_mean`, `response_length_mean`, `response_length_max`, `truncated_ratio`,
    `num_prompts`; and `<prefix>/all/<metric>` = mean over sources of the rate metrics.
    """
    if not results:
        raise ValueError("results must not be empty")
    by_source: dict[str, list[PromptResult]] = defaultdict(list)
    for r in results:
        if not r.acc:
            raise ValueError(f"results: prompt {r.uid!r} has no samples")
        by_source[r.data_source].append(r)
    out: dict[str, float] = {}
    per_source: dict[str, dict[str, float]] = {}
    for source in sorted(by_source):
        rows = by_source[source]
        n_min = min(len(r.acc) for r in rows)
        ks = sorted(set(k_values)) if k_values else list(default_k_values(n_min))
        m: dict[str, float] = {}
        for k in ks:
            if k < 1:
                raise ValueError(f"k_values must be >= 1, got {k}")
            if k > n_min:
                logger.warning("eval: skipping k=%d for %s (only %d samples)", k, source, n_min)
                continue
            m[f"avg@{k}"] = _mean(avg_at_k(r.acc, k) for r in rows)
            m[f"pass@{k}"] = _mean(pass_at_k(len(r.acc), sum(map(bool, r.acc)), k) for r in rows)
        m["reward_mean"] = _mean(s for r in rows for s in r.scores)
        m["response_length_mean"] = _mean(x for r in rows for x in r.response_lengths)
        m["truncated_ratio"] = _mean(float(t) for r in rows for t in r.truncated)
        per_source[source] = m
        out.update({f"{prefix}/{source}/{name}": v for name, v in m.items()})
        out[f"{prefix}/{source}/response_length_max"] = float(
            max(x for r in rows for x in r.response_lengths))
        out[f"{prefix}/{source}/num_prompts"] = float(len(rows))
    shared = set.intersection(*(set(m) for m in per_source.values()))
    for name in sorted(shared):
        vals = [m[name] for m in per_source.values() if not math.isnan(m[name])]
        out[f"{prefix}/all/{name}"] = _mean(vals)
    return out


def _accepted_kwargs(fn: Callable, kwargs: dict) -> dict:
    """The subset of `kwargs` that `fn` accepts (all of them when it takes **kwargs)."""
    if not kwargs:
        return {}
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(kwargs)
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


def _score(reward_fn: Callable, text: str, ground_truth: str,
           kwargs: dict | None = None) -> tuple[float, bool, str | None]:
    """Call a reward function and normalise its result to (score, acc, pred).

    Accepts a `RewardResult`-like object (`.score`, `.acc`, optional `.pred`), a dict with the
    same keys, or a bare number (acc = score > 0).
    """
    res = reward_fn(text, ground_truth, **_accepted_kwargs(reward_fn, kwargs or {}))
    if isinstance(res, dict):
        score = float(res["score"])
        return score, bool(res.get("acc", score > 0)), res.get("pred")
    if hasattr(res, "score"):
        score = float(res.score)
        return score, bool(getattr(res, "acc", score > 0)), getattr(res, "pred", None)
    score = float(res)
    return score, score > 0, None


def _fixed_temperature(sampling):
    """Evaluation never uses the adaptive temperature (algorithm spec, section 2)."""
    if getattr(sampling, "adaptive", False):
        logger.warning("eval: adaptive temperature requested; evaluating at the fixed one")
        return dataclasses.replace(sampling, adaptive=False, entropy_stats=None)
    return sampling


def generate_and_score(engine, dataset, reward_fn: Callable, sampling, *, tokenizer=None,
                       batch_size: int | None = None, keep_text: bool = False,
                       progress: Callable[[int, int], None] | None = None,
                       reward_kwargs: dict | None = None) -> list[PromptResult]:
    """Generate `sampling.n` responses per prompt of `dataset` and score them.

    `dataset[i]` is a `PromptRecord` (uid, prompt_ids, ground_truth, data_source); responses are
    decoded with `tokenizer` (default: `dataset.tokenizer`) without special tokens.
    `batch_size` prompts go to the engine per call (default: all). `progress(done, total)` is
    called after each batch. The reward gets `reward_kwargs` (e.g. `score_format`) plus the
    record's `data_source` and `extra_info`, as far as its signature accepts them.
    """
    tokenizer = tokenizer if tokenizer is not None else getattr(dataset, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("tokenizer is required (the dataset has no .tokenizer)")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sampling = _fixed_temperature(sampling)
    total = len(dataset)
    if total == 0:
        raise ValueError("dataset is empty")
    step = batch_size or total
    results: list[PromptResult] = []
    for start in range(0, total, step):
        records = [dataset[i] for i in range(start, min(start + step, total))]
        groups = engine.generate([list(r.prompt_ids) for r in records], sampling)
        if len(groups) != len(records):
            raise ValueError(f"engine returned {len(groups)} groups for {len(records)} prompts")
        for rec, samples in zip(records, groups):
            results.append(_score_prompt(rec, samples, reward_fn, tokenizer, keep_text,
                                         reward_kwargs))
        if progress is not None:
            progress(len(results), total)
    return results


def _score_prompt(rec, samples, reward_fn, tokenizer, keep_text: bool,
                  reward_kwargs: dict | None) -> PromptResult:
    kwargs = {**(reward_kwargs or {}), "data_source": rec.data_source,
              "extra_info": getattr(rec, "extra_info", None) or {}}
    res = PromptResult(uid=str(rec.uid), data_source=str(rec.data_source),
                       ground_truth=str(rec.ground_truth), acc=[], scores=[],
                       response_lengths=[])
    for s in samples:
        text = tokenizer.decode(np.asarray(s.response_ids).tolist(), skip_special_tokens=True)
        score, acc, pred = _score(reward_fn, text, rec.ground_truth, kwargs)
        res.scores.append(score)
        res.acc.append(acc)
        res.preds.append(pred)
        res.response_lengths.append(len(s.response_ids))
        res.truncated.append(getattr(s, "finish_reason", "stop") == "length")
        if keep_text:
            res.responses.append(text)
    return res


def evaluate(engine, dataset, reward_fn: Callable, sampling, *,
             k_values: Sequence[int] | None = None, tokenizer=None,
             batch_size: int | None = None, prefix: str = "eval",
             progress: Callable[[int, int], None] | None = None,
             reward_kwargs: dict | None = None) -> dict[str, float]:
    """Evaluate `engine` on `dataset`: `{"eval/<data_source>/avg@k": ..., "pass@k", ...}`.

    Works with any `RolloutEngine`. `k_values` default to powers of two up to `sampling.n`.
    See `aggregate_results` for every key.
    """
    results = generate_and_score(engine, dataset, reward_fn, sampling, tokenizer=tokenizer,
                                 batch_size=batch_size, progress=progress,
                                 reward_kwargs=reward_kwargs)
    return aggregate_results(results, k_values, prefix=prefix)


def format_results_table(metrics: dict[str, float], prefix: str = "eval") -> str:
    """A fixed-width console table: one row per data source, one column per metric."""
    rows: dict[str, dict[str, float]] = defaultdict(dict)
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != prefix:
            continue
        rows[parts[1]][parts[2]] = value

    tail = ["reward_mean", "response_length_mean", "response_length_max", "truncated_ratio",
            "num_prompts"]

    def order(name: str) -> tuple:
        kind, _, k = name.partition("@")
        rank = {"avg": 0, "pass": 1}.get(kind, 2)
        return (rank, int(k) if k.isdigit() else 0, tail.index(name) if name in tail else 99, name)

    def cell(name: str, v: float | None) -> str:
        if v is None:
            return ""
        if name.startswith(("avg@", "pass@")) or name == "truncated_ratio":
            return f"{100.0 * v:.2f}%"
        if name in ("num_prompts", "response_length_max") and float(v).is_integer():
            return str(int(v))
        return f"{v:.3f}" if name == "reward_mean" else f"{v:.1f}"

    cols = sorted({c for r in rows.values() for c in r}, key=order)
    sources = sorted(s for s in rows if s != "all") + (["all"] if "all" in rows else [])
    width = max([len("data_source")] + [len(s) for s in sources])
    widths = [max(8, len(c)) for c in cols]
    head = "data_source".ljust(width) + "".join(f"  {c:>{w}}" for c, w in zip(cols, widths))
    lines = [head, "-" * len(head)]
    for s in sources:
        lines.append(s.ljust(width) + "".join(
            f"  {cell(c, rows[s].get(c)):>{w}}" for c, w in zip(cols, widths)))
    return "\n".join(lines)
