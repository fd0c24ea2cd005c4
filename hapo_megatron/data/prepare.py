"""``hapo data prepare``: the paper's math sets as prompt files the trainer reads (docs/data.md).

For each set: read it with the ``datasets`` library (from the hub, which honours ``HF_HOME`` and
``HF_HUB_OFFLINE``, or from a local copy), map each row to the project's layout with the set's
adapter (``math_sources``), drop repeated prompts, check every row with the loader's own check
(``rows.validate_row``) before anything is written, write the parquet file, read it back through
the trainer's ``PromptDataset`` and report the prompt lengths in tokens.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence

from hapo_megatron.data.math_sources import PAPER_SETS, SOURCES, MathSource, apply_template
from hapo_megatron.data.rows import load_prompt_rows, validate_row, write_rows

__all__ = ["SetReport", "prepare", "prepare_set", "convert_rows", "load_source", "percentile", "format_summary",
           "PERCENTILES", "set_names"]

PERCENTILES = (50, 90, 99)
#: the chat-messages column of the files written here (the trainer reads data.prompt_key)
PROMPT_COLUMN = "prompt"
_SAVED_DATASET_FILES = ("dataset_info.json", "dataset_dict.json", "state.json")


@dataclass
class SetReport:
    """What one set became: counts of the conversion and the prompt lengths of the written file."""

    name: str
    path: str
    rows_read: int = 0
    skipped: int = 0            # rows the set does not use (AMC 2022 problems)
    duplicates: int = 0         # later copies of a prompt already kept, with the same answer
    conflicts: int = 0          # prompts dropped because their copies disagree on the answer
    lengths: Optional[list[int]] = None
    max_prompt_length: int = 0
    rows: list[dict] = field(default_factory=list, repr=False)

    @property
    def written(self) -> int:
        return len(self.rows)

    @property
    def over(self) -> Optional[int]:
        return None if self.lengths is None else sum(n > self.max_prompt_length for n in self.lengths)


def set_names(name: str) -> tuple[str, ...]:
    """The sets a command name stands for (``paper``: all five)."""
    if name == "paper":
        return PAPER_SETS
    if name not in SOURCES:
        raise ValueError(f"unknown set {name!r}; choose from {', '.join([*SOURCES, 'paper'])}")
    return (name,)


def percentile(values: Sequence[int], p: float) -> int:
    """Nearest-rank percentile: the smallest value with at least p% of the values at or below it."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ValueError("hapo data prepare reads the sets with the `datasets` library: "
                         "pip install -e '.[data]' (or pip install datasets)") from None
    return datasets


def _pick_split(obj, split: str, origin: str):
    from datasets import DatasetDict

    if not isinstance(obj, DatasetDict):
        return obj
    if split in obj:
        return obj[split]
    if len(obj) == 1:
        return next(iter(obj.values()))
    raise ValueError(f"{origin}: no split {split!r}; it has {sorted(obj)}")


def _load_local(path: str, split: str):
    datasets = _datasets()
    if not os.path.exists(path):
        raise FileNotFoundError(f"--from {path}: no such file or directory")
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, f)) for f in _SAVED_DATASET_FILES):
            return _pick_split(datasets.load_from_disk(path), split, path)  # Dataset.save_to_disk
        return _pick_split(datasets.load_dataset(path), split, path)  # a directory of data files
    suffix = os.path.splitext(path)[1].lower()
    builders = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
    if suffix not in builders:
        raise ValueError(f"--from {path}: unsupported file type {suffix!r}; use .parquet, .jsonl, .json "
                         "or a directory (a saved dataset or a copy of the hub repository)")
    return datasets.load_dataset(builders[suffix], data_files=path, split="train")


def load_source(source: MathSource, from_path: Optional[str] = None):
    """``(dataset, origin)``: the set from ``from_path`` when given, else from the hub."""
    if from_path is not None:
        return _load_local(from_path, source.split), from_path
    datasets = _datasets()
    try:
        ds = datasets.load_dataset(source.hub_id, source.config, split=source.split)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as err:
        offline = os.environ.get("HF_HUB_OFFLINE", "")
        raise ValueError(f"{source.name}: cannot load {source.hub_id!r} (split {source.split!r}) from the hub or "
                         f"the datasets cache (HF_HOME={os.environ.get('HF_HOME', '')!r}, "
                         f"HF_HUB_OFFLINE={offline!r}): {err}. Load it once online, or pass a local copy with "
                         "--from PATH") from None
    return ds, source.hub_id


def _iter_rows(ds) -> Iterator[dict]:
    for batch in ds.with_format("arrow").iter(batch_size=4096):
        yield from batch.to_pylist()


def _same_answer(a: str, b: str) -> bool:
    return "".join(a.split()) == "".join(b.split())


