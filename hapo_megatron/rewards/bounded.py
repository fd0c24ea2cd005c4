"""Bounded calls: a small persistent pool of killable worker processes, each call with a time limit.

Why processes: a Python thread cannot be stopped, and sympy's big-integer work can sit in one C
call for minutes, where no signal handler runs. A worker process can always be killed.

How a call is bounded (`BoundedPool.submit(fn, *args, timeout_s=...)`):

1. In the worker's main thread an interval timer (SIGALRM) raises at ``timeout_s``; Python-level
   work (sympy's simplification, a user's reward loop) stops there and the worker stays.
2. The parent waits ``timeout_s + grace_s``; a worker still silent then (stuck in C, or catching
   everything) is killed (SIGKILL) and replaced. Both count as a timeout.
3. A call that raises gives an "error" outcome; a worker that dies (os._exit, a segfault, the OOM
   killer) gives an "error" outcome and is replaced. The caller never waits longer than step 2.

Each worker has a manager thread in the parent that feeds it from one shared queue, so `submit`
works from any thread and returns a `concurrent.futures.Future` of an `Outcome`.

Worker processes are fresh interpreters (`subprocess`, ``python -c``), never forks of the caller:
the trainer runs threads (torch's OpenMP pool, gloo, HTTP clients) whose held locks a forked child
would inherit locked, and a CUDA context cannot be used after a fork. multiprocessing's "spawn" /
"forkserver" would be safe too but re-import the caller's ``__main__`` in every worker, which
re-runs a script without the ``if __name__ == "__main__"`` guard (an analysis script calling the
math reward). A worker imports ``preload`` (for the math reward `MATH_PRELOAD`: math-verify, warmed
up, ~1 s) when it starts, in the manager thread, and says when it is ready: a call's clock starts
then. A replacement after a kill costs the same start.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional

__all__ = ["Outcome", "BoundedPool", "in_worker", "shared_pool"]

MATH_PRELOAD = "hapo_megatron.rewards._preload"
"""What the math reward's workers import before their first call (math-verify, warmed up)."""
STARTUP_TIMEOUT_S = 120.0
"""How long a worker may take to start (imports) before it counts as failed to start."""

logger = logging.getLogger(__name__)

_IN_WORKER = False


def in_worker() -> bool:
    """True inside a `BoundedPool` worker process (the caller is already bounded)."""
    return _IN_WORKER


@dataclass(frozen=True)
class Outcome:
    """How a bounded call ended: status "ok" (value is the return value), "timeout" or "error"
    (message says what happened)."""

    status: str
    value: Any = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _Overrun(BaseException):
    """Raised by the worker's interval timer; a BaseException so `except Exception` cannot eat it."""


def _on_alarm(signum, frame):
    raise _Overrun


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:  # a killed parent never closes our pipe while we compute
        time.sleep(1.0)
    os._exit(0)


def _worker_main(read_fd: int, write_fd: int, preload: Optional[str]) -> None:
    """The worker process: read pickled calls, run each under the interval timer, send outcomes."""
    global _IN_WORKER
    _IN_WORKER = True
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGALRM, _on_alarm)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    if preload:
        __import__(preload)
    conn_in, conn_out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    conn_out.send("ready")  # a call's clock starts once the worker can take it
    while True:
        try:
            payload = conn_in.recv_bytes()
        except (EOFError, OSError):
            return
        reply = _run_task(payload)
        try:
            conn_out.send(reply)
        except Exception as err:  # noqa: BLE001 - an unpicklable return value is the call's error
            conn_out.send(("error", None, f"the return value cannot be sent back: {type(err).__name__}: {err}"))


def _run_task(payload: bytes) -> tuple[str, Any, str]:
    try:
        try:
            fn, args, kwargs, timeout_s = pickle.loads(payload)
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            return "ok", fn(*args, **kwargs), ""
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Overrun:
        return "timeout", None, f"stopped after {timeout_s} s"
    except BaseException as err:  # noqa: BLE001 - any failure of the call is its outcome
        return "error", None, f"{type(err).__name__}: {err}"


