"""Process helpers shared by the benchmarks and the end-to-end tests (``tests/tools/_load.py``
loads this file by path)."""

from __future__ import annotations

import subprocess


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


__all__ = ["kill_tree"]
