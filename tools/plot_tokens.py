#!/usr/bin/env python
"""The paper's token diagnostics of one or several variants, from their runs' saved rollouts
(`logging.save_rollouts_interval`) and per-step loss metrics.

    python tools/plot_tokens.py hapo=runs/hapo_s1,runs/hapo_s2 dapo=runs/dapo_s1 --out plots/ \
        --tokenizer runs/cpu_steps_data/model --roles steps

Writes, per call:
- `entropy_hist.png`: histogram of the old-policy token entropies (log bins), one panel per
  variant, stacked by token role when `--roles` is given, with the median of the steps' pivots;
- `temperature_vs_entropy.png`: the sampling temperature of each token against its entropy;
- `clip_side_entropy.png`: share of high-/low-entropy tokens clipped at the left (1 - eps_L) and
  right (1 + eps_R) bound, over all PPO updates (`loss/clip{low,high}_{high,low}_entropy`);
- `adv_scale.png`: |A'|/|A| per entropy branch over training steps (`loss/adv_scale_*`, all PPO
  updates) and, from the saved rollouts, against h_hat in each token's last update (rollouts
  saved before the loss reported its own values hold the first update's);
- `tokens.json`: per variant the token count, entropy quantiles, the share of tokens above the
  pivot (h_hat > 0), and per role: token share, mean entropy, share above the pivot, and the
  roles' share of the above-pivot tokens.
Roles: `steps` (hapo_megatron.data.steps.token_roles) needs `--tokenizer` to decode ids.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
from typing import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plot_run  # noqa: E402  (sibling tool)

QUANTILES = (0.1, 0.5, 0.8, 0.9, 0.99)
# stacking order (bottom first) and colours of the known token roles; others follow in name order
ROLE_COLORS = {"result": "tab:red", "answer": "tab:orange", "operand": "tab:blue",
               "carried": "tab:cyan", "operator": "tab:purple", "format": "tab:gray",
               "other": "tab:brown", "end": "tab:green", "all": "tab:blue"}


def load_records(run_dirs: Sequence[str]) -> list[dict]:
    """Saved-rollout records of every `rollouts/step_*.jsonl` of the runs, in order."""
    from hapo_megatron.analysis import read_rollouts

    records = []
    for d in run_dirs:
        paths = sorted(glob.glob(os.path.join(d, "rollouts", "step_*.jsonl*")))
        for p in paths:
            records.extend(read_rollouts(p))
    return records


def quantile(sorted_vals: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (`round(q * (n - 1))`, as the trainer's pivot)."""
    if not sorted_vals:
        return math.nan
    return sorted_vals[round(q * (len(sorted_vals) - 1))]


def step_pivots(records: Sequence[dict], q: float = 0.8) -> list[float]:
    """The pivot entropy (nats) of every (run, step) batch of records."""
    by_step: dict = {}
    for r in records:
        by_step.setdefault((r.get("_run"), r["step"]), []).extend(r.get("entropy") or [])
    return [quantile(sorted(max(e, 1e-8) for e in ents), q) for ents in by_step.values() if ents]


def role_labeller(name: str | None, tokenizer_dir: str | None) -> Callable[[dict], list[str]] | None:
    """`record -> [role per token]` for `--roles NAME`, or None."""
    if not name:
        return None
    if name != "steps":
        raise ValueError(f"--roles must be 'steps', got {name!r}")
    if not tokenizer_dir:
        raise ValueError("--roles steps needs --tokenizer to decode the response ids")
    from transformers import AutoTokenizer

    from hapo_megatron.data.steps import token_roles

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return lambda rec: token_roles(tok.convert_ids_to_tokens(rec["response_ids"]), tok.eos_token)


def token_summary(records: Sequence[dict], roles_of=None, q: float = 0.8) -> dict:
    """Entropy quantiles, share above the pivot (h_hat > 0) and the per-role breakdown."""
    ents, above, roles = [], [], []
    for rec in records:
        e, h = rec.get("entropy"), rec.get("h_hat")
        if e is None or h is None:
            continue
        ents += e
        above += [x > 0 for x in h]
        roles += roles_of(rec) if roles_of else ["all"] * len(e)
    if not ents:
        return {"num_tokens": 0}
    s = sorted(ents)
    pivots = step_pivots(records, q)
    out = {"num_tokens": len(ents), "num_responses": len(records),
           "entropy_mean": statistics.fmean(ents),
           "entropy_quantiles": {str(k): quantile(s, k) for k in QUANTILES},
           "pivot_median_over_steps": statistics.median(pivots) if pivots else math.nan,
           "share_above_pivot": sum(above) / len(above),
           "response_length_mean": statistics.fmean(len(r["response_ids"]) for r in records)}
    n_above = max(sum(above), 1)
    out["roles"] = {}
    for role in sorted(set(roles)):
        idx = [i for i, r in enumerate(roles) if r == role]
        out["roles"][role] = {
            "share_of_tokens": len(idx) / len(roles),
            "entropy_mean": statistics.fmean(ents[i] for i in idx),
            "entropy_median": quantile(sorted(ents[i] for i in idx), 0.5),
            "share_above_pivot": sum(above[i] for i in idx) / len(idx),
            "share_of_above_pivot_tokens": sum(above[i] for i in idx) / n_above}
    return out


