"""What EDGE-GRPO's guided error correction did to a run's saved rollouts (docs/algorithm.md,
"EDGE-GRPO on the CPU task"): per saved step, how many responses carry the reflection cue or the
hint, how many of those were empty before the correction (the cue or hint is their first token),
how long the policy's continuation after the cue is, and the advantage given to each response's
first token, summed per token (the push on the policy's first choice).

    python examples/cpu_tiny/edge_gec_rollouts.py runs/compare_cpu_tiny_baselines/edge-grpo_s1

Reads the run's ``config.yaml`` (the cue, the hint, the tokenizer) and ``rollouts/step_*.jsonl``
(saved with ``logging.save_rollouts_interval``). A corrected response is told apart by its token ids:
the cue's, and the hint's up to ``{answer}``, each tokenized alone as the correction does (with a
BPE tokenizer the hint's prefix may merge with the answer; the CPU task's tokenizer is per
character). The solution branch's rows look like correct answers and are counted with them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
from typing import Sequence

import yaml

from hapo_megatron.analysis.rollouts import read_rollouts


def _find(ids: Sequence[int], part: Sequence[int]) -> int:
    """Start of the first occurrence of ``part`` in ``ids`` (-1 if none)."""
    n = len(part)
    for i in range(len(ids) - n + 1):
        if list(ids[i:i + n]) == list(part):
            return i
    return -1


def step_summary(records: Sequence[dict], cue_ids: Sequence[int], hint_ids: Sequence[int],
                 stop_ids: Sequence[int]) -> dict:
    """Counts of one saved step (module doc); ``first_token_adv``: first token id -> (rows, summed
    advantage of that token in the loss, ``adv_after``)."""
    kinds = collections.Counter()
    continuation, first = [], collections.defaultdict(lambda: [0, 0.0])
    for rec in records:
        ids = [int(t) for t in rec["response_ids"]]
        if not ids:
            kinds["empty"] += 1
            continue
        at_cue, at_hint = _find(ids, cue_ids), _find(ids, hint_ids)
        if at_cue >= 0:
            kinds["reflect"] += 1
            kinds["reflect_on_empty"] += at_cue == 0
            tail = ids[at_cue + len(cue_ids):]
            continuation.append(len(tail) - (bool(tail) and tail[-1] in stop_ids))
        elif at_hint >= 0:
            kinds["hint"] += 1
            kinds["hint_on_empty"] += at_hint == 0
        else:
            kinds["correct" if rec.get("acc") else "wrong"] += 1
        adv = rec.get("adv_after") or rec.get("adv_before")
        if adv:
            first[ids[0]][0] += 1
            first[ids[0]][1] += float(adv[0])
    return {"rows": len(records), **{k: kinds[k] for k in
            ("reflect", "reflect_on_empty", "hint", "hint_on_empty", "correct", "wrong", "empty")},
            "continuation_mean": sum(continuation) / len(continuation) if continuation else None,
            "first_token_adv": {tok: (n, s) for tok, (n, s) in first.items()}}


def _cell(text: str) -> str:
    return repr(text)[1:-1].replace("|", "\\|")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    args = ap.parse_args(argv)
    with open(os.path.join(args.run_dir, "config.yaml")) as f:
        cfg = yaml.safe_load(f)
    from transformers import AutoTokenizer  # only here: the module imports without it

    tok = AutoTokenizer.from_pretrained(cfg["data"]["tokenizer_path"])
    algo = cfg["algo"]
    cue_ids = tok.encode(algo["edge_gec_cue"], add_special_tokens=False)
    hint_ids = tok.encode(algo["edge_gec_hint"].split("{answer}")[0], add_special_tokens=False)
    stop_ids = [tok.eos_token_id]
    paths = sorted(glob.glob(os.path.join(args.run_dir, "rollouts", "step_*.jsonl*")))
    if not paths:
        print(f"{args.run_dir}: no saved rollouts (logging.save_rollouts_interval)", file=sys.stderr)
        return 1
    print("| step | rows | reflect (on empty) | hint (on empty) | correct or solution | wrong, not corrected "
          "| tokens after the cue | first token: rows, summed advantage |")
    print("|---|---|---|---|---|---|---|---|")
    for path in paths:
        records = read_rollouts(path)
        s = step_summary(records, cue_ids, hint_ids, stop_ids)
        cont = "—" if s["continuation_mean"] is None else f"{s['continuation_mean']:.1f}"
        firsts = ", ".join(f"`{_cell(tok.decode([t]))}`: {n}, {adv:+.1f}" for t, (n, adv) in
                           sorted(s["first_token_adv"].items(), key=lambda kv: -kv[1][0]))
        print(f"| {records[0]['step'] if records else '?'} | {s['rows']} | {s['reflect']} ({s['reflect_on_empty']}) "
              f"| {s['hint']} ({s['hint_on_empty']}) | {s['correct']} | {s['wrong']} | {cont} | {firsts} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
