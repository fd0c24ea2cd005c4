"""Compare variants (HAPO, DAPO, ablations) over seeds: a Markdown table plus plots
(``hapo analyze compare``; docs/evaluation.md, "Plots and comparisons").

    hapo analyze compare \
        --variant hapo=runs/hapo_s1,runs/hapo_s2 --variant dapo=runs/dapo_s1,runs/dapo_s2 \
        --out docs/results/cpu_tiny --last-n 5

For every run (a directory with `metrics.jsonl`): the final accuracy (last logged value of the
accuracy key: the largest-k `eval/all/avg@k` when the runs logged evaluations, else
`rollout/acc`) and the mean over its last N logged steps of training accuracy, reward, mean
entropy and response length. The training accuracy is the policy's own (`policy_acc_last_n`): a
run with EDGE-GRPO's guided error correction counts the corrected responses in `rollout/acc`, so
its accuracy is taken from before the correction, `1 - gec/wrong_frac`. Per variant: mean +-
sample standard deviation over its runs (seeds). `compare_runs` writes `<out>/results.md`,
`<out>/results.json` and the plots of `plots.plot_runs` (variants overlaid, seeds as mean +
min-max band).

Paired comparisons (`baseline`): runs are matched by seed (`trainer.seed` of each run's
resolved `config.yaml`); for every other variant, the per-seed differences to the baseline of the
final (held-out) accuracy and of the last-N training accuracy, their mean and a 95% Student-t
interval over seeds (`mean +- t_{n-1} sd / sqrt(n)`, `paired_stats`), plus a percentile
bootstrap interval; an interval containing 0 is reported as "no measurable difference".

A hand-written `<out>/notes.md`, when present, is appended to `results.md` (context that a
rerun of the comparison must not erase).

Determinism (`reruns`, `RUN_DIR=RERUN_DIR`): every logged metric of the two runs must be equal
(timing and throughput keys excepted); a mismatch is reported (the command exits 1).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from typing import Callable, Sequence

from hapo_megatron.analysis import paired_stats
from hapo_megatron.algo.loss_config import PolicyLossConfig
from hapo_megatron.analysis.plots import plot_runs
from hapo_megatron.analysis.run_metrics import load_metrics, series
from hapo_megatron.analysis.run_tokens import CLIP_KEYS, format_summary, token_diagnostics

#: metric key prefixes that measure time, not behaviour (left out of the determinism check)
NONDETERMINISTIC_PREFIXES = ("timing/", "perf/", "time/")

def final_value(rows: Sequence[dict], key: str) -> float:
    """Last finite value of `key` (NaN when never logged)."""
    _, vals = series(rows, key)
    return vals[-1] if vals else math.nan


def last_n_mean(rows: Sequence[dict], key: str, n: int) -> float:
    """Mean of the last `n` finite values of `key` (NaN when never logged)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    _, vals = series(rows, key)
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


def policy_acc_last_n(rows: Sequence[dict], n: int) -> float:
    """Mean training accuracy of the policy's own responses over the last `n` logged steps:
    `rollout/acc`, or `1 - gec/wrong_frac` for a run that logged it (EDGE-GRPO's correction
    rewrites wrong responses before `rollout/acc` counts them; docs/algorithm.md, "EDGE-GRPO")."""
    if any("gec/wrong_frac" in r for r in rows):
        return 1.0 - last_n_mean(rows, "gec/wrong_frac", n)
    return last_n_mean(rows, "rollout/acc", n)


def _last_n_of(key: str) -> Callable[[Sequence[dict], int], float]:
    return lambda rows, n: last_n_mean(rows, key, n)


# (column title, value of a run's last n steps, kind) of the last-N columns; kind picks the number format.
LAST_N_COLUMNS = [
    ("acc", policy_acc_last_n, "pct"),
    ("reward", _last_n_of("rollout/reward_mean"), "num"),
    ("entropy", _last_n_of("entropy/mean"), "num"),
    ("length", _last_n_of("rollout/response_length_mean"), "len"),
]


def run_summary(rows: Sequence[dict], acc_key: str, last_n: int) -> dict[str, float]:
    """The numbers of one run that go into the table."""
    out = {"steps": float(rows[-1]["step"]) if rows else math.nan,
           "final_acc": final_value(rows, acc_key)}
    for title, value, _ in LAST_N_COLUMNS:
        out[title] = value(rows, last_n)
    return out


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (ddof 1) of the finite values; std NaN for fewer than two."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return math.nan, math.nan
    return statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else math.nan


def fmt(mean: float, std: float, kind: str) -> str:
    """`45.2 ± 3.1` (percent), `0.123 ± 0.010`, `312.4 ± 5.0`, `0.00123 ± 0.00045` (``sig``: 3
    significant digits); `n/a` when missing."""
    if not math.isfinite(mean):
        return "n/a"
    if kind == "sig":
        return f"{mean:.3g}" + (f" ± {std:.2g}" if math.isfinite(std) else "")
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


