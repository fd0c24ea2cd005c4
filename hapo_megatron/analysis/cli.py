"""``python -m hapo_megatron.analysis``: the token diagnostics report of saved rollout files."""

from __future__ import annotations

import argparse
import json
from typing import Sequence

from hapo_megatron.analysis.rollouts import analyze_rollouts, format_report, read_rollouts


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hapo_megatron.analysis",
                                 description="Token diagnostics of saved HAPO rollouts.")
    ap.add_argument("files", nargs="+", help="rollout files (.jsonl, .jsonl.gz, .parquet)")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer dir to decode token ids")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--pivot", type=float, default=0.8, help="entropy pivot quantile")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    args = ap.parse_args(argv)
    records = [r for path in args.files for r in read_rollouts(path)]
    tok = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    report = analyze_rollouts(records, tokenizer=tok, top_k=args.top_k,
                              entropy_pivot_q=args.pivot)
    print(format_report(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, default=float)
    return 0