def convert_rows(source: MathSource, raw_rows: Iterable, origin: str, total: Optional[int] = None,
                 progress: bool = True) -> SetReport:
    """The set's rows in the project's layout, repeated prompts removed, each row checked.

    A prompt seen again with the same answer is a duplicate (dropped); with another answer, every
    copy is dropped (counted in ``conflicts``): no answer of the two can be trusted. A row the
    adapter or the loader's check refuses raises ValueError naming the set and the source row.
    """
    from tqdm import tqdm

    report = SetReport(name=source.name, path="")
    kept: dict[str, dict] = {}
    conflicting: set[str] = set()
    label = f"{source.name} ({origin})"
    for index, raw in enumerate(tqdm(raw_rows, total=total, desc=source.name, unit=" rows", disable=not progress,
                                     file=sys.stderr, mininterval=1.0)):
        report.rows_read += 1
        mapped = source.convert(raw, f"{label}: row {index}")
        if mapped is None:
            report.skipped += 1
            continue
        problem, answer, extra = mapped
        key = " ".join(problem.split())
        if key in kept:
            report.duplicates += 1
            if not _same_answer(kept[key]["reward_model"]["ground_truth"], answer):
                conflicting.add(key)
            continue
        row = {"data_source": source.data_source, PROMPT_COLUMN: [{"role": "user", "content": apply_template(problem)}],
               "ability": "math", "reward_model": {"ground_truth": answer, "style": "rule"},
               "extra_info": {"source": origin, "row": index, **extra}}
        kept[key] = validate_row(row, label, index, PROMPT_COLUMN)  # the trainer's own check of a row
    report.conflicts = len(conflicting)
    report.rows = [row for key, row in kept.items() if key not in conflicting]
    return report


def _write(rows: list[dict], path: str) -> None:
    """Write to a side file first, so an interrupted run never leaves a half-written set behind."""
    partial = path[:-len(".parquet")] + ".partial.parquet"
    write_rows(rows, partial)
    os.replace(partial, path)


def _lengths(path: str, tokenizer, apply_chat_template: bool) -> list[int]:
    """Prompt lengths in tokens as the trainer computes them (its PromptDataset reads the file)."""
    from hapo_megatron.data.dataset import PromptDataset

    ds = PromptDataset(path, tokenizer, prompt_key=PROMPT_COLUMN, max_prompt_length=sys.maxsize,
                       apply_chat_template=apply_chat_template)
    return [len(record.prompt_ids) for record in ds]


def prepare_set(name: str, out_dir: str, *, from_path: Optional[str] = None, tokenizer=None,
                max_prompt_length: int, apply_chat_template: bool, progress: bool = True) -> SetReport:
    """Prepare one set into ``out_dir/<its file>``; prints its counts to stderr."""
    source = SOURCES[name]
    ds, origin = load_source(source, from_path)
    report = convert_rows(source, _iter_rows(ds), origin, total=len(ds), progress=progress)
    if not report.rows:
        raise ValueError(f"{name} ({origin}): no rows left to write ({report.rows_read} read, {report.skipped} "
                         f"not in the set, {report.duplicates} duplicates, {report.conflicts} conflicting prompts)")
    report.path = os.path.join(out_dir, source.out_file)
    _write(report.rows, report.path)
    report.max_prompt_length = max_prompt_length
    if tokenizer is None:
        load_prompt_rows(report.path, PROMPT_COLUMN)  # the written file reads back through the loader
    else:
        report.lengths = _lengths(report.path, tokenizer, apply_chat_template)
    print(f"{name}: {report.rows_read} rows read from {origin}, {report.skipped} not in the set, "
          f"{report.duplicates} duplicated prompts removed, {report.conflicts} prompts with conflicting answers "
          f"dropped, {report.written} written to {report.path}", file=sys.stderr)
    return report


def format_summary(reports: Sequence[SetReport], tokenizer_name: Optional[str], max_prompt_length: int) -> str:
    """The table printed at the end: rows per set and prompt-length percentiles in tokens."""
    over = f"> {max_prompt_length}"
    head = ["set", "read", "duplicates", "written", *[f"p{p}" for p in PERCENTILES], "max", over, "file"]
    lines = []
    for r in reports:
        if r.lengths:
            stats = [str(percentile(r.lengths, p)) for p in PERCENTILES] + [str(max(r.lengths)), str(r.over)]
        else:
            stats = ["-"] * (len(PERCENTILES) + 2)
        lines.append([r.name, str(r.rows_read), str(r.duplicates), str(r.written), *stats, r.path])
    widths = [max(len(row[i]) for row in [head, *lines]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" if i in (0, len(head) - 1) else f"{{:>{w}}}" for i, w in enumerate(widths))
    unit = (f"prompt lengths in tokens of {tokenizer_name} (data.max_prompt_length {max_prompt_length})"
            if tokenizer_name else "prompt lengths not measured (--tokenizer none)")
    return "\n".join([unit, *(fmt.format(*row).rstrip() for row in [head, *lines])])


def prepare(name: str, out_dir: str, *, from_paths: Optional[dict[str, str]] = None, tokenizer=None,
            tokenizer_name: Optional[str] = None, max_prompt_length: int, apply_chat_template: bool,
            progress: bool = True) -> list[SetReport]:
    """Prepare ``name`` (one set or ``paper``) into ``out_dir``; prints the summary to stdout."""
    if max_prompt_length < 1:
        raise ValueError(f"--max-prompt-length must be >= 1, got {max_prompt_length}")
    names = set_names(name)
    from_paths = dict(from_paths or {})
    unknown = sorted(set(from_paths) - set(names))
    if unknown:
        raise ValueError(f"--from names {unknown}, which {name!r} does not prepare (it prepares {list(names)})")
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    try:
        reports = [prepare_set(n, out_dir, from_path=from_paths.get(n), tokenizer=tokenizer,
                               max_prompt_length=max_prompt_length, apply_chat_template=apply_chat_template,
                               progress=progress) for n in names]
    except BaseException:  # a refused source or an interruption: no empty --out left behind
        if created and not os.listdir(out_dir):
            os.rmdir(out_dir)
        raise
    print(format_summary(reports, tokenizer_name if tokenizer is not None else None, max_prompt_length))
    return reports
