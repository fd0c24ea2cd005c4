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

Paired comparisons (`--baseline NAME`): runs are matched by seed (`trainer.seed` of each run's
resolved `config.yaml`); for every other variant, the per-seed differences to the baseline of the
final (held-out) accuracy and of the last-N training accuracy, their mean and a 95% Student-t
interval over seeds (`mean +- t_{n-1} sd / sqrt(n)`, `tools/paired_stats.py`), plus a percentile
bootstrap interval; an interval containing 0 is reported as "no measurable difference".

A hand-written `<out>/notes.md`, when present, is appended to `results.md` (context that a
rerun of the comparison must not erase).

Determinism (`--rerun RUN_DIR=RERUN_DIR`): every logged metric of the two runs must be equal
(timing and throughput keys excepted); a mismatch is reported and the exit status is 1.
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
import paired_stats  # noqa: E402  (sibling tool)
import plot_run  # noqa: E402  (sibling tool)

#: metric key prefixes that measure time, not behaviour (left out of the determinism check)
NONDETERMINISTIC_PREFIXES = ("timing/", "perf/", "time/")

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


def run_seed(run_dir: str) -> int | None:
    """`trainer.seed` from the run's resolved `config.yaml` (None when there is none)."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return None
    import yaml

    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f) or {}
    seed = (cfg.get("trainer") or {}).get("seed")
    return int(seed) if seed is not None else None


def seeds_of(dirs: Sequence[str]) -> list[int]:
    """The seed of each run; runs without a config are numbered 1, 2, ... by position."""
    seeds = [run_seed(d) for d in dirs]
    seeds = [s if s is not None else i + 1 for i, s in enumerate(seeds)]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"runs {list(dirs)} do not have distinct seeds ({seeds}); cannot pair them")
    return seeds


PAIRED_COLUMNS = [("final_acc", "held-out accuracy"), ("acc", "training accuracy (last N)")]


def paired_comparison(numbers: dict, seeds: dict[str, list[int]], baseline: str,
                      confidence: float = 0.95) -> tuple[str, list[dict]]:
    """Markdown table and rows of the paired differences `variant - baseline` per column of
    `PAIRED_COLUMNS`, matched by seed."""
    if baseline not in numbers["variants"]:
        raise ValueError(f"--baseline {baseline!r} is not one of the variants {list(numbers['variants'])}")
    base = dict(zip(seeds[baseline], numbers["variants"][baseline]["runs"]))
    lines = ["| comparison | metric | paired seeds | mean difference | 95% t-interval | 95% bootstrap | verdict |",
             "|---|---|---|---|---|---|---|"]
    rows = []
    for name, v in numbers["variants"].items():
        if name == baseline:
            continue
        cur = dict(zip(seeds[name], v["runs"]))
        for col, title in PAIRED_COLUMNS:
            diffs = paired_stats.paired_differences({s: r[col] for s, r in cur.items()},
                                                    {s: r[col] for s, r in base.items()})
            row = {"variant": name, "baseline": baseline, "metric": col, "seeds": sorted(diffs),
                   "differences": [diffs[s] for s in sorted(diffs)]}
            if len(diffs) >= 2:
                ci = paired_stats.paired_t_interval(list(diffs.values()), confidence)
                boot = paired_stats.bootstrap_mean_interval(list(diffs.values()), confidence)
                row.update(ci, bootstrap_lower=boot[0], bootstrap_upper=boot[1],
                           verdict=paired_stats.verdict(ci["lower"], ci["upper"]))
                cells = [f"{ci['mean'] * 100:+.1f}", f"[{ci['lower'] * 100:+.1f}, {ci['upper'] * 100:+.1f}]",
                         f"[{boot[0] * 100:+.1f}, {boot[1] * 100:+.1f}]", row["verdict"]]
            else:
                row["verdict"] = "fewer than 2 paired seeds: no interval"
                cells = ["n/a", "n/a", "n/a", row["verdict"]]
            rows.append(row)
            lines.append(f"| {name} − {baseline} | {title} | {len(diffs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", rows


def metric_mismatches(rows_a: Sequence[dict], rows_b: Sequence[dict],
                      skip_prefixes: Sequence[str] = NONDETERMINISTIC_PREFIXES, limit: int = 10) -> list[str]:
    """Differences between two runs' merged step records (every key but timings); [] = identical.
    NaN equals NaN."""
    out = []
    by_a, by_b = {r["step"]: r for r in rows_a}, {r["step"]: r for r in rows_b}
    if set(by_a) != set(by_b):
        out.append(f"steps differ: {sorted(set(by_a) ^ set(by_b))[:10]}")
    for step in sorted(set(by_a) & set(by_b)):
        a, b = by_a[step], by_b[step]
        for key in sorted(set(a) | set(b)):
            if key.startswith(tuple(skip_prefixes)):
                continue
            va, vb = a.get(key), b.get(key)
            same = va == vb or (isinstance(va, float) and isinstance(vb, float) and math.isnan(va) and math.isnan(vb))
            if not same:
                out.append(f"step {step} {key}: {va!r} != {vb!r}")
                if len(out) >= limit:
                    return out
    return out


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


def per_seed_table(numbers: dict, seeds: dict[str, list[int]]) -> str:
    """Final accuracy of every run: one row per seed, one column per variant."""
    names = list(numbers["variants"])
    all_seeds = sorted({s for v in names for s in seeds[v]})
    lines = ["| seed | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in all_seeds:
        cells = []
        for v in names:
            by_seed = dict(zip(seeds[v], numbers["variants"][v]["runs"]))
            val = by_seed.get(s, {}).get("final_acc", math.nan)
            cells.append(f"{val * 100:.1f}" if math.isfinite(val) else "n/a")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def check_reruns(specs: Sequence[str]) -> list[dict]:
    """`ORIG=RERUN` pairs -> [{"run", "rerun", "identical", "mismatches"}]."""
    out = []
    for spec in specs:
        orig, sep, rerun = spec.partition("=")
        if not sep or not orig or not rerun:
            raise ValueError(f"--rerun {spec!r}: expected RUN_DIR=RERUN_DIR")
        bad = metric_mismatches(plot_run.load_metrics(orig), plot_run.load_metrics(rerun))
        out.append({"run": orig, "rerun": rerun, "identical": not bad, "mismatches": bad})
    return out


def results_page(args, table: str, numbers: dict, seeds: dict, paired: str | None,
                 reruns: list[dict], plots: list[str]) -> str:
    """The Markdown of `<out>/results.md`."""
    body = [f"# {args.title}", ""]
    if args.command:
        body += [f"Made by `{args.command}`.", ""]
    body += ["## Accuracy per variant", "", table,
             f"Accuracy in percent; mean ± sample std over seeds; final acc = `{numbers['acc_key']}` "
             f"at the end of the run; last-{args.last_n} columns average the last logged training steps.", "",
             "Final accuracy per seed:", "", per_seed_table(numbers, seeds)]
    if paired:
        body += [f"## Paired differences against {args.baseline}", "", paired,
                 "Differences in percentage points, `variant − baseline` per seed (same seed = same data "
                 "order, same warm start). 95% t-interval: mean ± t(0.975, n−1) · sd / √n over the paired "
                 "seeds (sd with n−1); 95% bootstrap: percentile interval of the mean over 10 000 resamples "
                 "of the seeds (narrower with few seeds; the verdict uses the t-interval). An interval "
                 "containing 0 is \"no measurable difference\".", ""]
    if reruns:
        body += ["## Determinism", ""]
        for r in reruns:
            what = "reproduced every logged metric exactly (timings excepted)" if r["identical"] \
                else "DIFFERED: " + "; ".join(r["mismatches"][:5])
            body.append(f"- `{r['rerun']}` (a rerun of `{r['run']}`) {what}.")
        body.append("")
    body += ["## Training curves", "", "Mean over seeds with a min-max band.", ""]
    body += [f"![{os.path.splitext(os.path.basename(p))[0]}]({os.path.basename(p)})" for p in plots]
    return "\n".join(body) + "\n"


def token_section(tokens: dict, plots: Sequence[str]) -> str:
    """The token-diagnostics part of the results page (`tools/plot_tokens.py`)."""
    import plot_tokens

    body = ["", "## Token diagnostics", "",
            "From the saved rollouts (`logging.save_rollouts_interval`) of every seed: old-policy entropy at "
            "T_base; \"above pivot\" = h_hat > 0 under the step's own entropy statistics (the trainer's "
            "high-entropy branch). Clip sides: share of each entropy class clipped at the left (1 − ε_L) or "
            "right (1 + ε_R) bound over all PPO updates, mean over steps and seeds. Numbers also in "
            "`tokens.json`.", "", plot_tokens.format_summary(tokens)]
    clip = tokens.get("clip_side_by_entropy", {})
    if clip:
        keys = [k for _, k in plot_tokens.CLIP_KEYS]
        body += ["| variant | " + " | ".join(t for t, _ in plot_tokens.CLIP_KEYS) + " |",
                 "|---|" + "---|" * len(keys)]
        for name, vals in clip.items():
            cells = [f"{vals[k] * 100:.2f}%" if vals.get(k) is not None and math.isfinite(vals[k]) else "n/a"
                     for k in keys]
            body.append(f"| {name} | " + " | ".join(cells) + " |")
        body.append("")
    body += [f"![{os.path.splitext(os.path.basename(p))[0]}]({os.path.basename(p)})" for p in plots]
    return "\n".join(body) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME=RUN_DIR[,RUN_DIR...] (repeat per variant; dirs = seeds)")
    ap.add_argument("--out", required=True, help="directory for results.md, results.json, PNGs")
    ap.add_argument("--last-n", type=int, default=5, help="steps averaged at the end of a run")
    ap.add_argument("--acc-key", default=None, help="metric for the final accuracy (default auto)")
    ap.add_argument("--baseline", default=None, help="variant the others are paired against (by seed)")
    ap.add_argument("--rerun", action="append", default=[], help="RUN_DIR=RERUN_DIR: must match exactly")
    ap.add_argument("--command", default=None, help="the command that made the runs (quoted on the page)")
    ap.add_argument("--tokens", action="store_true",
                    help="add the token diagnostics of tools/plot_tokens.py (saved rollouts needed)")
    ap.add_argument("--roles", default=None, help="token roles for --tokens (plot_tokens --roles)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir for --roles")
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
        seeds = {name: seeds_of(dirs) for name, dirs in sources.items()}
        table, numbers = compare(variants, last_n=args.last_n, acc_key=args.acc_key)
        paired, paired_rows = (paired_comparison(numbers, seeds, args.baseline) if args.baseline
                               else (None, []))
        reruns = check_reruns(args.rerun)
    except ValueError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    plots = [] if args.no_plots else plot_run.plot_runs(variants, args.out)
    numbers.update(runs=sources, seeds=seeds, paired=paired_rows, reruns=reruns)
    page = results_page(args, table, numbers, seeds, paired, reruns, plots)
    if args.tokens:
        import plot_tokens

        tokens, token_plots = plot_tokens.token_diagnostics(sources, args.out, roles=args.roles,
                                                            tokenizer=args.tokenizer)
        numbers["token_diagnostics"] = tokens
        page += token_section(tokens, token_plots)
    notes = os.path.join(args.out, "notes.md")  # hand-written context kept across reruns
    if os.path.isfile(notes):
        with open(notes, encoding="utf-8") as f:
            page += "\n" + f.read()
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(page)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(_json_safe(numbers), f, indent=2)
    print(table + ("\n" + paired if paired else ""))
    for r in reruns:
        print(f"determinism: {r['rerun']} vs {r['run']}: " + ("identical" if r["identical"] else
              "MISMATCH " + "; ".join(r["mismatches"][:5])))
    return 1 if any(not r["identical"] for r in reruns) else 0


if __name__ == "__main__":
    sys.exit(main())
