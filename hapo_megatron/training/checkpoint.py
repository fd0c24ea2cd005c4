"""Atomic, resumable checkpoints.

Layout under ``<run_dir>/checkpoints``::

    step_000010/            a complete checkpoint
        model/              model + optimizer (Megatron dist_checkpointing, written by every rank)
        rl_state.json       step, data cursor, entropy statistics, scheduler, counters (rank 0)
        rng/rank_00000.pt   RNG states of each rank (torch, python, numpy, Megatron tracker)
        COMPLETE            marker, written last inside the directory
    latest                  text file naming the newest complete checkpoint, written last

A checkpoint is written into ``.tmp-step_000010`` and renamed when every rank has finished, so a
crash leaves either the previous state or a ``.tmp-*`` directory that `find_latest` ignores with a
warning. The last ``keep_last_k`` complete checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from typing import Any, Callable

import torch

COMPLETE = "COMPLETE"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{int(step):06d}"


def capture_rng_state() -> dict[str, Any]:
    """RNG states of this process: torch (CPU and CUDA), python, numpy, Megatron's tracker."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch wheels
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        from megatron.core import tensor_parallel
        state["megatron_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:  # noqa: BLE001 - tracker absent or uninitialised: nothing to save
        pass
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state` (missing entries are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("megatron_tracker"):
        try:
            from megatron.core import tensor_parallel
            tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"could not restore the Megatron RNG tracker state: {e}")


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE))


def list_checkpoints(root: str, *, warn: bool = True) -> list[tuple[int, str]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first.

    Half-written ones (``.tmp-*`` or a ``step_*`` directory without the marker) are skipped, with
    a warning when ``warn``.
    """
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        m = _STEP_RE.match(name)
        if m and _is_complete(path):
            out.append((int(m.group(1)), path))
        elif (m or name.startswith(".tmp-")) and warn:
            warnings.warn(f"ignoring half-written checkpoint {path} (no {COMPLETE} marker)")
    return sorted(out)


def find_latest(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (the ``latest`` pointer if it is valid)."""
    found = list_checkpoints(root)
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        path = os.path.join(root, name)
        if _is_complete(path) and (not found or found[-1][1] == path):
            return path
        if not _is_complete(path):
            warnings.warn(f"checkpoint pointer {pointer} names {name!r}, which is not complete; "
                          "using the newest complete checkpoint instead")
    return found[-1][1] if found else None


def resolve_resume(resume: str | None, root: str) -> str | None:
    """Checkpoint directory to resume from, or None.

    ``resume``: ``"none"``/None (fresh run), ``"auto"`` (newest complete checkpoint under
    ``root`` if any), or a path to a checkpoint directory or a checkpoints root. A path that does
    not exist or holds no complete checkpoint raises `FileNotFoundError` naming it.
    """
    if resume is None or str(resume).lower() == "none":
        return None
    if str(resume).lower() == "auto":
        return find_latest(root)
    path = os.path.abspath(os.path.expanduser(str(resume)))
    if not os.path.exists(path):
        raise FileNotFoundError(f"trainer.resume: checkpoint path {path!r} does not exist")
    if _is_complete(path):
        return path
    latest = find_latest(path)
    if latest is None:
        raise FileNotFoundError(f"trainer.resume: {path!r} holds no complete checkpoint "
                                f"(no {COMPLETE} marker in it or in a step_* directory below it)")
    return latest


def read_rl_state(ckpt_dir: str) -> dict[str, Any]:
    with open(os.path.join(ckpt_dir, "rl_state.json")) as f:
        return json.load(f)


class CheckpointManager:
    """Saves and loads checkpoints under ``root``; every rank calls `save`/`load` collectively.

    ``barrier`` synchronises the ranks (``torch.distributed.barrier`` in training, a no-op in a
    single process). Model/optimizer IO is delegated to callables so this module stays
    framework-agnostic: ``save_model(dir)`` / ``load_model(dir)`` are called on every rank.
    """

    def __init__(self, root: str, *, keep_last_k: int = 3, rank: int = 0,
                 barrier: Callable[[], None] | None = None):
        if keep_last_k is not None and keep_last_k < 1:
            raise ValueError(f"keep_last_k must be >= 1, got {keep_last_k}")
        self.root, self.keep_last_k, self.rank = root, keep_last_k, rank
        self.barrier = barrier or (lambda: None)

    def save(self, step: int, *, rl_state: dict[str, Any],
             save_model: Callable[[str], None] | None = None) -> str:
        """Write checkpoint ``step`` atomically; returns its final path."""
        name = step_dir_name(step)
        tmp, final = os.path.join(self.root, f".tmp-{name}"), os.path.join(self.root, name)
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))
        self.barrier()
        if save_model is not None:
            save_model(os.path.join(tmp, "model"))
        torch.save(capture_rng_state(), os.path.join(tmp, "rng", f"rank_{self.rank:05d}.pt"))
        self.barrier()  # every rank's files are on disk before the commit
        if self.rank == 0:
            with open(os.path.join(tmp, "rl_state.json"), "w") as f:
                json.dump({"step": int(step), **rl_state}, f, indent=1)
            open(os.path.join(tmp, COMPLETE), "w").close()
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
            self._write_latest(name)
            self._prune()
        self.barrier()
        return final

    def _write_latest(self, name: str) -> None:
        pointer = os.path.join(self.root, LATEST)
        with open(pointer + ".tmp", "w") as f:
            f.write(name + "\n")
        os.replace(pointer + ".tmp", pointer)

    def _prune(self) -> None:
        done = list_checkpoints(self.root, warn=False)
        for _, path in done[: max(0, len(done) - self.keep_last_k)]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, ckpt_dir: str, *, load_model: Callable[[str], None] | None = None,
             restore_rng: bool = True) -> dict[str, Any]:
        """Load model/optimizer (via ``load_model``) and this rank's RNG state; returns the RL state."""
        if not _is_complete(ckpt_dir):
            raise FileNotFoundError(f"checkpoint {ckpt_dir!r} is not complete (no {COMPLETE} marker)")
        if load_model is not None:
            load_model(os.path.join(ckpt_dir, "model"))
        if restore_rng:
            rng_path = os.path.join(ckpt_dir, "rng", f"rank_{self.rank:05d}.pt")
            if os.path.exists(rng_path):
                restore_rng_state(torch.load(rng_path, weights_only=False))
            else:
                warnings.warn(f"no RNG state for rank {self.rank} in {ckpt_dir} "
                              "(different world size?): RNG streams are not restored")
        return read_rl_state(ckpt_dir)
