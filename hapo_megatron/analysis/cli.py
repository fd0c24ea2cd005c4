"""``hapo analyze``: the offline analysis of runs (docs/evaluation.md).

    hapo analyze rollouts FILE [FILE ...] [--tokenizer DIR] [--top-k K] [--pivot Q] [--json PATH]
    hapo analyze compare --variant NAME=RUN_DIR[,RUN_DIR...] ... --out DIR [--baseline NAME] ...
    hapo analyze paired-stats DIFF [DIFF ...] | --treatment [SEED=]V,... --baseline [SEED=]V,...
    hapo analyze plot-run DIR|LABEL=DIR[,DIR...] ... --out DIR [--smooth N] [--dpi D]
    hapo analyze plot-tokens DIR|LABEL=DIR[,DIR...] ... --out DIR [--roles steps --tokenizer DIR]

``python -m hapo_megatron.analysis FILE ...`` is ``hapo analyze rollouts FILE ...``. The argument
parsing and printing live here; what each command computes lives in its module (`rollouts`,
`run_comparison`, `paired_stats`, `plots`, `run_tokens`), each imported when its command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from hapo_megatron.algo.loss_config import PolicyLossConfig
from hapo_megatron.refusal import OneLineParser, path_error_line

__all__ = ["main", "rollouts_main", "build_parser"]


def _add_rollouts_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("files", nargs="+", help="rollout files (.jsonl, .jsonl.gz, .parquet)")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer dir to decode token ids")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--pivot", type=float, default=PolicyLossConfig().entropy_pivot,
                    help="entropy pivot quantile (default: algo.entropy_pivot's)")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")


def _rollouts(args) -> int:
    from hapo_megatron.analysis.rollouts import analyze_rollouts, format_report, read_rollouts

    records = [r for path in args.files for r in read_rollouts(path)]
    tok = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    report = analyze_rollouts(records, tokenizer=tok, top_k=args.top_k, entropy_pivot_q=args.pivot)
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, default=float)
    return 0


def _add_compare_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--variant", action="append", required=True,
                    help="NAME=RUN_DIR[,RUN_DIR...] (repeat per variant; dirs = seeds)")
    ap.add_argument("--out", required=True, help="directory for results.md, results.json, PNGs")
    ap.add_argument("--last-n", type=int, default=5, help="steps averaged at the end of a run")
    ap.add_argument("--acc-key", default=None, help="metric for the final accuracy (default auto)")
    ap.add_argument("--baseline", default=None, help="variant the others are paired against (by seed)")
    ap.add_argument("--rerun", action="append", default=[], help="RUN_DIR=RERUN_DIR: must match exactly")
    ap.add_argument("--command", default=None, help="the command that made the runs (quoted on the page)")
    ap.add_argument("--tokens", action="store_true",
                    help="add the token diagnostics of 'hapo analyze plot-tokens' (saved rollouts needed)")
    ap.add_argument("--roles", default=None, help="token roles for --tokens (as plot-tokens --roles)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir for --roles")
    ap.add_argument("--title", default="Run comparison")
    ap.add_argument("--no-plots", action="store_true")


def _compare(args) -> int:
    from hapo_megatron.analysis.run_comparison import compare_runs

    res = compare_runs(args.variant, args.out, last_n=args.last_n, acc_key=args.acc_key, baseline=args.baseline,
                       reruns=args.rerun, command=args.command, title=args.title, plots=not args.no_plots,
                       tokens=args.tokens, roles=args.roles, tokenizer=args.tokenizer)
    print(res["table"] + ("\n" + res["paired"] if res["paired"] else ""))
    for r in res["reruns"]:
        print(f"determinism: {r['rerun']} vs {r['run']}: " + ("identical" if r["identical"] else
              "MISMATCH " + "; ".join(r["mismatches"][:5])))
    return 1 if any(not r["identical"] for r in res["reruns"]) else 0


def _add_paired_stats_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("diffs", nargs="*", type=float, help="paired differences (treatment - baseline), one per seed")
    ap.add_argument("--treatment", default=None, help="[SEED=]VALUE,... of the treatment (seed = position if none)")
    ap.add_argument("--baseline", default=None, help="[SEED=]VALUE,... of the baseline, paired by seed")
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--n-boot", type=int, default=10000, help="bootstrap resamples")
    ap.add_argument("--seed", type=int, default=0, help="seed of the bootstrap")
    ap.add_argument("--scale", type=float, default=100.0,
                    help="the verdict's unit: 100 = values are fractions, reported in points")
    ap.add_argument("--json", default=None, help="also write the numbers as JSON here")


def _seed_values(text: str, option: str) -> dict[int, float]:
    """``"1=0.6,2=0.7"`` or ``"0.6,0.7"`` (seeds 1, 2, ...) -> {seed: value}."""
    out: dict[int, float] = {}
    for i, item in enumerate(x for x in text.split(",") if x.strip()):
        seed, sep, value = item.partition("=")
        try:
            key, val = (int(seed), float(value)) if sep else (i + 1, float(item))
        except ValueError:
            raise ValueError(f"{option} {text!r}: expected [SEED=]VALUE,...") from None
        if key in out:
            raise ValueError(f"{option} {text!r}: seed {key} given twice")
        out[key] = val
    return out


def _paired_stats(args) -> int:
    from hapo_megatron.analysis.paired_stats import paired_differences, paired_summary

    if (args.treatment is None) != (args.baseline is None):
        raise ValueError("give both --treatment and --baseline, or the differences")
    if args.treatment is not None:
        if args.diffs:
            raise ValueError("give the differences or --treatment/--baseline, not both")
        by_seed = paired_differences(_seed_values(args.treatment, "--treatment"),
                                     _seed_values(args.baseline, "--baseline"))
    else:
        by_seed = {i + 1: d for i, d in enumerate(args.diffs)}
    res = paired_summary(list(by_seed.values()), args.confidence, n_boot=args.n_boot, seed=args.seed,
                         scale=args.scale, unit=" points" if args.scale == 100.0 else "")
    res["seeds"], res["differences"] = list(by_seed), list(by_seed.values())
    pct = f"{args.confidence:.0%}"
    print(f"paired seeds: {res['n']} ({', '.join(map(str, res['seeds']))})\n"
          f"mean difference: {res['mean']:+.6g} (sd {res['sd']:.6g})\n"
          f"{pct} t-interval: [{res['lower']:+.6g}, {res['upper']:+.6g}] (t = {res['t']:.4f}, df = {res['n'] - 1})\n"
          f"{pct} bootstrap: [{res['bootstrap_lower']:+.6g}, {res['bootstrap_upper']:+.6g}] "
          f"({args.n_boot} resamples)\n"
          f"verdict: {res['verdict']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0


def _add_plot_run_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("runs", nargs="+", help="DIR or LABEL=DIR[,DIR...] (run dirs or metrics.jsonl)")
    ap.add_argument("--out", required=True, help="output directory for the PNGs")
    ap.add_argument("--smooth", type=int, default=1, help="moving-average window (steps)")
    ap.add_argument("--dpi", type=int, default=100)


def _plot_run(args) -> int:
    from hapo_megatron.analysis.plots import plot_runs
    from hapo_megatron.analysis.run_metrics import group_run_specs, load_metrics

    runs = {label: [load_metrics(d) for d in dirs] for label, dirs in group_run_specs(args.runs).items()}
    for p in plot_runs(runs, args.out, window=args.smooth, dpi=args.dpi):
        print(p)
    return 0


def _add_plot_tokens_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("runs", nargs="+", help="DIR or LABEL=DIR[,DIR...]")
    ap.add_argument("--out", required=True)
    ap.add_argument("--roles", default=None, help="token roles of the task: 'steps'")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer dir (for --roles)")
    ap.add_argument("--pivot", type=float, default=PolicyLossConfig().entropy_pivot,
                    help="entropy pivot quantile (default: algo.entropy_pivot's)")


def _plot_tokens(args) -> int:
    from hapo_megatron.analysis.run_metrics import group_run_specs
    from hapo_megatron.analysis.run_tokens import format_summary, token_diagnostics

    result, paths = token_diagnostics(group_run_specs(args.runs), args.out, roles=args.roles,
                                      tokenizer=args.tokenizer, pivot_q=args.pivot)
    print(format_summary(result))
    for p in paths:
        print(p)
    return 0


# name -> (help, add arguments, run)
COMMANDS = {
    "rollouts": ("token diagnostics report of saved rollout files", _add_rollouts_arguments, _rollouts),
    "compare": ("compare variants over seeds: results.md, results.json, plots, paired intervals",
                _add_compare_arguments, _compare),
    "paired-stats": ("mean, Student-t and bootstrap intervals of paired differences over seeds",
                     _add_paired_stats_arguments, _paired_stats),
    "plot-run": ("training curves of runs from their metrics.jsonl (PNGs)", _add_plot_run_arguments, _plot_run),
    "plot-tokens": ("token diagnostics of runs' saved rollouts: plots and tokens.json",
                    _add_plot_tokens_arguments, _plot_tokens),
}


def build_parser(prog: str = "hapo analyze") -> argparse.ArgumentParser:
    ap = OneLineParser(prog=prog, description="Offline analysis of HAPO runs (docs/evaluation.md).")
    sub = ap.add_subparsers(dest="analyze_command", metavar="{" + ",".join(COMMANDS) + "}", required=True)
    for name, (help_text, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text[:1].upper() + help_text[1:] + ".")
        add_arguments(p)
        p.set_defaults(func=run)
    return ap


def _run(args, prog: str) -> int:
    try:
        return args.func(args)
    except ValueError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as err:
        print(f"{prog}: error: {path_error_line(err)}", file=sys.stderr)  # one line naming the path
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """``hapo analyze ...``; returns the exit status (2 for bad arguments or inputs)."""
    args = build_parser().parse_args(argv)
    return _run(args, f"hapo analyze {args.analyze_command}")


def rollouts_main(argv: Sequence[str] | None = None) -> int:
    """``python -m hapo_megatron.analysis FILE ...``: the same as ``hapo analyze rollouts``."""
    ap = argparse.ArgumentParser(prog="python -m hapo_megatron.analysis",
                                 description="Token diagnostics of saved HAPO rollouts (= hapo analyze rollouts).")
    _add_rollouts_arguments(ap)
    ap.set_defaults(func=_rollouts)
    return _run(ap.parse_args(argv), ap.prog)
