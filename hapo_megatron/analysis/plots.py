"""The PNG plots of `hapo analyze` (docs/evaluation.md, "Plots and comparisons"): training curves
of runs from their logged metrics (`plot_runs`; `hapo analyze plot-run`, `compare`) and the
token-diagnostics figures of `run_tokens` (`hapo analyze plot-tokens`, `compare --tokens`).

matplotlib (the ``plot`` extra) is imported only when a figure is drawn, with the headless Agg
backend, so the rest of the package does not need it.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Iterable, Sequence

from hapo_megatron.analysis.run_metrics import matching_keys, mean_band, smooth

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

# stacking order (bottom first) and colours of the known token roles; others follow in name order
ROLE_COLORS = {"result": "tab:red", "answer": "tab:orange", "operand": "tab:blue",
               "carried": "tab:cyan", "operator": "tab:purple", "format": "tab:gray",
               "other": "tab:brown", "end": "tab:green", "all": "tab:blue"}


def _pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
    plt = _pyplot()
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


def _fig(plt, n: int, w: float = 5.0, h: float = 3.6):
    fig, axes = plt.subplots(1, n, figsize=(w * n, h), squeeze=False)
    return fig, list(axes.flat)


def _save(plt, fig, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_entropy_hist(data: dict, out: str) -> str:
    """`entropy_hist.png`: per variant of `data` (`{name: (records, roles_of, summary)}`) the
    histogram of token entropies (log bins), stacked by role, with the median of the pivots."""
    import numpy as np

    plt = _pyplot()
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


def plot_temperature(data: dict, out: str) -> str | None:
    """`temperature_vs_entropy.png`: each token's sampling temperature against its entropy."""
    pts = {name: [(e, t) for rec in records if rec.get("temperatures") and rec.get("entropy")
                  for e, t in zip(rec["entropy"], rec["temperatures"])]
           for name, (records, _, _) in data.items()}
    pts = {k: v for k, v in pts.items() if v}
    if not pts:
        return None
    plt = _pyplot()
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


def plot_clip_sides(clip: dict[str, dict[str, float]], keys: Sequence[tuple[str, str]], out: str) -> str | None:
    """`clip_side_entropy.png`: per variant of `clip` (`{name: {metric key: mean}}`) one bar per
    `(title, metric key)` of `keys`; None when no variant logged any of them."""
    table = {name: [vals.get(k, math.nan) for _, k in keys] for name, vals in clip.items()}
    if all(not math.isfinite(v) for vals in table.values() for v in vals):
        return None
    plt = _pyplot()
    fig, axes = _fig(plt, 1, 7.0, 4.0)
    width = 0.8 / max(len(table), 1)
    for i, (name, vals) in enumerate(table.items()):
        xs = [j + i * width for j in range(len(keys))]
        axes[0].bar(xs, [v * 100 if math.isfinite(v) else 0.0 for v in vals], width, label=name)
    axes[0].set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    axes[0].set_xticklabels([t for t, _ in keys], fontsize=8)
    axes[0].set_ylabel("% of the class's tokens clipped (mean over steps, seeds)")
    axes[0].set_title("Which bound clips which tokens (all PPO updates)", fontsize=10)
    axes[0].legend(fontsize=7)
    return _save(plt, fig, out, "clip_side_entropy.png")


def plot_adv_scale(metrics: dict[str, list[list[dict]]], data: dict, out: str) -> str | None:
    """`adv_scale.png`: |A'|/|A| per entropy branch over the steps (`loss/adv_scale_*` of
    `metrics`) and, from the saved rollouts of `data`, against h_hat; None when neither exists."""
    plt = _pyplot()
    fig, axes = _fig(plt, 2)
    drawn = _draw_panel(axes[0], metrics, ("loss/adv_scale_high_entropy", "loss/adv_scale_low_entropy"),
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
