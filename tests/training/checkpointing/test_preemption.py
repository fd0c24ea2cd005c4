"""The stop request (training/checkpointing/preemption.py): the ranks agree on a signal that reached any one of
them and on trainer.exit_after_minutes, a repeat within the window is the same request, a second
signal aborts at once and the grace watchdog bounds the exit. (The end-to-end SIGTERM runs are in
tests/test_train_e2e.py.)"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.distributed import run_distributed
from tests.training.tiny_setup import ROOT


def _agree(rank, world):
    from hapo_megatron.training.checkpointing.preemption import StopRequest
    now = [0.0]
    stop = StopRequest(signals=["SIGUSR1"], grace_s=10_000, clock=lambda: now[0], log=lambda _: None,
        exit_after_minutes=None).install()
    try:
        nothing = stop.agreed()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # only rank 1 is signalled
        return nothing, stop.agreed()
    finally:
        stop.uninstall()


def _agree_on_time(rank, world):
    from hapo_megatron.training.checkpointing.preemption import StopRequest
    now = [0.0]
    stop = StopRequest(signals=[], grace_s=10_000, exit_after_minutes=1.0, clock=lambda: now[0], log=lambda _: None)
    before = stop.agreed()
    now[0] = 60.0 if rank == 0 else 59.0  # only rank 0's clock has passed the limit
    return before, stop.agreed()


def test_every_rank_agrees_on_a_signal_one_rank_got():
    assert run_distributed(_agree, 2) == [(None, "SIGUSR1 received")] * 2


def _agree_on_failure(rank, world):
    from hapo_megatron.training.checkpointing.preemption import StopRequest
    stop = StopRequest(signals=[], grace_s=10_000, exit_after_minutes=1.0, clock=lambda: 120.0, log=lambda _: None)
    if rank == 0:  # rank 0's rollout manager failed; every rank's time limit has passed too
        stop.fail("the rollout manager process (pid 1) exited with code -9")
    return stop.agreed(), stop.failed


def test_a_failure_on_one_rank_stops_every_rank_as_a_failure():
    """`StopRequest.fail` wins over the time limit on every rank, which learn that it is a failure
    (`RunFailed`, exit code 1); only the failing rank knows the reason."""
    assert run_distributed(_agree_on_failure, 2) == [
        ("the rollout manager process (pid 1) exited with code -9", True), ("another rank failed", True)]


def test_every_rank_agrees_on_the_time_limit():
    assert run_distributed(_agree_on_time, 2) == [(None, "trainer.exit_after_minutes=1 reached")] * 2


def _python(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_repeat_is_the_same_request_and_a_second_signal_aborts_at_once():
    proc = _python("""
        import os, signal
        from hapo_megatron.training.checkpointing.preemption import REPEAT_WINDOW_S, StopRequest
        now = [100.0]
        stop = StopRequest(signals=["SIGTERM", "SIGINT"], grace_s=10_000, exit_after_minutes=None,
        clock=lambda: now[0]).install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM, stop.received
        now[0] += REPEAT_WINDOW_S * 0.5
        os.kill(os.getpid(), signal.SIGTERM)  # the same request delivered twice (SLURM + torchrun)
        print("repeat ignored", flush=True)
        now[0] += REPEAT_WINDOW_S * 1.5
        os.kill(os.getpid(), signal.SIGINT)
        print("still running after the second signal", flush=True)
    """)
    assert proc.returncode == 128 + signal.SIGINT, proc.stdout + proc.stderr
    assert "repeat ignored" in proc.stdout and "still running" not in proc.stdout
    assert "got SIGTERM: stopping at the next safe point" in proc.stderr
    assert "got a second signal (SIGINT): aborting without saving" in proc.stderr


def test_the_grace_watchdog_ends_a_process_that_does_not_exit():
    from hapo_megatron.training.checkpointing.preemption import EXIT_GRACE_EXPIRED
    proc = _python("""
        import os, signal, threading
        from hapo_megatron.training.checkpointing.preemption import StopRequest
        StopRequest(signals=["SIGUSR1"], grace_s=0.2, exit_after_minutes=None).install()
        os.kill(os.getpid(), signal.SIGUSR1)
        threading.Event().wait()  # stuck (as in a collective that never returns)
    """)
    assert proc.returncode == EXIT_GRACE_EXPIRED, proc.stdout + proc.stderr
    assert "did not finish saving within trainer.exit_grace_s=0.2 s" in proc.stderr


def test_signal_names_are_checked():
    from hapo_megatron.config import load_config
    assert load_config(overrides=["trainer.exit_signals=[TERM,usr2]"]).trainer.exit_signals == ["TERM", "usr2"]
    for bad in ("SIGNOPE", "SIGKILL"):
        with pytest.raises(ValueError, match=f"trainer.exit_signals: '{bad}' is not a signal that can be handled"):
            load_config(overrides=[f"trainer.exit_signals=[{bad}]"])