def _fig(plt, n: int, w: float = 5.0, h: float = 3.6):
    fig, axes = plt.subplots(1, n, figsize=(w * n, h), squeeze=False)
    return fig, list(axes.flat)


def plot_entropy_hist(plt, data: dict, out: str) -> str:
    import numpy as np

    bins = np.logspace(-4, 1, 41)
    fig, axes = _fig(plt, len(data))
    for ax, (name, (records, roles_of, summ)) in zip(axes, data.items()):
        groups: dict[str, list[float]] = {}
        for rec in records:
            e = rec.get("entropy") or []
            for x, role in zip(e, roles_of(rec) if roles_of else ["all"] * len(e)):
                groups.setdefault(role, []).append(min(max(x, 1.01e-4), 9.9))
        names = [k for k in ROLE_COLORS if k in groups] + sorted(k for k in groups if k not in ROLE_COLORS)
        ax.hist([groups[k] for k in names], bins=bins, stacked=True, label=names,
                color=[ROLE_COLORS.get(k) for k in names] if all(k in ROLE_COLORS for k in names) else None)
        ax.set_xscale("log")
        piv = summ.get("pivot_median_over_steps", math.nan)
        if math.isfinite(piv):
            ax.axvline(piv, color="k", linestyle="--", linewidth=1,
                       label=f"pivot (q=0.8) {piv:.3g}")
        ax.set_title(f"{name}: token entropy ({summ.get('num_tokens', 0)} tokens)", fontsize=10)
        ax.set_xlabel("entropy (nats, old policy at T_base; clipped to [1e-4, 10])")
        ax.set_ylabel("tokens")
        ax.legend(fontsize=7)
    return _save(plt, fig, out, "entropy_hist.png")


def plot_temperature(plt, data: dict, out: str) -> str | None:
    pts = {name: [(e, t) for rec in records if rec.get("temperatures") and rec.get("entropy")
                  for e, t in zip(rec["entropy"], rec["temperatures"])]
           for name, (records, _, _) in data.items()}
    pts = {k: v for k, v in pts.items() if v}
    if not pts:
        return None
    fig, axes = _fig(plt, 1, 6.0, 4.0)
    for i, (name, xy) in enumerate(pts.items()):
        step = max(1, len(xy) // 4000)  # at most ~4000 points per variant
        sub = xy[::step]
        axes[0].scatter([max(e, 1e-4) for e, _ in sub], [t for _, t in sub], s=3, alpha=0.4,
                        color=f"C{i}", label=name)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("entropy (nats)")
    axes[0].set_ylabel("sampling temperature")
    axes[0].set_title("Sampling temperature vs token entropy", fontsize=10)
    axes[0].legend(fontsize=7, markerscale=3)
    return _save(plt, fig, out, "temperature_vs_entropy.png")


CLIP_KEYS = (("left, high-entropy", "loss/cliplow_high_entropy"),
             ("left, low-entropy", "loss/cliplow_low_entropy"),
             ("right, high-entropy", "loss/cliphigh_high_entropy"),
             ("right, low-entropy", "loss/cliphigh_low_entropy"))


def mean_over_runs_and_steps(runs: Sequence[Sequence[dict]], key: str) -> float:
    vals = [v for rows in runs for v in plot_run.series(rows, key)[1]]
    return statistics.fmean(vals) if vals else math.nan


def plot_clip_sides(plt, metrics: dict, out: str) -> str | None:
    table = {name: [mean_over_runs_and_steps(runs, k) for _, k in CLIP_KEYS]
             for name, runs in metrics.items()}
    if all(not math.isfinite(v) for vals in table.values() for v in vals):
        return None
    fig, axes = _fig(plt, 1, 7.0, 4.0)
    width = 0.8 / max(len(table), 1)
    for i, (name, vals) in enumerate(table.items()):
        xs = [j + i * width for j in range(len(CLIP_KEYS))]
        axes[0].bar(xs, [v * 100 if math.isfinite(v) else 0.0 for v in vals], width, label=name)
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(CLIP_KEYS))])
    axes[0].set_xticklabels([t for t, _ in CLIP_KEYS], fontsize=8)
    axes[0].set_ylabel("% of the class's tokens clipped (mean over steps, seeds)")
    axes[0].set_title("Which bound clips which tokens (all PPO updates)", fontsize=10)
    axes[0].legend(fontsize=7)
    return _save(plt, fig, out, "clip_side_entropy.png")