class _Slot:
    """One worker process and the parent thread that feeds it."""

    def __init__(self, pool: "BoundedPool", index: int):
        self.pool, self.index = pool, index
        self.proc: Optional[subprocess.Popen] = None
        self.to_worker = self.from_worker = None
        self.thread = threading.Thread(target=self._serve, name=f"bounded-pool-{index}", daemon=True)

    def start_worker(self) -> bool:
        """Start the worker and wait until it can take a call; False (logged) when it cannot."""
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        code = (f"import sys; sys.path[:0] = {sys.path!r}; "
                f"from hapo_megatron.rewards.bounded import _worker_main; "
                f"_worker_main({down_r}, {up_w}, {self.pool.preload!r})")
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(down_r, up_w),
                                         stdin=subprocess.DEVNULL)
        except OSError as err:
            for fd in (down_w, up_r):
                os.close(fd)
            logger.error("bounded pool: cannot start a worker process: %s", err)
            return False
        finally:
            os.close(down_r)
            os.close(up_w)
        self.to_worker, self.from_worker = Connection(down_w, readable=False), Connection(up_r, writable=False)
        try:
            ready = bool(wait([self.from_worker], STARTUP_TIMEOUT_S)) and self.from_worker.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            code = self.proc.poll()
            self.stop_worker()
            if not self.pool._closed:
                logger.error("bounded pool: a worker process did not start within %s s (exit code %s)",
                             STARTUP_TIMEOUT_S, code)
        return ready

    def stop_worker(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            self.to_worker.close()
            self.from_worker.close()

    def _serve(self) -> None:
        self.start_worker()  # at pool start, in this thread: the caller does not wait for it
        while True:
            item = self.pool._tasks.get()
            if item is None:
                return
            future, payload, timeout_s = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                outcome = self._run(payload, timeout_s)
            except BaseException as err:  # noqa: BLE001 - never leave a future unresolved
                outcome = Outcome("error", None, f"bounded pool: {type(err).__name__}: {err}")
            self.pool._count(outcome)
            future.set_result(outcome)

    def _run(self, payload: bytes, timeout_s: float) -> Outcome:
        if self.proc is None and not self.start_worker():
            return Outcome("error", None, "the worker process could not start")
        try:
            self.to_worker.send_bytes(payload)
        except OSError:
            return self._replace("error", "the worker process was gone before the call")
        # the worker's exit closes its end of the pipe, so a death also makes from_worker readable
        if wait([self.from_worker], timeout_s + self.pool.grace_s):
            try:
                status, value, message = self.from_worker.recv()
                return Outcome(status, value, message)
            except (EOFError, OSError):
                code = self.proc.wait()
                return self._replace("error", f"the worker process died (exit code {code})")
        return self._replace("timeout", f"killed after {timeout_s + self.pool.grace_s} s")

    def _replace(self, status: str, message: str) -> Outcome:
        self.stop_worker()
        with self.pool._lock:
            self.pool._restarts += 1
        if not self.pool._closed:
            self.start_worker()  # warm again before the next call
        return Outcome(status, None, message)


class BoundedPool:
    """``num_workers`` worker processes running calls with a hard time limit each (module doc).

    ``fn`` and its arguments must pickle (module-level functions travel by reference and are
    imported in the worker). Use as a context manager or call `close`.
    """

    def __init__(self, num_workers: int, *, grace_s: float = 1.0, preload: Optional[str] = None):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
        if grace_s <= 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s}")
        self.num_workers, self.grace_s, self.preload = num_workers, grace_s, preload
        self._tasks: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self.timeouts = self.errors = self._restarts = 0
        self._slots = [_Slot(self, i) for i in range(num_workers)]
        for slot in self._slots:
            slot.thread.start()

    @property
    def restarts(self) -> int:
        """Workers replaced after a timeout or a crash."""
        return self._restarts

    def _count(self, outcome: Outcome) -> None:
        with self._lock:
            self.timeouts += outcome.status == "timeout"
            self.errors += outcome.status == "error"

    def submit(self, fn: Callable, *args, timeout_s: float, **kwargs) -> "Future[Outcome]":
        """Run ``fn(*args, **kwargs)`` in a worker; the future's `Outcome` is set within about
        ``timeout_s + grace_s`` of a worker taking the call."""
        if self._closed:
            raise RuntimeError("the bounded pool is closed")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        try:
            payload = pickle.dumps((fn, args, kwargs, float(timeout_s)))
        except Exception as err:  # noqa: BLE001 - say which call cannot travel, and why
            raise ValueError(f"{getattr(fn, '__qualname__', fn)!s} and its arguments must pickle to run in a "
                             f"worker process (a module-level function): {type(err).__name__}: {err}") from err
        future: Future = Future()
        self._tasks.put((future, payload, float(timeout_s)))
        return future

    def call(self, fn: Callable, *args, timeout_s: float, **kwargs) -> Outcome:
        """`submit` and wait for the outcome."""
        return self.submit(fn, *args, timeout_s=timeout_s, **kwargs).result()

    def close(self) -> None:
        """Cancel queued calls, stop the workers and their threads."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                item = self._tasks.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in self._slots:
            self._tasks.put(None)
        for slot in self._slots:
            proc = slot.proc
            if proc is not None:
                proc.kill()  # a call in flight ends as an "error" outcome
        for slot in self._slots:
            slot.thread.join()
            slot.stop_worker()

    def __enter__(self) -> "BoundedPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_SHARED: Optional[BoundedPool] = None
_SHARED_LOCK = threading.Lock()
SHARED_WORKERS = 2


def shared_pool() -> BoundedPool:
    """The process's pool for bounded calls made outside any other pool (the math reward's
    verification when called directly), started on first use and closed at exit."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED._closed:
            _SHARED = BoundedPool(SHARED_WORKERS, preload=MATH_PRELOAD)
            atexit.register(_SHARED.close)
        return _SHARED
