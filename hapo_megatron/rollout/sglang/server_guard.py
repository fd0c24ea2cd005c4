"""A launched server ends with the process that launched it (docs/multinode.md, "Server lifetime").

``python server_guard.py TRAINER_PID GRACE_S IGNORED CMD...`` is what :func:`launch.start_process` runs,
in a session of its own. Before it becomes the server (``exec``: the server keeps the pid the
trainer knows, and ignores the signals named in ``IGNORED``, comma-separated: SIGUSR1/SIGUSR2,
``launch.IGNORED_SIGNALS``; ignored dispositions survive ``exec``), it forks a watcher into
the server's process group. The watcher ends that whole group, SIGTERM first and SIGKILL after
``GRACE_S``, when

- the trainer process is gone, however it ended (SIGKILL included, where no ``atexit`` runs):
  the server is then re-parented away from ``TRAINER_PID`` (checked in ``/proc`` every
  ``POLL_S``; a pidfd of the trainer wakes the watcher at once where the kernel has one);
- the group gets SIGTERM (``launch.stop_process``): SGLang's main process handles SIGTERM by
  draining the requests in flight without a bound, then waits for its HTTP clients to close their
  connections (uvicorn's graceful shutdown), so a server whose scheduler or clients are stuck (in
  a weight-update rendezvous, say) would never end; after ``GRACE_S`` the watcher kills it;
- the server has exited: what is left of its group (SGLang's subprocesses) is killed.

The watcher is no descendant of the server: SGLang's shutdown kills every descendant of its main
process (``kill_process_tree``), which would end the watcher before the server has ended.

Why not ``prctl(PR_SET_PDEATHSIG)`` on the server: the kernel sends it when the launching THREAD
exits, and a server is also launched from worker threads (a restart by the server supervisor,
from a ``generate`` call's thread pool, which ends with the call); the server would be killed
although its trainer lives. A pidfd and the server's parent pid follow the process, not a thread.

Standard library only, run with ``python -I -S``: it starts in milliseconds before each server.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

POLL_S = 0.5  # how often the watcher looks at the trainer and the server


def proc_stat(pid: int) -> tuple[str, int]:
    """``(state, parent pid)`` of ``pid`` from ``/proc`` (``("X", 0)`` once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return "X", 0
    state, parent = stat[stat.rindex(b")") + 2:].split()[:2]  # after "pid (comm)"
    return state.decode(), int(parent)


def parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (0 once it is gone)."""
    return proc_stat(pid)[1]


def _alive(pid: int) -> bool:
    return proc_stat(pid)[0] not in ("Z", "X")


def _trainer_fd(trainer: int) -> int:
    """A pidfd of ``trainer`` (readable once it exits), or -1 where the kernel has none."""
    try:
        return os.pidfd_open(trainer)
    except (AttributeError, OSError):
        return -1


def end_group(server: int, grace_s: float, *, signalled: bool) -> None:
    """SIGTERM the group (unless a SIGTERM reached it already), wait up to ``grace_s`` for the
    server to exit, then SIGKILL the group, this watcher included (never returns)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not signalled:
        os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)


def watch(trainer: int, server: int, grace_s: float) -> None:
    """The watcher's loop (see the module docstring); never returns."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # never hold the server's log pipe open
        os.dup2(devnull, fd)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    pidfd = _trainer_fd(trainer)
    while True:
        state, parent = proc_stat(server)
        if state in ("Z", "X"):  # the server has exited: its leftovers go too
            os.killpg(0, signal.SIGKILL)
        if stop or parent != trainer:
            end_group(server, grace_s, signalled=bool(stop))
        if pidfd >= 0:
            select.select([pidfd], [], [], POLL_S)
        else:
            time.sleep(POLL_S)


def _start_watcher(trainer: int, server: int, grace_s: float) -> None:
    """Fork the watcher, detached from the server's process TREE (a grandchild whose parent has
    exited) but in its process GROUP: SGLang's shutdown kills every descendant of its main process
    (``kill_process_tree``) and would take the watcher along before the server has ended."""
    middle = os.fork()
    if middle == 0:
        if os.fork() == 0:
            try:
                watch(trainer, server, grace_s)
            finally:
                os._exit(1)
        os._exit(0)
    os.waitpid(middle, 0)


def main(argv: list[str]) -> None:
    if len(argv) < 4:
        sys.exit("usage: server_guard.py TRAINER_PID GRACE_S IGNORED CMD...")
    trainer, grace_s, ignored, cmd = int(argv[0]), float(argv[1]), argv[2], argv[3:]
    for name in filter(None, ignored.split(",")):
        signal.signal(getattr(signal, f"SIG{name}"), signal.SIG_IGN)
    if os.getppid() != trainer:
        sys.exit(f"server_guard: the trainer (pid {trainer}) is gone; not starting {cmd[0]}")
    _start_watcher(trainer, os.getpid(), grace_s)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
