"""Reading and writing prompt rows in the verl/DAPO layout (parquet or JSONL).

One row::

    {"data_source": "arithmetic",
     "prompt": [{"role": "user", "content": "What is 37 + 48? ..."}],
     "reward_model": {"ground_truth": "85", "style": "rule"},
     "extra_info": {...}}                      # optional, free-form

A plain string prompt is accepted as one user message. ``ground_truth`` may be a string or a
number (stored as a string). Every malformed row raises a ValueError naming the file, the 0-based
row index and the field.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

__all__ = ["load_prompt_rows", "validate_row", "write_rows", "SUPPORTED_SUFFIXES"]

SUPPORTED_SUFFIXES = (".parquet", ".jsonl")


def math_row(*, data_source: str, question: str, answer: Any, extra_info: dict) -> dict:
    """One verl/DAPO-layout row of a generated math task (single user turn, rule reward)."""
    return {"data_source": data_source, "prompt": [{"role": "user", "content": question}],
            "ability": "math", "reward_model": {"ground_truth": str(answer), "style": "rule"},
            "extra_info": extra_info}


def _suffix(path: str) -> str:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise ValueError(f"path {path!r}: unsupported file type {suffix!r}; use .parquet or .jsonl")
    return suffix


def _read_jsonl(path: str) -> list[Any]:
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: row {len(rows)} (line {line_no}) is not valid JSON: {err}") from None
    return rows


def _read_parquet(path: str) -> list[Any]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _messages(value: Any, where: str, prompt_key: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{where}: field {prompt_key!r} is an empty string")
        return [{"role": "user", "content": value}]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}: field {prompt_key!r} must be a non-empty list of chat messages "
                         f"{{'role', 'content'}}, got {type(value).__name__}")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise ValueError(f"{where}: field {prompt_key}[{i}] must be a message dict, got {type(msg).__name__}")
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                what = "missing" if msg.get(key) is None else f"not a string ({type(msg[key]).__name__})"
                raise ValueError(f"{where}: field {prompt_key}[{i}].{key} is {what}")
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


def validate_row(row: Any, path: str, index: int, prompt_key: str) -> dict[str, Any]:
    """Check one row and return a normalised copy (messages list, ground_truth as str)."""
    where = f"{path}: row {index}"
    if not isinstance(row, dict):
        raise ValueError(f"{where} must be an object, got {type(row).__name__}")
    if row.get(prompt_key) is None:
        raise ValueError(f"{where}: missing field {prompt_key!r}")
    reward = row.get("reward_model")
    if not isinstance(reward, dict):
        what = "missing" if reward is None else f"not a mapping ({type(reward).__name__})"
        raise ValueError(f"{where}: field 'reward_model' is {what}; expected {{'ground_truth': ...}}")
    truth = reward.get("ground_truth")
    if truth is None:
        raise ValueError(f"{where}: missing field 'reward_model.ground_truth'")
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        raise ValueError(f"{where}: field 'reward_model.ground_truth' must be a string or number, "
                         f"got {type(truth).__name__}")
    source = row.get("data_source")
    if not isinstance(source, str) or not source:
        what = "missing" if source is None else f"invalid ({source!r})"
        raise ValueError(f"{where}: field 'data_source' is {what}; expected a non-empty string")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"{where}: field 'extra_info' must be a mapping, got {type(extra).__name__}")
    out = dict(row)
    out[prompt_key] = _messages(row[prompt_key], where, prompt_key)
    out["reward_model"] = {**reward, "ground_truth": str(truth), "style": reward.get("style") or "rule"}
    out["extra_info"] = dict(extra or {})
    return out


def load_prompt_rows(path: str, prompt_key: str) -> list[dict[str, Any]]:
    """Read and validate every row of a .parquet or .jsonl prompt file."""
    suffix = _suffix(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file not found: {path}")
    raw = _read_parquet(path) if suffix == ".parquet" else _read_jsonl(path)
    return [validate_row(row, path, i, prompt_key) for i, row in enumerate(raw)]


def write_rows(rows: Iterable[dict[str, Any]], path: str) -> str:
    """Write rows as .jsonl or .parquet (by suffix), creating parent directories; returns path."""
    suffix = _suffix(path)
    rows = list(rows)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if suffix == ".jsonl":
        with open(path, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if rows and all(not row.get("extra_info") for row in rows):
            # parquet cannot store a struct column without fields
            rows = [{k: v for k, v in row.items() if k != "extra_info"} for row in rows]
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path
