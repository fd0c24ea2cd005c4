#!/usr/bin/env python
"""Compare variants (HAPO, DAPO, ablations) over seeds: a Markdown table plus plots.

    python tools/compare_runs.py \
        --variant hapo=runs/hapo_s1,runs/hapo_s2 --variant dapo=runs/dapo_s1,runs/dapo_s2 \
        --out docs/results/cpu_tiny --last-n 5

For every run (a directory with `metrics.jsonl`): the final accuracy (last logged value of the
accuracy key: the largest-k `eval/all/avg@k` when the runs logged evaluations, else
`rollout/acc`) and the mean over its last N logged steps of training accuracy, reward, mean
entropy and response length. Per variant: mean +- sample standard deviation over its runs
(seeds). Writes `<out>/results.md`, `<out>/results.json` and the plots of `tools/plot_run.py`
(variants overlaid, seeds as mean + min-max band); prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot_run  # noqa: E402  (sibling tool)

# (column title, metric key, kind) of the last-N columns; kind picks the number format.
LAST_N_COLUMNS = [
    ("acc", "rollout/acc", "pct"),
    ("reward", "rollout/reward_mean", "num"),
    ("entropy", "entropy/mean", "num"),
    ("length", "rollout/response_length_mean", "len"),
]


def final_value(rows: Sequence[dict], key: str) -> float:
    """Last finite value of `key` (NaN when never logged)."""
    _, vals = plot_run.series(rows, key)
    return vals[-1] if vals else math.nan


def last_n_mean(rows: Sequence[dict], key: str, n: int) -> float:
    """Mean of the last `n` finite values of `key` (NaN when never logged)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    _, vals = plot_run.series(rows, key)
    vals = vals[-n:]
    return math.fsum(vals) / len(vals) if vals else math.nan


def pick_acc_key(runs: Sequence[Sequence[dict]]) -> str:
    """`eval/all/avg@k` with the largest k that every run logged, else `rollout/acc`."""
    common = None
    for rows in runs:
        ks = {int(m.group(1)) for r in rows for k in r
              if (m := re.fullmatch(r"eval/all/avg@(\d+)", k))}
        common = ks if common is None else common & ks
    return f"eval/all/avg@{max(common)}" if common else "rollout/acc"


def run_summary(rows: Sequence[dict], acc_key: str, last_n: int) -> dict[str, float]:
    """The numbers of one run that go into the table."""
    out = {"steps": float(rows[-1]["step"]) if rows else math.nan,
           "final_acc": final_value(rows, acc_key)}
    for title, key, _ in LAST_N_COLUMNS:
        out[title] = last_n_mean(rows, key, last_n)
    return out


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof 1) of the finite values; std NaN for fewer than two."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return math.nan, math.nan
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else math.nan


def fmt(mean: float, std: float, kind: str) -> str:
    """`45.2 ± 3.1` (percent), `0.123 ± 0.010`, `312.4 ± 5.0`; `n/a` when missing."""
    if not math.isfinite(mean):
        return "n/a"
    scale, digits = {"pct": (100.0, 1), "num": (1.0, 3), "len": (1.0, 1)}[kind]
    text = f"{mean * scale:.{digits}f}"
    if math.isfinite(std):
        text += f" ± {std * scale:.{digits}f}"
    return text


def compare(variants: dict[str, list[list[dict]]], *, last_n: int = 5,
            acc_key: str | None = None) -> tuple[str, dict]:
    """Markdown table and the numbers behind it for `{variant: [run records, ...]}`."""
    if not variants:
        raise ValueError("variants must not be empty")
    all_runs = [rows for runs in variants.values() for rows in runs]
    acc_key = acc_key or pick_acc_key(all_runs)
    header = (["variant", "seeds", "steps", f"final acc ({acc_key})"]
              + [f"{t} (last {last_n})" for t, _, _ in LAST_N_COLUMNS])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    numbers: dict = {"acc_key": acc_key, "last_n": last_n, "variants": {}}
    for name, runs in variants.items():
        per_run = [run_summary(rows, acc_key, last_n) for rows in runs]
        agg = {col: mean_std([r[col] for r in per_run]) for col in per_run[0]}
        numbers["variants"][name] = {"runs": per_run,
                                     "mean": {c: v[0] for c, v in agg.items()},
                                     "std": {c: v[1] for c, v in agg.items()}}
        steps = sorted({int(r["steps"]) for r in per_run if math.isfinite(r["steps"])})
        cells = [name, str(len(runs)), "/".join(map(str, steps)) or "n/a",
                 fmt(*agg["final_acc"], "pct" if "acc" in acc_key or "avg@" in acc_key else "num")]
        cells += [fmt(*agg[t], kind) for t, _, kind in LAST_N_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", numbers


def _json_safe(obj):
    """NaN -> null so results.json is strict JSON."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """`name=dir1,dir2` -> (name, [dir1, dir2])."""
    name, sep, rest = spec.partition("=")
    dirs = [d for d in rest.split(",") if d]
    if not sep or not name or not dirs:
        raise ValueError(f"--variant {spec!r}: expected NAME=DIR[,DIR...]")
    return name, dirs


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME=RUN_DIR[,RUN_DIR...] (repeat per variant; dirs = seeds)")
    ap.add_argument("--out", required=True, help="directory for results.md, results.json, PNGs")
    ap.add_argument("--last-n", type=int, default=5, help="steps averaged at the end of a run")
    ap.add_argument("--acc-key", default=None, help="metric for the final accuracy (default auto)")
    ap.add_argument("--title", default="Run comparison")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    try:
        variants: dict[str, list[list[dict]]] = {}
        sources: dict[str, list[str]] = {}
        for spec in args.variant:
            name, dirs = parse_variant(spec)
            if name in variants:
                raise ValueError(f"--variant {name!r} given twice")
            variants[name] = [plot_run.load_metrics(d) for d in dirs]
            sources[name] = dirs
        table, numbers = compare(variants, last_n=args.last_n, acc_key=args.acc_key)
    except ValueError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    plots = [] if args.no_plots else plot_run.plot_runs(variants, args.out)
    numbers["runs"] = sources
    body = [f"# {args.title}", "", table,
            f"Accuracy in percent; mean ± sample std over seeds; last-{args.last_n} columns "
            "average the last logged steps of each run.", ""]
    body += [f"![{os.path.splitext(os.path.basename(p))[0]}]({os.path.basename(p)})" for p in plots]
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(body) + "\n")
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(_json_safe(numbers), f, indent=2)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
