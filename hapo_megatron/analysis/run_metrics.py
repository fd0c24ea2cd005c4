"""Training runs' logged metrics: reading a run's `metrics.jsonl` into step records and the
series, seed bands and smoothing drawn and tabulated from them (`plots`, `run_comparison`;
docs/evaluation.md, "Plots and comparisons"). Pure python.

A run is a directory holding `metrics.jsonl` (or that file itself); on a command line a run
spec is `DIR` or `LABEL=DIR[,DIR...]`, several runs under one label being seeds.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Sequence

logger = logging.getLogger(__name__)


def metrics_path(run: str) -> str:
    """`run` itself when it is a file, else `<run>/metrics.jsonl`."""
    return run if os.path.isfile(run) else os.path.join(run, "metrics.jsonl")


def load_metrics(run: str) -> list[dict]:
    """Step records of a run, sorted by step; `null` values become NaN.

    A torn last line (a run killed mid-write) is skipped. Records of the same step are merged,
    later keys winning: the trainer writes evaluations as separate lines with the step they
    follow, and a resumed run re-logs the steps after its checkpoint.
    """
    path = metrics_path(run)
    if not os.path.exists(path):
        raise ValueError(f"run {run!r}: no metrics file at {path}")
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s: skipping malformed line %d", path, lineno)
                continue
            if not isinstance(rec, dict) or "step" not in rec:
                logger.warning("%s: line %d has no 'step'", path, lineno)
                continue
            by_step.setdefault(int(rec["step"]), {}).update(
                {k: (math.nan if v is None else v) for k, v in rec.items()})
    return [by_step[s] for s in sorted(by_step)]


def matching_keys(rows: Sequence[dict], pattern: str) -> list[str]:
    """Keys of `rows` matching `pattern` (exact, or `*` wildcards via fnmatch), sorted."""
    import fnmatch

    keys = {k for r in rows for k in r if k != "step"}
    if "*" not in pattern:
        return [pattern] if pattern in keys else []
    return sorted(k for k in keys if fnmatch.fnmatchcase(k, pattern))


def series(rows: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a finite numeric `key`."""
    steps, vals = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(int(r["step"]))
            vals.append(float(v))
    return steps, vals


def mean_band(runs: Sequence[Sequence[dict]], key: str):
    """Mean, min and max over runs of `key` at the steps every run logged it."""
    per_run = [dict(zip(*series(rows, key))) for rows in runs]
    common = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    mean = [sum(d[s] for d in per_run) / len(per_run) for s in common]
    lo = [min(d[s] for d in per_run) for s in common]
    hi = [max(d[s] for d in per_run) for s in common]
    return common, mean, lo, hi


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (1 = unchanged)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def parse_run_spec(spec: str) -> tuple[str, list[str]]:
    """`label=dir1,dir2` or `dir` -> (label, [dirs]); the label defaults to the dir's name."""
    label, sep, rest = spec.partition("=")
    if not sep:
        label, rest = os.path.basename(os.path.normpath(spec)), spec
    dirs = [d for d in rest.split(",") if d]
    if not label or not dirs:
        raise ValueError(f"run spec {spec!r}: expected DIR or LABEL=DIR[,DIR...]")
    return label, dirs


def group_run_specs(specs: Sequence[str]) -> dict[str, list[str]]:
    """Run specs -> `{label: [run dirs]}`; a label given twice gathers the runs of both."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        label, dirs = parse_run_spec(spec)
        out.setdefault(label, []).extend(dirs)
    return out
