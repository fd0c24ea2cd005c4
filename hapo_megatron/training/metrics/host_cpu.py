"""Where the trainer's host time goes, per step (docs/architecture.md, "Asynchronous rollouts",
"Where the trainer's time goes"): the process's CPU seconds, the main thread's (the one that
launches the kernels), the main thread's wait for a core (the kernel's run-queue delay, from
``/proc/thread-self/schedstat``) and torch's intra-op thread count.

With ``HAPO_GIL_PROBE=1`` a probe thread sleeps 1 ms at a time and reports how late it wakes up,
less its own run-queue delay: the time it waited for the interpreter lock (an upper bound: waking
also costs a few microseconds). It takes the lock itself, so it is for measurement only.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

import torch

_PROBE_SLEEP_S = 0.001


def _schedstat(path: str = "/proc/thread-self/schedstat") -> tuple[float, float]:
    """(seconds on a core, seconds waiting in the run queue) of the calling thread; zeros where
    the kernel does not expose schedstat."""
    try:
        with open(path) as f:
            run_ns, wait_ns, _ = f.read().split()
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


class _GilProbe(threading.Thread):
    def __init__(self):
        super().__init__(name="hapo-gil-probe", daemon=True)
        self.late_s = 0.0
        self.wakeups = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        _, q0 = _schedstat()
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(_PROBE_SLEEP_S)
            late = time.perf_counter() - t0 - _PROBE_SLEEP_S
            _, q1 = _schedstat()
            with self._lock:  # the run-queue part of the delay is the cores', not the lock's
                self.late_s += max(0.0, late - (q1 - q0))
                self.wakeups += 1
            q0 = q1

    def pop(self) -> tuple[float, int]:
        with self._lock:
            out = (self.late_s, self.wakeups)
            self.late_s, self.wakeups = 0.0, 0
        return out

    def stop(self) -> None:
        self._stop.set()


class HostCpuMeter:
    """`pop()` (from the main thread, once per step): the ``perf/host_*`` figures since the last pop."""

    def __init__(self, probe: Optional[bool] = None):
        self._last = self._read()
        on = os.environ.get("HAPO_GIL_PROBE", "") not in ("", "0") if probe is None else probe
        self._probe = _GilProbe() if on else None
        if self._probe is not None:
            self._probe.start()

    @staticmethod
    def _read() -> tuple[float, float, float, float]:
        run, queue = _schedstat()
        return time.perf_counter(), time.process_time(), time.thread_time(), queue

    def pop(self) -> dict[str, float]:
        now = self._read()
        wall, proc, main, queue = (b - a for a, b in zip(self._last, now))
        self._last = now
        out = {"perf/host_process_cpu_s": proc, "perf/host_main_thread_cpu_s": main,
               "perf/host_main_thread_runqueue_s": queue, "perf/host_torch_threads": float(torch.get_num_threads())}
        if self._probe is not None:
            late, n = self._probe.pop()
            out["perf/host_gil_probe_wait_frac"] = late / max(wall, 1e-9)
            out["perf/host_gil_probe_wakeups"] = float(n)
        return out

    def close(self) -> None:
        if self._probe is not None:
            self._probe.stop()


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds of another live thread of this process (0 when unavailable)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, TypeError):
        return 0.0
