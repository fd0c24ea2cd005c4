"""The paper's token diagnostics of one or several variants, from their runs' saved rollouts
(`logging.save_rollouts_interval`) and per-step loss metrics (``hapo analyze plot-tokens``,
``hapo analyze compare --tokens``; docs/evaluation.md, "Plots and comparisons").

`token_diagnostics` writes, per call:
- `entropy_hist.png`: histogram of the old-policy token entropies (log bins), one panel per
  variant, stacked by token role when roles are given, with the median of the steps' pivots;
- `temperature_vs_entropy.png`: the sampling temperature of each token against its entropy;
- `clip_side_entropy.png`: share of high-/low-entropy tokens clipped at the left (1 - eps_L) and
  right (1 + eps_R) bound, over all PPO updates (`loss/clip{low,high}_{high,low}_entropy`);
- `adv_scale.png`: |A'|/|A| per entropy branch over training steps (`loss/adv_scale_*`, all PPO
  updates) and, from the saved rollouts, against h_hat in each token's last update (rollouts
  saved before the loss reported its own values hold the first update's);
- `tokens.json`: per variant the token count, entropy quantiles, the share of tokens above the
  pivot (h_hat > 0), and per role: token share, mean entropy, share above the pivot, and the
  roles' share of the above-pivot tokens.
Roles: `steps` (hapo_megatron.data.steps.token_roles) needs a tokenizer to decode ids. The
figures are drawn by `plots` (matplotlib, imported when drawing).
"""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
from typing import Callable, Sequence

from hapo_megatron.analysis import plots
from hapo_megatron.analysis.rollouts import read_rollouts
from hapo_megatron.analysis.run_metrics import load_metrics, series

QUANTILES = (0.1, 0.5, 0.8, 0.9, 0.99)


def no_rollouts_reason(run_dir: str) -> str:
    """Why ``run_dir`` has no saved rollouts, for the error: its logging.save_rollouts_interval."""
    import yaml
    try:
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
            interval = ((yaml.safe_load(f) or {}).get("logging") or {}).get("save_rollouts_interval", 0)
    except (OSError, yaml.YAMLError):
        interval = None
    if interval == 0:
        return ("its logging.save_rollouts_interval is 0 (the default): train with logging.save_rollouts_interval=N "
                "to save every N-th step's rollouts")
    return f"logging.save_rollouts_interval={interval}" if interval else "no config.yaml says how it saved them"


def load_records(run_dirs: Sequence[str]) -> list[dict]:
    """Saved-rollout records of every `rollouts/step_*.jsonl` of the runs, in order. A run that is
    no directory or saved no rollouts is refused (ValueError naming it)."""
    records = []
    for d in run_dirs:
        if not os.path.isdir(d):
            why = "is not a directory" if os.path.exists(d) else "does not exist"
            raise ValueError(f"run directory {d!r} {why}")
        paths = sorted(glob.glob(os.path.join(d, "rollouts", "step_*.jsonl*")))
        if not paths:
            raise ValueError(f"{d} has no saved rollouts ({os.path.join(d, 'rollouts', 'step_*.jsonl')}): "
                             + no_rollouts_reason(d))
        for p in paths:
            records.extend(read_rollouts(p))
    return records


def quantile(sorted_vals: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (`round(q * (n - 1))`, as the trainer's pivot)."""
    if not sorted_vals:
        return math.nan
    return sorted_vals[round(q * (len(sorted_vals) - 1))]


def step_pivots(records: Sequence[dict], q: float) -> list[float]:
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


CLIP_KEYS = (("left, high-entropy", "loss/cliplow_high_entropy"),
             ("left, low-entropy", "loss/cliplow_low_entropy"),
             ("right, high-entropy", "loss/cliphigh_high_entropy"),
             ("right, low-entropy", "loss/cliphigh_low_entropy"))


def mean_over_runs_and_steps(runs: Sequence[Sequence[dict]], key: str) -> float:
    """Mean of `key` over every logged step of every run (NaN when never logged)."""
    vals = [v for rows in runs for v in series(rows, key)[1]]
    return statistics.fmean(vals) if vals else math.nan


def token_diagnostics(variants: dict[str, list[str]], out: str, *, roles: str | None = None,
                      tokenizer: str | None = None, pivot_q: float) -> tuple[dict, list[str]]:
    """Summaries and plots for `{variant: [run dirs]}`; returns (summary, paths written)."""
    roles_of = role_labeller(roles, tokenizer)
    data, metrics, summary = {}, {}, {}
    for name, dirs in variants.items():
        records = []
        for d in dirs:
            records += [{**r, "_run": d} for r in load_records([d])]
        metrics[name] = [load_metrics(d) for d in dirs]
        if records:
            summ = token_summary(records, roles_of, pivot_q)
            data[name] = (records, roles_of, summ)
            summary[name] = summ
    os.makedirs(out, exist_ok=True)
    clip = {name: {k: mean_over_runs_and_steps(runs, k) for _, k in CLIP_KEYS} for name, runs in metrics.items()}
    paths = [plots.plot_entropy_hist(data, out)] if data else []
    paths += [p for p in (plots.plot_temperature(data, out), plots.plot_clip_sides(clip, CLIP_KEYS, out),
                          plots.plot_adv_scale(metrics, data, out)) if p]
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
