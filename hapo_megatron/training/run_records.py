"""What a run directory keeps, and how a run treats it: never overwrite a record.

Records of a run under ``trainer.run_dir`` (`RECORDS`): checkpoints, metrics, summaries, the
saved config, saved rollouts, the KL reference and the logs the run wrote. Three rules
(docs/troubleshooting.md, "A run directory's records"):

- a fresh start (``--resume none``, or no checkpoint to resume) moves every record there is into
  ONE new dated folder ``<run_dir>/previous/<YYYYmmdd-HHMMSS>[-N]/`` (`move_records_aside`);
- a resume from step k moves what the resumed run would write again (metrics lines and saved
  rollouts of steps after k, the summary) into such a folder too, and appends after the kept
  lines: ``metrics.jsonl`` is never rewritten (`set_aside_after`);
- ``summary.json`` is replaced atomically (`write_json_atomic`): a kill mid-write leaves the old one.

A run whose last checkpoint reached ``trainer.total_steps`` and wrote its summary is finished
(`finished_message`): re-running it does nothing.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any, Optional, Sequence

PREVIOUS = "previous"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
RECORDS = ("checkpoints", METRICS, "sft_metrics.jsonl", SUMMARY, "config.yaml", "rollouts", "reference",
           "sglang_logs", "tensorboard", "wandb")
_ROLLOUT_STEP = re.compile(r"^step_(\d+)\.")


def new_previous_dir(run_dir: str, suffix: str = "") -> str:
    """A new, empty ``<run_dir>/previous/<date>[suffix][-N]`` (never an existing one)."""
    base = os.path.join(run_dir, PREVIOUS, time.strftime("%Y%m%d-%H%M%S") + suffix)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    for n in range(1, 10_000):
        path = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free name for {base}-N")


def move_records_aside(run_dir: str, keep: Sequence[str] = ()) -> Optional[str]:
    """A fresh start in ``run_dir``: move every record in it (but those named in ``keep``) into one
    new dated folder; returns the folder, or None when there was nothing to move. Anything else in
    ``run_dir`` stays."""
    present = [name for name in RECORDS if name not in keep and os.path.lexists(os.path.join(run_dir, name))]
    if not present:
        return None
    dest = new_previous_dir(run_dir)
    for name in present:
        os.rename(os.path.join(run_dir, name), os.path.join(dest, name))
    return dest


def _metrics_cut(path: str, step: int) -> int:
    """Byte offset in the metrics file after which every line belongs to a step later than
    ``step`` (or is torn): the end of the last whole line of a step <= ``step`` before the first
    later one."""
    cut = pos = 0
    with open(path, "rb") as f:
        for line in f:
            pos += len(line)
            try:
                rec_step = int(json.loads(line).get("step", -1))
            except (ValueError, AttributeError):
                continue  # torn or foreign: kept where it is unless it trails the kept lines
            if rec_step > step:
                break
            if line.endswith(b"\n"):
                cut = pos
    return cut


def set_aside_after(run_dir: str, step: int) -> Optional[str]:
    """A resume from the checkpoint of ``step``: move what the resumed run would write again into
    a new ``previous/<date>-after-step_<step>/`` folder: the metrics lines after ``step`` (copied
    there, then cut off the end of ``metrics.jsonl``: the kept bytes are not rewritten), the saved
    rollouts of later steps and ``summary.json``. Returns the folder, or None when nothing moved."""
    metrics = os.path.join(run_dir, METRICS)
    cut = _metrics_cut(metrics, step) if os.path.isfile(metrics) else None
    tail = cut is not None and cut < os.path.getsize(metrics)
    rollouts = os.path.join(run_dir, "rollouts")
    later = sorted(name for name in (os.listdir(rollouts) if os.path.isdir(rollouts) else ())
                   if _ROLLOUT_STEP.match(name) and int(_ROLLOUT_STEP.match(name).group(1)) > step)
    summary = os.path.join(run_dir, SUMMARY)
    if not (tail or later or os.path.exists(summary)):
        return None
    dest = new_previous_dir(run_dir, f"-after-step_{step:06d}")
    if tail:
        with open(metrics, "rb") as src, open(os.path.join(dest, METRICS), "wb") as out:
            src.seek(cut)
            out.write(src.read())
            out.flush()
            os.fsync(out.fileno())
        os.truncate(metrics, cut)
    if later:
        os.makedirs(os.path.join(dest, "rollouts"))
        for name in later:
            os.rename(os.path.join(rollouts, name), os.path.join(dest, "rollouts", name))
    if os.path.exists(summary):
        os.rename(summary, os.path.join(dest, SUMMARY))
    return dest


def write_json_atomic(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path``: a temporary file beside it, fsynced, then renamed over
    it, so a reader (or a crash) sees the old file or the new one, never a part."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_summary(run_dir: str) -> Optional[dict]:
    """The run's ``summary.json``, or None (absent or unreadable)."""
    try:
        with open(os.path.join(run_dir, SUMMARY)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def finished_message(run_dir: str, checkpoint_step: int, total_steps: int) -> Optional[str]:
    """Why there is nothing to do (None: there is): the checkpoint resumed from is at or past
    ``total_steps`` and the run wrote its summary of that step. A run stopped after its last
    checkpoint but before its summary is not finished (its final evaluation runs again)."""
    summary = read_summary(run_dir)
    if checkpoint_step < total_steps or summary is None or int(summary.get("steps", -1)) < checkpoint_step:
        return None
    return (f"{run_dir} is finished: step {checkpoint_step} of trainer.total_steps={total_steps} is done and "
            f"its summary is in {os.path.join(run_dir, SUMMARY)}; nothing to do. To train it further, give a "
            f"larger trainer.total_steps=N (N > {checkpoint_step}: it resumes from step {checkpoint_step}); to "
            "start over, --resume none (its records are moved to "
            f"{os.path.join(run_dir, PREVIOUS, '<date>')}/)")
