"""Rewrite the measured figures that the README and the examples' READMEs quote from one table,
docs/results/single_runs.json, so that no two pages disagree.

    python tools/docs_figures.py            # rewrite every marked block
    python tools/docs_figures.py --check    # exit 1 naming each block that differs (the test runs this)

A block is the text between ``<!-- figures:KIND ARG -->`` and ``<!-- /figures -->``:

- ``summary RUN_ID``: the summary the trainer prints at the end of that run (its own
  `format_summary`, so the sample looks exactly like the real thing);
- ``first-last-5 EXAMPLE PRESET``: one row per run of that example and preset, first -> last 5 steps;
- ``first-last-10 EXAMPLE``: one row per run of that example with steps 1-10 -> 91-100 figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "docs", "results", "single_runs.json")
PAGES = ("README.md", "examples/cpu_tiny/README.md")
BLOCK = re.compile(r"(<!-- figures:(?P<kind>[\w-]+) (?P<arg>[^>]*?) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)


def load_runs(path: str = TABLE) -> list[dict]:
    with open(path) as f:
        return json.load(f)["runs"]


def _pct(v) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}%" if isinstance(v, float) else f"{v}%"  # as recorded: 52.0 stays 52.0


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _wall(run: dict) -> str:
    if run["wall_min"] is None:
        return run.get("wall_note") or "-"
    return f"{run['wall_min']:.1f} min" + (f" ({run['wall_note']})" if run.get("wall_note") else "")


def render_summary(run: dict) -> str:
    from hapo_megatron.training.trainer import format_summary

    pct = lambda v: None if v is None else v / 100  # noqa: E731 - the summary holds fractions
    summary = {"run_dir": f"runs/{run['example']}_{run['preset']}", "steps": run["steps"],
               "wall_time_s": run["wall_min"] * 60, "sft_time_s": (run["warm_start_min"] or 0) * 60, "k": 5,
               "first_reward_mean": run["reward_first5"], "last_reward_mean": run["reward_last5"],
               "first_acc": pct(run["acc_first5"]), "last_acc": pct(run["acc_last5"]),
               "eval_start": {run["eval_key"]: pct(run["eval_before"])},
               "eval_end": {run["eval_key"]: pct(run["eval_after"])}}
    return "```\n" + format_summary(summary).lstrip("\n") + "\n```\n" + \
        f"(run `{run['id']}` of docs/results/single_runs.json: {run['machine']}, {run['when']}.)\n"


def render_first_last_5(runs: list[dict], example: str, preset: str) -> str:
    rows = ["| CPU (2 cores) | reward mean | accuracy | eval avg@4 before -> after RL | wall time |",
            "|---|---|---|---|---|"]
    for r in runs:
        if r["example"] == example and r["preset"] == preset and r["reward_first5"] is not None:
            rows.append(f"| {r['machine']} ({r['when']}) | {_num(r['reward_first5'], '.3f')} -> "
                        f"{_num(r['reward_last5'], '.3f')} | {_pct(r['acc_first5'])} -> {_pct(r['acc_last5'])} | "
                        f"{_pct(r['eval_before'])} -> {_pct(r['eval_after'])} | {_wall(r)} |")
    return "\n".join(rows) + "\n"


def render_first_last_10(runs: list[dict], example: str) -> str:
    rows = ["| run | command | wall time | reward, steps 1-10 -> 91-100 | accuracy, steps 1-10 -> 91-100 | "
            "eval avg@4 before -> after |", "|---|---|---|---|---|---|"]
    for r in runs:
        if r["example"] == example and r["reward_first10"] is not None:
            rows.append(f"| {r['preset'].upper()} | `{r['command']}` | {_wall(r)} | {_num(r['reward_first10'], '.2f')} "
                        f"-> {_num(r['reward_last10'], '.2f')} | {_pct(r['acc_first10'])} -> {_pct(r['acc_last10'])} | "
                        f"{_pct(r['eval_before'])} -> {_pct(r['eval_after'])} |")
    return "\n".join(rows) + "\n"


def render(kind: str, arg: str, runs: list[dict]) -> str:
    args = arg.split()
    if kind == "summary":
        by_id = {r["id"]: r for r in runs}
        if args[0] not in by_id:
            raise ValueError(f"figures block 'summary {arg}': no run {args[0]!r} in {TABLE}")
        return render_summary(by_id[args[0]])
    if kind == "first-last-5":
        return render_first_last_5(runs, *args)
    if kind == "first-last-10":
        return render_first_last_10(runs, *args)
    raise ValueError(f"unknown figures block kind {kind!r} (summary, first-last-5, first-last-10)")


def rewrite(text: str, runs: list[dict]) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group("kind"), m.group("arg"), runs) + m.group(5), text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only report blocks that differ from the table (exit 1)")
    args = ap.parse_args(argv)
    runs, stale = load_runs(), []
    for page in PAGES:
        path = os.path.join(ROOT, page)
        text = open(path).read()
        new = rewrite(text, runs)
        if new != text:
            stale.append(page)
            if not args.check:
                with open(path, "w") as f:
                    f.write(new)
    if args.check and stale:
        print(f"figures differ from docs/results/single_runs.json in: {', '.join(stale)} "
              "(run `python tools/docs_figures.py`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
