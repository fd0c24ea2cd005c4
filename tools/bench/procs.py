"""Process helpers shared by the benchmarks and the end-to-end tests (``tests/tools/_load.py``
loads this file by path)."""

from __future__ import annotations

import os
import subprocess
import time


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s descendants, then ``proc``, and reap it: torchrun's workers run in
    sessions of their own, so killing torchrun alone would leave them behind."""
    import psutil
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=30)
    proc.kill()
    proc.communicate()




def group_processes(pgid: int) -> list:
    """The live processes of process group ``pgid`` (psutil handles; zombies left out)."""
    import psutil
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return found


def survivors(procs: list, timeout_s: float) -> list:
    """Those of ``procs`` still running (not zombies) after up to ``timeout_s``: ``[]`` as soon as
    all have ended (polled every 0.2 s)."""
    import psutil

    def running(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    left = [p for p in procs if running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in left if running(p)]
    return left


__all__ = ["kill_tree", "group_processes", "survivors"]
