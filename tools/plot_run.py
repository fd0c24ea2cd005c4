#!/usr/bin/env python
"""Plot training curves of one or several runs from their `metrics.jsonl`.

    python tools/plot_run.py runs/hapo runs/dapo --out plots/
    python tools/plot_run.py hapo=runs/hapo_s1,runs/hapo_s2 dapo=runs/dapo_s1 --out plots/

Each positional argument is a run directory (or a metrics.jsonl file), optionally prefixed by
`label=`; several comma-separated runs under one label are drawn as their mean over the steps
they share, with a min-max band (seeds). One PNG per panel (reward, accuracy, response length,
entropy, clip fractions overall and by entropy class, advantage scaling by entropy class, evaluation
accuracy) plus `overview.png` with all panels. Panels whose
keys no run logged are skipped. Headless: matplotlib's Agg backend.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import Iterable, Sequence

logger = logging.getLogger("plot_run")

# (file stem, title, y label, metric keys or "eval/*/avg@*"-style patterns)
PANELS: list[tuple[str, str, str, tuple[str, ...]]] = [
    ("reward", "Training reward", "mean reward", ("rollout/reward_mean",)),
    ("accuracy", "Training accuracy", "accuracy", ("rollout/acc",)),
    ("response_length", "Response length", "tokens", ("rollout/response_length_mean",)),
    ("entropy", "Mean token entropy", "nats", ("entropy/mean",)),
    ("clip_fractions", "Clip fractions", "fraction of tokens",
     ("loss/clipfrac_low", "loss/clipfrac_high")),
    ("clip_by_entropy", "Clip fraction by entropy class (any bound)", "fraction of the class's tokens",
     ("loss/clipfrac_high_entropy", "loss/clipfrac_low_entropy")),
    ("adv_scale_curves", "Advantage scaling |A'|/|A| per entropy class", "mean |A'|/|A|",
     ("loss/adv_scale_high_entropy", "loss/adv_scale_low_entropy")),
    ("eval_accuracy", "Evaluation accuracy (avg@k, mean over benchmarks)", "accuracy",
     ("eval/all/avg@*",)),
]


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


def _draw_panel(ax, runs: dict[str, list[list[dict]]], patterns: Iterable[str], title: str,
                ylabel: str, window: int) -> bool:
    styles = ["-", "--", ":", "-."]
    drawn = False
    for ci, (label, group) in enumerate(runs.items()):
        color = f"C{ci % 10}"
        keys = sorted({k for p in patterns for rows in group for k in matching_keys(rows, p)})
        for si, key in enumerate(keys):
            steps, mean, lo, hi = mean_band(group, key)
            if not steps:
                continue
            name = label if len(keys) == 1 else f"{label} {key.split('/')[-1]}"
            ax.plot(steps, smooth(mean, window), styles[si % len(styles)], color=color,
                    label=name, linewidth=1.5, marker="o" if len(steps) <= 30 else None,
                    markersize=3)
            if len(group) > 1:
                ax.fill_between(steps, lo, hi, color=color, alpha=0.15, linewidth=0)
            drawn = True
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    return drawn


def plot_runs(runs: dict[str, list[list[dict]]], out_dir: str, *, window: int = 1,
              panels=None, dpi: int = 100) -> list[str]:
    """Write one PNG per panel that has data and `overview.png`; returns the paths written.

    `runs` maps a label to one or more runs' records (several = seeds, drawn as mean + band).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("runs must not be empty")
    panels = PANELS if panels is None else panels
    os.makedirs(out_dir, exist_ok=True)
    written, kept = [], []
    for stem, title, ylabel, patterns in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        if _draw_panel(ax, runs, patterns, title, ylabel, window):
            path = os.path.join(out_dir, f"{stem}.png")
            fig.tight_layout()
            fig.savefig(path, dpi=dpi)
            written.append(path)
            kept.append((stem, title, ylabel, patterns))
        plt.close(fig)
    if kept:
        cols = min(3, len(kept))
        rows = math.ceil(len(kept) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
        for ax, (_, title, ylabel, patterns) in zip(axes.flat, kept):
            _draw_panel(ax, runs, patterns, title, ylabel, window)
        for ax in list(axes.flat)[len(kept):]:
            ax.axis("off")
        fig.tight_layout()
        path = os.path.join(out_dir, "overview.png")
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        written.append(path)
    return written


def parse_run_spec(spec: str) -> tuple[str, list[str]]:
    """`label=dir1,dir2` or `dir` -> (label, [dirs]); the label defaults to the dir's name."""
    label, sep, rest = spec.partition("=")
    if not sep:
        label, rest = os.path.basename(os.path.normpath(spec)), spec
    dirs = [d for d in rest.split(",") if d]
    if not label or not dirs:
        raise ValueError(f"run spec {spec!r}: expected DIR or LABEL=DIR[,DIR...]")
    return label, dirs


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="DIR or LABEL=DIR[,DIR...] (run dirs or metrics.jsonl)")
    ap.add_argument("--out", required=True, help="output directory for the PNGs")
    ap.add_argument("--smooth", type=int, default=1, help="moving-average window (steps)")
    ap.add_argument("--dpi", type=int, default=100)
    args = ap.parse_args(argv)
    runs: dict[str, list[list[dict]]] = {}
    try:
        for spec in args.runs:
            label, dirs = parse_run_spec(spec)
            runs.setdefault(label, []).extend(load_metrics(d) for d in dirs)
        paths = plot_runs(runs, args.out, window=args.smooth, dpi=args.dpi)
    except ValueError as e:
        print(f"plot_run: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    sys.exit(main())