#: (row title, metric key, kind) of the methods' own metrics (docs/algorithm.md): a row appears
#: when some variant's runs logged the key
METHOD_METRICS = [
    ("high-entropy tokens (h_hat > 0)", "loss/high_entropy_frac", "pct"),
    ("tokens clipped (any bound)", "loss/clipfrac", "pct"),
    ("forking tokens: selected", "loss/selected_frac", "pct"),
    ("forking tokens: entropy of the selected", "loss/selected_entropy", "num"),
    ("forking tokens: entropy of the others", "loss/unselected_entropy", "num"),
    ("Archer: high-entropy side", "loss/archer_high_frac", "pct"),
    ("Archer: high side clipped", "loss/archer_high_clipfrac", "pct"),
    ("Archer: low side clipped", "loss/archer_low_clipfrac", "pct"),
    ("Archer: entropy, high side", "loss/archer_high_entropy", "num"),
    ("Archer: entropy, low side", "loss/archer_low_entropy", "num"),
    ("KL to the reference", "loss/kl", "sig"),
    ("EDGE-GRPO: advantage scale, max", "adv/edge_eda_scale_max", "num"),
    ("EDGE-GRPO: advantage scale, min", "adv/edge_eda_scale_min", "num"),
    ("GEC: wrong before the correction", "gec/wrong_frac", "pct"),
    ("GEC: corrected", "gec/corrected_frac", "pct"),
    ("GEC: corrected ones then right", "gec/fixed_frac", "pct"),
    ("GEC: reflections then right", "gec/reflect_fixed_frac", "pct"),
    ("Clip-Cov / KL-Cov: selected", "loss/cov_selected_frac", "pct"),
    ("Clip-Cov / KL-Cov: covariance mean", "cov/mean", "sig"),
    ("Clip-Cov / KL-Cov: covariance p99", "cov/p99", "sig"),
    ("GSPO / GMPO: sequence ratio", "loss/seq_ratio_mean", "num"),
    ("GSPO / GMPO: mean abs(sequence ratio - 1)", "loss/seq_ratio_abs_dev", "sig"),
    ("SAPO: gate weight", "loss/sapo_gate_weight", "num"),
]


def run_mean(rows: Sequence[dict], key: str) -> float:
    """Mean of every finite logged value of `key` over the run (NaN when never logged)."""
    _, vals = series(rows, key)
    return math.fsum(vals) / len(vals) if vals else math.nan


