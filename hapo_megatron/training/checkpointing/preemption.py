"""Stopping a run early without losing work: exit signals and a wall-clock budget.

SLURM sends SIGTERM (or the signal of ``#SBATCH --signal``) before it ends a job; torchrun
forwards SIGTERM/SIGINT (and the signals of ``--signals-to-handle``) to its workers and sends
SIGKILL ``--shutdown-timeout`` seconds later. `StopRequest.install` makes each worker's handler
only set a flag; the ranks agree at safe points between the stages of a step by an all-reduce
(MAX) of that flag over a CPU (gloo) group, so a signal that reached any rank stops every rank at
the same point (Megatron-LM's DistributedSignalHandler works the same way). The trainer then saves
the last finished step and exits with `EXIT_STOPPED` (docs/troubleshooting.md, "Preemption").

Bounds: a watchdog thread ends the process with `EXIT_GRACE_EXPIRED` ``trainer.exit_grace_s``
after the first signal (a half-written checkpoint is never used: see training/checkpointing/checkpoint.py); a
second signal ends it at once with 128 + the signal number.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from hapo_megatron.config.training_sections import parse_signal_names

EXIT_STOPPED = 75  # sysexits EX_TEMPFAIL: stopped early after saving; `--resume auto` continues
EXIT_GRACE_EXPIRED = 124  # trainer.exit_grace_s passed before the save finished (like timeout(1))
# WHY: SLURM signals every process of a job step and torchrun forwards the same signal to its
# workers again, so one request can arrive twice within milliseconds; a repeat this soon after the
# first is the same request, a later one is a second signal (abort at once)
REPEAT_WINDOW_S = 2.0
_TIME_LIMIT = 1000  # the agreed code of trainer.exit_after_minutes (above every signal number)
_FAILED = 1001  # the agreed code of `StopRequest.fail` (above the others: a failure wins)


class RunStopped(Exception):
    """The run stopped early after saving (a signal or trainer.exit_after_minutes)."""

    exit_code = EXIT_STOPPED


class RunFailed(RunStopped):
    """The run stopped after saving because a part of it failed (`StopRequest.fail`: the rollout
    manager process crashed or hung)."""

    exit_code = 1


def cpu_group_over_world(timeout_minutes: float = 30.0):
    """A CPU (gloo) group over every rank: the default group when it is gloo, else a new one with
    this collective timeout (collective: every rank calls it)."""
    if not dist.is_initialized() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))


def shield_checkpoint_writer(signals) -> None:
    """Start Megatron's checkpoint-writer result queue now, with ``signals`` ignored.

    WHY: dist_checkpointing starts a spawned multiprocessing Manager on the first save and keeps
    it; it lives in the worker's process group, and torchrun forwards a signal to the whole group
    (``os.killpg``), so the Manager would die and the save after the signal fail with
    BrokenPipeError. A signal ignored when a process is started stays ignored in it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from hapo_megatron.compat.processes import children_allowed
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in parse_signal_names(signals)}
    try:
        with children_allowed():  # as MegatronActor.save does (spawned test ranks are daemonic)
            filesystem_async._get_write_results_queue()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class StopRequest:
    """Signal flag + wall-clock budget, agreed over ranks at safe points (`agreed`).

    ``group``: the CPU group the flag is all-reduced over (None = the default group, which must
    then be gloo; `cpu_group_over_world` gives one). ``clock``: monotonic seconds (tests).
    """

    def __init__(self, *, signals, grace_s: float,
                 exit_after_minutes: Optional[float], group=None,
                 clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda msg: sys.stderr.write(msg + "\n")):  # ranks share a pipe
        self.signals = parse_signal_names(signals)
        self.grace_s, self.exit_after_minutes, self.group = float(grace_s), exit_after_minutes, group
        self.clock, self.log, self.started = clock, log, clock()
        self.received: Optional[int] = None  # the first signal's number
        self.received_at: Optional[float] = None
        self._previous: dict[int, object] = {}
        self._watchdog: Optional[threading.Timer] = None
        self.failure: Optional[str] = None  # `fail`'s reason (this rank)
        self.failed = False  # `agreed` returned a failure (some rank's)

    # ------------------------------------------------------------------ signals (main thread)
    def install(self) -> "StopRequest":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def _on_signal(self, signum: int, frame) -> None:
        now = self.clock()
        if self.received is None:
            self.received, self.received_at = signum, now
            self.log(f"hapo train: rank {_rank()} got {signal.Signals(signum).name}: stopping at the next safe "
                     f"point, saving the last finished step (a second signal aborts at once; at the latest "
                     f"in trainer.exit_grace_s={self.grace_s:g} s)")
            self.start_watchdog()
        elif now - self.received_at > REPEAT_WINDOW_S:
            self.log(f"hapo train: rank {_rank()} got a second signal ({signal.Signals(signum).name}): aborting "
                     "without saving")
            os._exit(128 + signum)

    def start_watchdog(self) -> None:
        """End the process `grace_s` from now unless it has exited (daemon thread: it runs while
        the main thread waits in a collective)."""
        if self._watchdog is not None:
            return

        def expire():
            self.log(f"hapo train: rank {_rank()} did not finish saving within trainer.exit_grace_s="
                     f"{self.grace_s:g} s: exiting with code {EXIT_GRACE_EXPIRED} (the checkpoint being "
                     "written, if any, is incomplete and will not be used)")
            os._exit(EXIT_GRACE_EXPIRED)
        self._watchdog = threading.Timer(self.grace_s, expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    # ------------------------------------------------------------------ agreement (collective)
    def fail(self, reason: str) -> None:
        """Stop at the next safe point, saving the last finished step, as a failure (`RunFailed`):
        ``reason`` is what this rank reports (e.g. rank 0's rollout manager crashed)."""
        if self.failure is None:
            self.failure = reason
            self.log(f"hapo train: rank {_rank()}: {reason}; stopping at the next safe point, saving the last "
                     "finished step")

    def _local_code(self) -> int:
        if self.failure is not None:
            return _FAILED
        if self.received is not None:
            return int(self.received)
        if self.exit_after_minutes is not None and self.clock() - self.started >= 60.0 * self.exit_after_minutes:
            return _TIME_LIMIT
        return 0

    def requested_here(self) -> bool:
        """Whether this rank has a reason to stop (a signal, or the time limit by its clock); no
        collective: rank 0 asks it inside the rollout, which it then gives up (training/stages.py).
        `agreed` then stops every rank, since this rank's code enters its MAX."""
        return self._local_code() != 0

    def agreed(self) -> Optional[str]:
        """Why every rank stops now, or None (collective over ``group``: every rank calls it at
        the same safe point). The reason is the same on every rank."""
        code = torch.tensor([self._local_code()], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(code, op=dist.ReduceOp.MAX, group=self.group)
        code = int(code.item())
        if code == 0:
            return None
        self.start_watchdog()  # the exit is bounded from here on, whatever stopped the run
        if code == _FAILED:
            self.failed = True
            return self.failure or "another rank failed"
        if code == _TIME_LIMIT:
            return f"trainer.exit_after_minutes={self.exit_after_minutes:g} reached"
        return f"{signal.Signals(code).name} received"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
