"""``python -m tests.training.preempt_hook ARGS`` (under torchrun): `hapo_megatron.train.main(ARGS)`
with one stage of one step held until this rank has received its stop signal, so that the signal
arrives during that stage; writes ``<marker dir>/held.<stage>.rank<R>`` when the stage is reached
and ``exit.rank<R>`` (the exit code) at the end.

Environment: HAPO_TEST_HOLD_STAGE (``rollout`` or ``update``), HAPO_TEST_HOLD_STEP, HAPO_TEST_MARKER_DIR.

``HAPO_TEST_HOLD_STAGE=async_take`` (rollout.max_staleness >= 1, one process): instead, the trainer
sends itself SIGTERM as it starts to take step HAPO_TEST_HOLD_STEP's batch from the producer's
buffer, so the signal arrives while it waits for that batch (the test's servers hold its requests).
``HAPO_TEST_HOLD_STAGE=kill_manager``: the trainer SIGKILLs its rollout manager process as it
starts to take step HAPO_TEST_HOLD_STEP's batch (a crashed manager).
"""

from __future__ import annotations

import os
import sys
import threading
import time

_STAGE_FUNCTIONS = {"rollout": "rollout", "update": "ppo_update"}


def main(argv: list[str]) -> int:
    stage, step = os.environ["HAPO_TEST_HOLD_STAGE"], int(os.environ["HAPO_TEST_HOLD_STEP"])
    marker_dir, rank = os.environ["HAPO_TEST_MARKER_DIR"], os.environ.get("RANK", "0")
    if stage in ("async_take", "kill_manager"):
        (_signal_at_async_take if stage == "async_take" else _kill_manager_at_take)(step, marker_dir)
        from hapo_megatron.train import main as train_main
        return train_main(argv)
    from hapo_megatron.training import stages
    from hapo_megatron.training.checkpointing.preemption import StopRequest

    got_signal = threading.Event()
    on_signal = StopRequest._on_signal

    def recording(self, signum, frame):
        got_signal.set()
        on_signal(self, signum, frame)
    StopRequest._on_signal = recording
    original = getattr(stages, _STAGE_FUNCTIONS[stage])

    def held(rt, *args, **kwargs):
        if rt.rl.step == step:  # the trainer sets rl.step before the step's first stage
            open(os.path.join(marker_dir, f"held.{stage}.rank{rank}"), "w").close()
            deadline = time.monotonic() + 600  # bound: a signal that never comes fails the test, not hangs it
            while not got_signal.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
        return original(rt, *args, **kwargs)
    setattr(stages, _STAGE_FUNCTIONS[stage], held)

    from hapo_megatron.train import main as train_main
    code = train_main(argv)
    with open(os.path.join(marker_dir, f"exit.rank{rank}"), "w") as f:
        f.write(str(code))
    return code


def _signal_at_async_take(step: int, marker_dir: str) -> None:
    import signal

    from hapo_megatron.training.asynchronous.manager import RolloutManager
    from hapo_megatron.training.asynchronous.producer import AsyncRollout
    for cls in (AsyncRollout, RolloutManager):  # the trainer's take: the producer threads' or the manager's
        original = cls.take_step

        def take_step(self, s, *args, _original=original, **kwargs):
            if s == step:
                open(os.path.join(marker_dir, f"signalled.take.step{s}"), "w").close()
                os.kill(os.getpid(), signal.SIGTERM)
            return _original(self, s, *args, **kwargs)
        cls.take_step = take_step


def _kill_manager_at_take(step: int, marker_dir: str) -> None:
    import signal

    from hapo_megatron.training.asynchronous.manager import RolloutManager
    original = RolloutManager.take_step

    def take_step(self, s, *args, **kwargs):
        if s == step:
            with open(os.path.join(marker_dir, f"killed.manager.step{s}"), "w") as f:
                f.write(str(self.pid))
            os.kill(self.pid, signal.SIGKILL)
        return original(self, s, *args, **kwargs)
    RolloutManager.take_step = take_step


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
