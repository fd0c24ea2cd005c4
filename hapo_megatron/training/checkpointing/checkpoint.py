"""Atomic, resumable checkpoints.

Layout under ``<run_dir>/checkpoints``::

    step_000010/            a complete checkpoint
        model/              model + optimizer (Megatron dist_checkpointing, written by every rank)
        rl_state.json       step, data cursor, entropy statistics, scheduler, counters (rank 0)
        rng/rank_00000.pt   RNG states of each rank (torch, python, numpy, Megatron tracker)
        layout.json         parallel layout saved under (TP/PP/CP/DP) and the optimizer format (rank 0)
        manifest.json       size and CRC32 of every file above (checkpoint_manifest.py), checked at load
        COMPLETE            marker, written last inside the directory
    latest                  text file naming the newest complete checkpoint, written last

A checkpoint is written into ``.tmp-step_000010`` and renamed when every rank has finished, so a
crash leaves either the previous state or a ``.tmp-*`` directory that `find_latest` ignores with a
warning. The last ``keep_last_k`` complete checkpoints are kept. A complete checkpoint whose files
were damaged afterwards fails verification at load (`CheckpointLoadError`); ``trainer.resume=auto``
then resumes from the newest one that loads (`load_newest_loadable`).

Layout changes: the model weights and the distributed optimizer's state are saved in model space
(`OPTIMIZER_FORMAT`: each Adam moment and fp32 main weight is stored like the model parameter it
belongs to), so a checkpoint loads under any TP/PP/CP/DP layout the model fits;
``rl_state.json`` is rank-independent. RNG streams are per rank and only mean something on the
layout they were drawn on: they are restored when the layout is unchanged and left as seeded at
start-up otherwise (`CheckpointManager.load`). Checkpoints written before ``layout.json`` existed
hold the optimizer in Megatron's bucket-bound ``dp_reshardable`` format and load only on the
layout they were saved under (`LayoutChangeError` says what to do).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from hapo_megatron.training.checkpointing.manifest import MANIFEST, checksum_share, write_manifest
from hapo_megatron.training.checkpointing.manifest import verify as verify_manifest

COMPLETE = "COMPLETE"
LATEST = "latest"
LAYOUT_FILE = "layout.json"
_STEP_RE = re.compile(r"^step_(\d+)$")
# Megatron-Core DistributedOptimizer sharding types (``metadata["distrib_optim_sharding_type"]``).
# "fully_reshardable" stores every Adam moment and fp32 main weight with the shape and sharding of
# the model parameter it belongs to, so it reshards over TP/PP/CP/DP like the weights do.
# ("fully_sharded_model_space" would avoid the DP gather, but megatron-core 0.16 rejects the
# flattened ShardedTensors it needs.) "dp_reshardable" is the bucket-bound format this project
# wrote before: it loads only on the layout it was saved under.
OPTIMIZER_FORMAT = "fully_reshardable"
LEGACY_OPTIMIZER_FORMAT = "dp_reshardable"


def optimizer_sharding_metadata(optimizer_format: str, *, chained_prefix: bool = False) -> dict[str, Any]:
    """``metadata`` for ``DistributedOptimizer.sharded_state_dict`` (other optimizers ignore it).

    WHY mem_efficient: saving "fully_reshardable" gathers each model-parallel shard's optimizer
    state over DP into host memory; this way only DP rank 0 holds it (gloo gather) instead of
    every DP rank (all-gather). The stored tensors are the same either way.
    WHY no chained prefix: a MoE model's optimizer is a chain of two at EP > 1 and one at EP = 1;
    keys without the chain position load under either (`optimizer_checkpoint`, gap 4).
    ``chained_prefix``: load a checkpoint written with the prefix. Megatron adds it to the
    bucket-bound `LEGACY_OPTIMIZER_FORMAT` regardless.
    """
    return {"distrib_optim_sharding_type": optimizer_format,
            "distrib_optim_fully_reshardable_mem_efficient": True,
            "chained_optim_avoid_prefix": not chained_prefix}


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


@dataclass(frozen=True)
class Layout:
    """A parallel layout: tensor, pipeline, context and data parallel sizes."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1

    @classmethod
    def from_groups(cls, groups) -> "Layout":
        """The layout of a `hapo_megatron.parallel.groups.ParallelGroups`."""
        return cls(tp=groups.tp_size, pp=groups.pp_size, cp=groups.cp_size, dp=groups.dp_size)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def __str__(self) -> str:
        n = self.world_size
        return f"TP={self.tp} PP={self.pp} CP={self.cp} DP={self.dp} ({n} rank{'s' if n > 1 else ''})"


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint records about how it was written.

    ``layout`` is None for checkpoints from before ``layout.json``; their ``world_size`` is the
    number of per-rank RNG files and their optimizer format `LEGACY_OPTIMIZER_FORMAT`.
    """

    layout: Optional[Layout]
    optimizer_format: str
    world_size: int

    @property
    def legacy(self) -> bool:
        return self.layout is None


class LayoutChangeError(RuntimeError):
    """An old-format checkpoint cannot be loaded under the requested layout."""


def read_checkpoint_info(ckpt_dir: str) -> CheckpointInfo:
    path = os.path.join(ckpt_dir, LAYOUT_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            meta = json.load(f)
        layout = Layout(**meta["layout"])
        return CheckpointInfo(layout, meta["optimizer_format"], layout.world_size)
    rng_dir = os.path.join(ckpt_dir, "rng")
    n = len([f for f in os.listdir(rng_dir) if f.startswith("rank_")]) if os.path.isdir(rng_dir) else 0
    return CheckpointInfo(None, LEGACY_OPTIMIZER_FORMAT, n)


def legacy_layout_error(ckpt_dir: str, info: CheckpointInfo, current: Layout,
                        cause: Optional[BaseException] = None) -> LayoutChangeError:
    """The error for an old-format checkpoint that does not load under ``current``."""
    why = f" (loading failed with: {type(cause).__name__}: {str(cause)[:300]})" if cause else ""
    return LayoutChangeError(
        f"checkpoint {ckpt_dir} was written by an older hapo_megatron in Megatron's bucket-bound "
        f"optimizer format ({info.optimizer_format!r}, no {LAYOUT_FILE}): it loads only under the "
        f"TP/PP/CP/DP layout it was saved under, on {info.world_size} rank(s); this run is {current}"
        f"{why}. To change the layout: resume once with the original number of processes and "
        "parallel.* settings until the next save (trainer.save_interval); that checkpoint is written "
        "in the layout-free format and then resumes under any layout.")


def resume_message(ckpt_dir: str, info: CheckpointInfo, current: Layout) -> str:
    """One line for the run log: the layout the checkpoint was saved under and the one resumed under."""
    saved = str(info.layout) if info.layout else f"an unrecorded layout on {info.world_size} rank(s) (old format)"
    line = (f"resume {os.path.basename(os.path.normpath(ckpt_dir))}: saved under {saved}, "
            f"resuming under {current}")
    if info.layout is None:
        if info.world_size != current.world_size:
            return line + " (old format: it cannot change layout, see the error that follows)"
        return line + " (old format: loads only if the TP/PP/CP split is the one saved under)"
    if info.layout == current:
        return line + " (same layout: per-rank RNG streams restored)"
    return line + (" (layout changed: model and optimizer state resharded; per-rank RNG streams "
                   "not restored, each rank keeps the streams seeded at start-up)")


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
    framework-agnostic: ``save_model(dir)`` (which must write the optimizer in
    `OPTIMIZER_FORMAT`) and ``load_model(dir, optimizer_format)`` are called on every rank.
    ``layout`` is this run's parallel layout, recorded in every checkpoint.
    """

    def __init__(self, root: str, *, keep_last_k: Optional[int], rank: int = 0,
                 barrier: Callable[[], None] | None = None, layout: Layout = Layout(),
                 world_size: int = 1, gather: Callable[[Any], list] | None = None):
        if keep_last_k is not None and keep_last_k < 1:
            raise ValueError(f"keep_last_k must be >= 1, got {keep_last_k}")
        if not 0 <= rank < world_size:  # rank 1 of "world 1" would checksum every file and race rank 0's rename
            raise ValueError(f"CheckpointManager: rank {rank} is not in a world of {world_size} (pass world_size "
                             "and gather on every rank of a multi-rank job)")
        if world_size > 1 and gather is None:
            raise ValueError("CheckpointManager: world_size > 1 needs gather (an all-gather of a small object)")
        self.root, self.keep_last_k, self.rank, self.layout = root, keep_last_k, rank, layout
        self.barrier = barrier or (lambda: None)
        # the ranks share the checksumming of a checkpoint's files (checkpoint_manifest.share)
        self.world_size, self.gather = world_size, gather or (lambda obj: [obj])

    def save(self, step: int, *, rl_state: dict[str, Any],
             save_model: Callable[[str], None] | None = None,
             rng_state: dict[str, Any] | None = None) -> str:
        """Write checkpoint ``step`` atomically; returns its final path. ``rng_state``: this rank's
        RNG states to record (default: as they are now)."""
        name = step_dir_name(step)
        tmp, final = os.path.join(self.root, f".tmp-{name}"), os.path.join(self.root, name)
        if self.rank == 0:
            os.makedirs(self.root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "rng"))
        self.barrier()
        if save_model is not None:
            save_model(os.path.join(tmp, "model"))
        torch.save(rng_state if rng_state is not None else capture_rng_state(),
                   os.path.join(tmp, "rng", f"rank_{self.rank:05d}.pt"))
        if self.rank == 0:
            with open(os.path.join(tmp, "rl_state.json"), "w") as f:
                json.dump({"step": int(step), **rl_state}, f, indent=1)
            with open(os.path.join(tmp, LAYOUT_FILE), "w") as f:
                json.dump({"layout": asdict(self.layout), "optimizer_format": OPTIMIZER_FORMAT}, f)
        self.barrier()  # every rank's files are on disk before they are checksummed and committed
        shares = self.gather(checksum_share(tmp, self.rank, self.world_size))
        if self.rank == 0:
            write_manifest(tmp, shares)
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

    def verify(self, ckpt_dir: str) -> list[str]:
        """What any rank found wrong with the files of ``ckpt_dir`` against its manifest
        (collective; empty when it verifies or has no manifest)."""
        mine = verify_manifest(ckpt_dir, self.rank, self.world_size)
        return sorted({p for part in self.gather(mine) for p in part})

    def load(self, ckpt_dir: str, *, load_model: Callable[[str, str], None] | None = None,
             restore_rng: bool = True) -> dict[str, Any]:
        """Verify, then load model/optimizer (via ``load_model``) and the RNG state; returns the RL
        state (collective).

        A checkpoint whose files do not match its manifest, or whose loading fails on any rank,
        raises `CheckpointLoadError` naming it, the file (where known) and the error, on every
        rank. Under a different layout than the one saved under, the RNG streams are not restored
        (a rank's streams belong to its place in the old layout); an old-format checkpoint under
        a different layout raises `LayoutChangeError`.
        """
        if not _is_complete(ckpt_dir):
            raise FileNotFoundError(f"checkpoint {ckpt_dir!r} is not complete (no {COMPLETE} marker)")
        problems = self.verify(ckpt_dir)
        if problems:
            raise CheckpointLoadError(f"checkpoint {ckpt_dir} fails verification against its {MANIFEST}: "
                                      + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
        error: Optional[BaseException] = None
        try:
            state = self._load_verified(ckpt_dir, load_model, restore_rng)
        except LayoutChangeError:
            raise
        except (Exception, CheckpointException) as e:  # agreed below: no rank goes on alone
            error = e
        failures = [f for f in self.gather(_describe_failure(error)) if f]
        if failures:
            raise CheckpointLoadError(f"checkpoint {ckpt_dir}: loading failed: {failures[0]}") from error
        return state

    def _load_verified(self, ckpt_dir: str, load_model, restore_rng: bool) -> dict[str, Any]:
        info = read_checkpoint_info(ckpt_dir)
        if info.legacy and info.world_size != self.layout.world_size:
            raise legacy_layout_error(ckpt_dir, info, self.layout)
        if load_model is not None:
            try:
                load_model(os.path.join(ckpt_dir, "model"), info.optimizer_format)
            except (Exception, CheckpointException) as e:  # re-raised, with the way out for old ones
                if info.legacy:
                    raise legacy_layout_error(ckpt_dir, info, self.layout, cause=e) from e
                raise _FileError("model/ (dist_checkpointing)", e) from e
        # an old-format checkpoint that loaded was necessarily saved under this layout
        same_layout = info.legacy or info.layout == self.layout
        if restore_rng and same_layout:
            rng_path = os.path.join(ckpt_dir, "rng", f"rank_{self.rank:05d}.pt")
            if os.path.exists(rng_path):
                try:
                    rng = torch.load(rng_path, weights_only=False)
                except Exception as e:  # noqa: BLE001 - named and agreed on in load
                    raise _FileError(os.path.relpath(rng_path, ckpt_dir), e) from e
                restore_rng_state(rng)
            else:
                warnings.warn(f"no RNG state for rank {self.rank} in {ckpt_dir}: RNG streams are not restored")
        try:
            return read_rl_state(ckpt_dir)
        except (OSError, ValueError) as e:
            raise _FileError("rl_state.json", e) from e


class CheckpointLoadError(RuntimeError):
    """A checkpoint that fails verification or loading (the message names it, the file, the error)."""


class _FileError(RuntimeError):
    """Loading one file of a checkpoint failed (``file`` relative to the checkpoint)."""

    def __init__(self, file: str, cause: BaseException):
        super().__init__(f"{file}: {type(cause).__name__}: {str(cause)[:500]}")


def _describe_failure(error: Optional[BaseException]) -> Optional[str]:
    if error is None:
        return None
    text = str(error) if isinstance(error, _FileError) else f"{type(error).__name__}: {str(error)[:500]}"
    return f"rank {_rank_of_process()}: {text}"


def _rank_of_process() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else 0


def load_newest_loadable(mgr: CheckpointManager, candidates: list[str], *,
                         load_model: Callable[[str, str], None] | None = None,
                         log: Callable[[str], None] = print) -> tuple[str, dict[str, Any]]:
    """``trainer.resume=auto``: load the first of ``candidates`` (newest first) that verifies and
    loads; each one skipped is logged with the reason. Returns (its path, its RL state); raises
    `CheckpointLoadError` listing every failure when none loads (a fresh start would silently
    discard the run)."""
    failures = []
    for path in candidates:
        try:
            return path, mgr.load(path, load_model=load_model)
        except CheckpointLoadError as e:
            failures.append(str(e))
            log(f"resume: skipping {os.path.basename(os.path.normpath(path))}: {e}")
    raise CheckpointLoadError(f"trainer.resume=auto: none of the {len(candidates)} complete checkpoint(s) under "
                              f"{mgr.root} loads: " + " | ".join(failures)
                              + ". Remove or repair them, or start fresh with trainer.resume=none "
                              "(previous checkpoints are then moved aside)")