def plot_adv_scale(plt, metrics: dict, data: dict, out: str) -> str | None:
    fig, axes = _fig(plt, 2)
    drawn = plot_run._draw_panel(axes[0], metrics, ("loss/adv_scale_high_entropy", "loss/adv_scale_low_entropy"),
                                 "|A'|/|A| per branch (all PPO updates)", "mean |A'|/|A|", 1)
    for i, (name, (records, _, _)) in enumerate(data.items()):
        pairs = [(h, abs(a2) / abs(a)) for rec in records if rec.get("adv_after") and rec.get("adv_before")
                 for h, a, a2 in zip(rec["h_hat"], rec["adv_before"], rec["adv_after"]) if a != 0]
        if not pairs:
            continue
        bins: dict[int, list[float]] = {}
        for h, r in pairs:
            bins.setdefault(min(int((h + 1) * 10), 19), []).append(r)
        xs = sorted(bins)
        axes[1].plot([x / 10 - 0.95 for x in xs], [statistics.fmean(bins[x]) for x in xs], "o-",
                     color=f"C{i}", label=name, markersize=3)
        drawn = True
    axes[1].set_xlabel("h_hat")
    axes[1].set_ylabel("mean |A'|/|A|")
    axes[1].set_title("|A'|/|A| vs h_hat, saved rollouts", fontsize=10)
    axes[1].grid(alpha=0.3)
    if axes[1].lines:
        axes[1].legend(fontsize=7)
    if not drawn:
        plt.close(fig)
        return None
    return _save(plt, fig, out, "adv_scale.png")


def _save(plt, fig, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def token_diagnostics(variants: dict[str, list[str]], out: str, *, roles: str | None = None,
                      tokenizer: str | None = None, pivot_q: float = 0.8) -> tuple[dict, list[str]]:
    """Summaries and plots for `{variant: [run dirs]}`; returns (summary, paths written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles_of = role_labeller(roles, tokenizer)
    data, metrics, summary = {}, {}, {}
    for name, dirs in variants.items():
        records = []
        for d in dirs:
            records += [{**r, "_run": d} for r in load_records([d])]
        metrics[name] = [plot_run.load_metrics(d) for d in dirs]
        if records:
            summ = token_summary(records, roles_of, pivot_q)
            data[name] = (records, roles_of, summ)
            summary[name] = summ
    os.makedirs(out, exist_ok=True)
    paths = [plot_entropy_hist(plt, data, out)] if data else []
    paths += [p for p in (plot_temperature(plt, data, out), plot_clip_sides(plt, metrics, out),
                          plot_adv_scale(plt, metrics, data, out)) if p]
    clip = {name: {k: mean_over_runs_and_steps(runs, k) for _, k in CLIP_KEYS} for name, runs in metrics.items()}
    result = {"tokens": summary, "clip_side_by_entropy": clip}
    with open(os.path.join(out, "tokens.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, default=lambda x: None)
    return result, paths


def format_summary(result: dict) -> str:
    """Markdown tables of `token_diagnostics`' summary."""
    lines = ["| variant | tokens | entropy p50 / p80 / p90 / p99 (nats) | pivot (median over steps) "
             "| share above pivot |",
             "|---|---|---|---|---|"]
    for name, s in result["tokens"].items():
        if not s.get("num_tokens"):
            continue
        q = s["entropy_quantiles"]
        lines.append(f"| {name} | {s['num_tokens']} | {q['0.5']:.3g} / {q['0.8']:.3g} / {q['0.9']:.3g} / "
                     f"{q['0.99']:.3g} | {s['pivot_median_over_steps']:.3g} | {s['share_above_pivot']:.1%} |")
    lines += ["", "| variant | role | share of tokens | mean entropy | share above pivot "
              "| share of above-pivot tokens |",
              "|---|---|---|---|---|---|"]
    for name, s in result["tokens"].items():
        for role, r in s.get("roles", {}).items():
            lines.append(f"| {name} | {role} | {r['share_of_tokens']:.1%} | {r['entropy_mean']:.3f} | "
                         f"{r['share_above_pivot']:.1%} | {r['share_of_above_pivot_tokens']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="DIR or LABEL=DIR[,DIR...]")
    ap.add_argument("--out", required=True)
    ap.add_argument("--roles", default=None, help="token roles of the task: 'steps'")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer dir (for --roles)")
    ap.add_argument("--pivot", type=float, default=0.8, help="entropy pivot quantile")
    args = ap.parse_args(argv)
    try:
        variants: dict[str, list[str]] = {}
        for spec in args.runs:
            label, dirs = plot_run.parse_run_spec(spec)
            variants.setdefault(label, []).extend(dirs)
        result, paths = token_diagnostics(variants, args.out, roles=args.roles, tokenizer=args.tokenizer,
                                          pivot_q=args.pivot)
    except ValueError as e:
        print(f"plot_tokens: error: {e}", file=sys.stderr)
        return 2
    print(format_summary(result))
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
