"""Saved rollouts: the per-response records a training run writes every
``logging.save_rollouts_interval`` steps, and the offline report over them.

Format (`write_rollouts` / `read_rollouts`): one file per step,
`<run_dir>/rollouts/step_<step:06d>.jsonl` (optionally `.jsonl.gz` or `.parquet`), one record per
response with the fields of `ROLLOUT_FIELDS`. Per-token lists all have the response's length;
a missing optional field is `null`/absent and the diagnostics that need it are skipped.
Offline: `hapo analyze rollouts <file> [--tokenizer DIR] [--top-k 20]` (or `python -m hapo_megatron.analysis`).
"""

from __future__ import annotations

import gzip
import json
import math
import os
from typing import Any, Iterable, Sequence

import torch

from hapo_megatron.analysis.token_stats import TokenDiagnostics, entropy_pivot

#: Per-response record of a saved rollout: name -> (per_token, required).
ROLLOUT_FIELDS: dict[str, tuple[bool, bool]] = {
    "step": (False, True),             # training step
    "uid": (False, True),              # prompt group id
    "data_source": (False, False),
    "reward": (False, False),          # scalar reward after shaping
    "acc": (False, False),             # verified-correct answer
    "finish_reason": (False, False),   # "stop" | "length"
    "response_ids": (True, True),      # sampled token ids
    "entropy": (True, False),          # old-policy entropy at T_base
    "h_hat": (True, False),            # normalised entropy in [-1, 1]
    "adv_before": (True, False),       # TLGA/GRPO advantage A
    # the loss's own values in the token's update of the last PPO epoch (`algo.PolicyTokenFields`):
    "adv_after": (True, False),        # redistributed advantage A'
    "ratio": (True, False),            # importance ratio rho
    "clip_low": (True, False),         # left clip active (A' < 0 and rho < 1 - eps_L_t)
    "clip_high": (True, False),        # right clip active (A' > 0 and rho > 1 + eps_R_t)
    "clip_dual": (True, False),        # dual clip active (A' < 0, the bound -A' c is the smaller)
    "temperatures": (True, False),     # sampling temperature of each token
}


def rollout_path(run_dir: str, step: int, fmt: str = "jsonl") -> str:
    """`<run_dir>/rollouts/step_<step:06d>.<fmt>` (fmt: jsonl, jsonl.gz, parquet)."""
    if fmt not in ("jsonl", "jsonl.gz", "parquet"):
        raise ValueError(f"fmt must be jsonl, jsonl.gz or parquet, got {fmt!r}")
    return os.path.join(run_dir, "rollouts", f"step_{int(step):06d}.{fmt}")


def _check_record(rec: dict, i: int, path: str) -> dict:
    for name, (per_token, required) in ROLLOUT_FIELDS.items():
        value = rec.get(name)
        if value is None:
            if required:
                raise ValueError(f"{path}: record {i} is missing field {name!r}")
            continue
        if per_token and len(value) != len(rec["response_ids"]):
            raise ValueError(f"{path}: record {i} field {name!r} has {len(value)} entries, "
                             f"response_ids has {len(rec['response_ids'])}")
    return rec


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return value


def write_rollouts(path: str, records: Iterable[dict]) -> str:
    """Write per-response records (fields of `ROLLOUT_FIELDS`; tensors become lists).

    The format follows the suffix: `.jsonl`, `.jsonl.gz` or `.parquet`. Written to a temporary
    file then renamed, so a reader never sees half a file.
    """
    rows = [_check_record({k: _plain(v) for k, v in r.items()}, i, path)
            for i, r in enumerate(records)]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp)
    else:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(tmp, "wt", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)
    return path


def read_rollouts(path: str) -> list[dict]:
    """Read a file written by `write_rollouts` (checked: required fields, per-token lengths)."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            rows = []
            for lineno, line in enumerate(f):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}: line {lineno + 1} is not JSON: {e}") from e
    return [_check_record(r, i, path) for i, r in enumerate(rows)]


def diagnostics_from_records(records: Sequence[dict]) -> TokenDiagnostics:
    """Accumulate `TokenDiagnostics` over saved-rollout records."""
    diag = TokenDiagnostics()
    for rec in records:
        n = len(rec["response_ids"])

        def get(name, dtype=torch.float64):
            v = rec.get(name)
            return None if v is None else torch.tensor(v, dtype=dtype).reshape(n)

        diag.update_tokens(entropy=get("entropy"), h_hat=get("h_hat"),
                           token_ids=get("response_ids", torch.int64),
                           clip_low=get("clip_low", torch.bool),
                           clip_high=get("clip_high", torch.bool),
                           clip_dual=get("clip_dual", torch.bool),
                           adv_before=get("adv_before"), adv_after=get("adv_after"),
                           temperatures=get("temperatures"))
        diag.update_responses([n], [rec.get("finish_reason") == "length"])
    return diag


def analyze_rollouts(records: Sequence[dict], *, tokenizer=None, top_k: int = 20,
                     entropy_pivot_q: float) -> dict:
    """Full offline report: `{"metrics", "histogram", "top_clipped_low", "top_clipped_high"}`.

    The pivot is exact here (all entropies are at hand), with the spec's nearest-rank rule.
    """
    diag = diagnostics_from_records(records)
    ents = [torch.tensor(r["entropy"], dtype=torch.float64) for r in records
            if r.get("entropy") is not None]
    pivot = entropy_pivot(torch.cat(ents), q=entropy_pivot_q) if ents else None
    if pivot is not None and math.isnan(pivot):
        pivot = None
    return {"metrics": diag.summary(pivot=pivot), "histogram": diag.histogram(),
            "top_clipped_low": diag.top_clipped_tokens("low", top_k, tokenizer),
            "top_clipped_high": diag.top_clipped_tokens("high", top_k, tokenizer)}


def format_report(report: dict) -> str:
    """Human-readable text of `analyze_rollouts` output."""
    lines = ["metrics:"]
    lines += [f"  {k:<40} {v:.6g}" for k, v in sorted(report["metrics"].items())]
    lines.append("entropy histogram (nats):")
    for row in report["histogram"]:
        if row["count"]:
            bar = "#" * max(1, int(round(40 * row["fraction"])))
            lines.append(f"  [{row['lo']:9.3g}, {row['hi']:9.3g})  {row['count']:>8}  {bar}")
    for side in ("low", "high"):
        lines.append(f"most clipped tokens, {side} side:")
        for row in report[f"top_clipped_{side}"]:
            text = f"  {row['text']!r}" if "text" in row else ""
            lines.append(f"  {row['token_id']:>8} x{row['count']}{text}")
    return "\n".join(lines)