def method_table(variants: dict[str, list[list[dict]]]) -> tuple[str | None, dict]:
    """Markdown table of `METHOD_METRICS` (rows) per variant (columns): each run's mean over its
    steps, then mean ± sample std over the seeds; `—` where a variant did not log the key. None
    when no variant logged any of them."""
    names = list(variants)
    lines = ["| metric (mean over steps) | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    numbers: dict = {}
    for title, key, kind in METHOD_METRICS:
        per_run = {name: [run_mean(rows, key) for rows in runs] for name, runs in variants.items()}
        if not any(math.isfinite(v) for vals in per_run.values() for v in vals):
            continue
        stats = {name: mean_std(vals) for name, vals in per_run.items()}
        numbers[key] = {name: {"runs": vals, "mean": stats[name][0], "std": stats[name][1]}
                        for name, vals in per_run.items()}
        lines.append(f"| {title} (`{key}`) | " + " | ".join(
            fmt(*stats[n], kind) if math.isfinite(stats[n][0]) else "—" for n in names) + " |")
    return ("\n".join(lines) + "\n" if numbers else None), numbers


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
                row.update(paired_stats.paired_summary(list(diffs.values()), confidence))
                cells = [f"{row['mean'] * 100:+.1f}", f"[{row['lower'] * 100:+.1f}, {row['upper'] * 100:+.1f}]",
                         f"[{row['bootstrap_lower'] * 100:+.1f}, {row['bootstrap_upper'] * 100:+.1f}]",
                         row["verdict"]]
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
        bad = metric_mismatches(load_metrics(orig), load_metrics(rerun))
        out.append({"run": orig, "rerun": rerun, "identical": not bad, "mismatches": bad})
    return out


def results_page(table: str, numbers: dict, seeds: dict, paired: str | None, reruns: list[dict],
                 plots: list[str], *, title: str, command: str | None, last_n: int, baseline: str | None,
                 methods: str | None = None) -> str:
    """The Markdown of `<out>/results.md`."""
    body = [f"# {title}", ""]
    if command:
        body += [f"Made by `{command}`.", ""]
    body += ["## Accuracy per variant", "", table,
             f"Accuracy in percent; mean ± sample std over seeds; final acc = `{numbers['acc_key']}` "
             f"at the end of the run; last-{last_n} columns average the last logged training steps "
             "(acc: the policy's own responses, before EDGE-GRPO's correction where it ran).", "",
             "Final accuracy per seed:", "", per_seed_table(numbers, seeds)]
    if paired:
        body += [f"## Paired differences against {baseline}", "", paired,
                 "Differences in percentage points, `variant − baseline` per seed (same seed = same data "
                 "order, same warm start). 95% t-interval: mean ± t(0.975, n−1) · sd / √n over the paired "
                 "seeds (sd with n−1); 95% bootstrap: percentile interval of the mean over 10 000 resamples "
                 "of the seeds (narrower with few seeds; the verdict uses the t-interval). An interval "
                 "containing 0 is \"no measurable difference\".", ""]
    if methods:
        body += ["## What each method did", "", methods,
                 "Percent unless a value is an entropy (nats), a KL, a covariance, a ratio or a scale; each run's "
                 "mean over its logged steps, then mean ± sample std over seeds (docs/algorithm.md names "
                 "each metric).", ""]
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
    """The token-diagnostics part of the results page (`run_tokens`)."""
    body = ["", "## Token diagnostics", "",
            "From the saved rollouts (`logging.save_rollouts_interval`) of every seed: old-policy entropy at "
            "T_base; \"above pivot\" = h_hat > 0 under the step's own entropy statistics (the trainer's "
            "high-entropy branch). Clip sides: share of each entropy class clipped at the left (1 − ε_L) or "
            "right (1 + ε_R) bound over all PPO updates, mean over steps and seeds. Numbers also in "
            "`tokens.json`.", "", format_summary(tokens)]
    clip = tokens.get("clip_side_by_entropy", {})
    if clip:
        keys = [k for _, k in CLIP_KEYS]
        body += ["| variant | " + " | ".join(t for t, _ in CLIP_KEYS) + " |",
                 "|---|" + "---|" * len(keys)]
        for name, vals in clip.items():
            cells = [f"{vals[k] * 100:.2f}%" if vals.get(k) is not None and math.isfinite(vals[k]) else "n/a"
                     for k in keys]
            body.append(f"| {name} | " + " | ".join(cells) + " |")
        body.append("")
    body += [f"![{os.path.splitext(os.path.basename(p))[0]}]({os.path.basename(p)})" for p in plots]
    return "\n".join(body) + "\n"


def compare_runs(variant_specs: Sequence[str], out: str, *, last_n: int = 5, acc_key: str | None = None,
                 baseline: str | None = None, reruns: Sequence[str] = (), command: str | None = None,
                 title: str = "Run comparison", plots: bool = True, tokens: bool = False,
                 roles: str | None = None, tokenizer: str | None = None) -> dict:
    """Read the runs of `variant_specs` (`NAME=RUN_DIR[,RUN_DIR...]`, the dirs being seeds), write
    `<out>/results.md`, `<out>/results.json` and the plots (`plots=False`: none; `tokens`: the
    token diagnostics of `run_tokens` too, `roles` / `tokenizer` as there). Returns the Markdown
    table, the paired table (None without `baseline`), the determinism checks of `reruns`
    (`RUN_DIR=RERUN_DIR`) and the numbers of `results.json`. Bad arguments raise ValueError
    before anything is written."""
    variants: dict[str, list[list[dict]]] = {}
    sources: dict[str, list[str]] = {}
    for spec in variant_specs:
        name, dirs = parse_variant(spec)
        if name in variants:
            raise ValueError(f"--variant {name!r} given twice")
        variants[name] = [load_metrics(d) for d in dirs]
        sources[name] = dirs
    seeds = {name: seeds_of(dirs) for name, dirs in sources.items()}
    table, numbers = compare(variants, last_n=last_n, acc_key=acc_key)
    paired, paired_rows = paired_comparison(numbers, seeds, baseline) if baseline else (None, [])
    checks = check_reruns(reruns)
    os.makedirs(out, exist_ok=True)
    plot_paths = plot_runs(variants, out) if plots else []
    methods, method_numbers = method_table(variants)
    numbers.update(runs=sources, seeds=seeds, paired=paired_rows, reruns=checks, methods=method_numbers)
    page = results_page(table, numbers, seeds, paired, checks, plot_paths, title=title, command=command,
                        last_n=last_n, baseline=baseline, methods=methods)
    if tokens:
        token_numbers, token_plots = token_diagnostics(sources, out, roles=roles, tokenizer=tokenizer,
                                                      pivot_q=PolicyLossConfig().entropy_pivot)
        numbers["token_diagnostics"] = token_numbers
        page += token_section(token_numbers, token_plots)
    notes = os.path.join(out, "notes.md")  # hand-written context kept across reruns
    if os.path.isfile(notes):
        with open(notes, encoding="utf-8") as f:
            page += "\n" + f.read()
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(page)
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(_json_safe(numbers), f, indent=2)
    return {"table": table, "paired": paired, "reruns": checks, "numbers": numbers}
