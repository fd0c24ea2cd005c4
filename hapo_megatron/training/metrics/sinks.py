"""Metric sinks (console progress bar, JSONL, wandb, TensorBoard) and per-stage timers.

Only one rank writes (the caller passes ``enabled=False`` elsewhere). The JSONL file
``<run_dir>/metrics.jsonl`` holds one object per step: ``{"step": int, "<group>/<name>": float}``;
non-finite values are written as ``null``. Keys under ``timing/`` and ``perf/`` are wall-clock
dependent (excluded when comparing runs).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

TIMING_PREFIXES = ("timing/", "perf/")


class Timer:
    """Accumulates wall time per stage: ``with timer("rollout"): ...``; `pop()` returns and resets."""

    def __init__(self) -> None:
        self._times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._times[name] = self._times.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        """``{"timing/<stage>_s": seconds}`` since the last pop."""
        out = {f"timing/{k}_s": v for k, v in self._times.items()}
        self._times = {}
        return out


def _clean(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v) if math.isfinite(float(v)) else None
    return v


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """All step records of a metrics file (a torn last line is skipped)."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def on_terminal() -> bool:
    """Whether progress bars go to a terminal (tqdm writes to stderr); a log file gets lines."""
    return sys.stderr.isatty()


def strip_timing(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record without wall-clock-dependent keys (for run comparisons)."""
    return {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIXES)}


class MetricsLogger:
    """Fan-out of per-step metrics to the configured sinks (no-op when ``enabled`` is False)."""

    def __init__(self, cfg: Any, run_dir: str, *, total_steps: int, initial_step: int = 0, enabled: bool = True,
                 config: Mapping[str, Any] | None = None, desc: str = "train"):
        """``cfg``: the ``logging`` section (``LoggingConfig``): which sinks, wandb's mode, project,
        entity and run name, the TensorBoard directory, the log interval. ``config``: the run's
        config for wandb; ``enabled``: False on the ranks that log nothing."""
        self.enabled, self.log_interval = enabled, max(1, int(cfg.log_interval))
        self.jsonl_path = os.path.join(run_dir, "metrics.jsonl") if cfg.jsonl else None
        self._bar = self._wandb = self._tb = None
        self.console, self._bar_args = cfg.console, dict(total=total_steps, initial=initial_step, desc=desc)
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if cfg.wandb:
            self._wandb = self._init_wandb(run_dir, cfg.wandb_mode, cfg.wandb_project, cfg.wandb_entity,
                                           cfg.wandb_run_name, config)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(log_dir=cfg.tensorboard_dir or os.path.join(run_dir, "tensorboard"))

    @staticmethod
    def _init_wandb(run_dir, mode, project, entity, name, config):
        import wandb
        os.environ.setdefault("WANDB_SILENT", "true")
        return wandb.init(project=project or "hapo_megatron", entity=entity, name=name, mode=mode,
                          dir=run_dir, config=dict(config or {}), resume="allow")

    def _progress(self):
        """The progress bar, created on first use (so an earlier bar, e.g. SFT, closes first); only
        on a terminal: a log file gets one plain ``step N | ...`` line per logged step instead."""
        if self._bar is None and self.console and self.enabled and on_terminal():
            from tqdm import tqdm
            self._bar = tqdm(**self._bar_args, dynamic_ncols=True, unit="step", mininterval=0)
        return self._bar

    def resume(self, step: int) -> None:
        """Continue after a checkpoint of ``step``: move the progress bar. (The JSONL lines of later
        steps were set aside before: training/run_records.py; the file is only appended to.)"""
        if not self.enabled:
            return
        self._bar_args["initial"] = step
        if self._bar is not None:
            self._bar.n = self._bar.last_print_n = self._bar.initial = step  # ETA from the new rate
            self._bar.refresh()

    def log(self, step: int, metrics: Mapping[str, Any], *, advance: bool = True) -> None:
        """Write one step's metrics to every sink and advance the progress bar (``advance=False``
        for extra records such as an evaluation before the first step)."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _clean(v) for k, v in sorted(metrics.items())}}
        if self.jsonl_path:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        numeric = {k: v for k, v in record.items() if k != "step" and isinstance(v, float)}
        if self._wandb is not None:
            self._wandb.log(numeric, step=int(step))
        if self._tb is not None:
            for k, v in numeric.items():
                self._tb.add_scalar(k, v, int(step))
        if advance and self._progress() is not None:
            self._bar.set_postfix_str(self.postfix(record), refresh=False)
            self._bar.update(1)
            if step % self.log_interval == 0:
                self._bar.write(self.line(record))
        elif advance and self.console and step % self.log_interval == 0:
            print(self.line(record), flush=True)

    @staticmethod
    def _fmt(record: Mapping[str, Any], key: str, short: str, spec: str = ".3f") -> str | None:
        v = record.get(key)
        return f"{short}={v:{spec}}" if isinstance(v, float) else None

    def postfix(self, record: Mapping[str, Any]) -> str:
        parts = [self._fmt(record, "rollout/reward_mean", "reward"), self._fmt(record, "rollout/acc", "acc"),
                 self._fmt(record, "entropy/mean", "ent")]
        return " ".join(p for p in parts if p)

    def line(self, record: Mapping[str, Any]) -> str:
        parts = [f"step {record['step']}", self.postfix(record),
                 self._fmt(record, "rollout/response_length_mean", "len", ".1f"),
                 self._fmt(record, "loss/pg_loss", "loss", ".4f"),
                 self._fmt(record, "perf/tokens_per_s", "tok/s", ".0f"),
                 self._fmt(record, "perf/step_time_s", "s/step", ".1f")]
        return " | ".join(p for p in parts if p)

    def write(self, msg: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()
        self._bar = self._wandb = self._tb = None
