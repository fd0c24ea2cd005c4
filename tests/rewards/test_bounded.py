"""Bounded pool: results, the worker's own timer, hard kills, crashes, errors, threads.

One pool for the whole suite (`shared_pool`, also the math reward's); counters are compared as
differences, so the tests do not depend on their order."""

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.rewards import bounded_helpers as h
from hapo_megatron.rewards.bounded import BoundedPool, in_worker, shared_pool


@pytest.fixture
def pool():
    return shared_pool()


def _counts(pool):
    return pool.timeouts, pool.errors, pool.restarts


def test_results_in_a_worker_process(pool):
    out = pool.call(h.add, 1, 2, c=4, timeout_s=30)
    assert (out.status, out.value, out.ok) == ("ok", 7, True)
    pid, flagged = pool.call(h.worker_identity, timeout_s=30).value
    assert pid != os.getpid() and flagged and not in_worker()


def test_timer_stops_python_work_and_keeps_the_worker(pool):
    before = _counts(pool)
    out = pool.call(h.sleep_then, 600, "late", timeout_s=0.3)
    assert out.status == "timeout" and out.value is None
    assert _counts(pool) == (before[0] + 1, before[1], before[2])  # no restart: the timer did it
    assert pool.call(h.add, 2, 3, timeout_s=30).value == 5


def test_stuck_worker_is_killed_and_replaced(pool):
    before = _counts(pool)
    out = pool.call(h.ignore_alarm_and_sleep, 600, timeout_s=0.3)
    assert out.status == "timeout" and "killed" in out.message
    assert _counts(pool) == (before[0] + 1, before[1], before[2] + 1)
    assert pool.call(h.add, 2, 3, timeout_s=30).value == 5


def test_raising_call_is_an_error_outcome(pool):
    before = _counts(pool)
    out = pool.call(h.raise_value_error, "bad input", timeout_s=30)
    assert out.status == "error" and out.message == "ValueError: bad input"
    assert _counts(pool) == (before[0], before[1] + 1, before[2])


def test_dead_worker_is_an_error_and_replaced(pool):
    before = _counts(pool)
    out = pool.call(h.exit_process, 3, timeout_s=30)
    assert out.status == "error" and "exit code 3" in out.message
    assert _counts(pool) == (before[0], before[1] + 1, before[2] + 1)
    assert pool.call(h.add, 1, 1, timeout_s=30).value == 2


def test_unpicklable_values(pool):
    with pytest.raises(ValueError, match="must pickle to run in a worker process"):
        pool.submit(lambda: 1, timeout_s=1)
    out = pool.call(h.unpicklable_result, timeout_s=30)
    assert out.status == "error" and "cannot be sent back" in out.message
    assert pool.call(h.add, 1, 1, timeout_s=30).value == 2  # the worker is still in step
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        pool.submit(h.add, 1, 1, timeout_s=0)


def test_calls_from_many_threads(pool):
    def one(i):
        assert threading.current_thread() is not threading.main_thread()
        return pool.call(h.add, i, i, timeout_s=30).value

    with ThreadPoolExecutor(4) as threads:
        assert list(threads.map(one, range(20))) == [2 * i for i in range(20)]


def test_own_pool_close_stops_its_workers():
    with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
        BoundedPool(0)
    small = BoundedPool(1)
    slow = small.submit(h.sleep_then, 600, None, timeout_s=600)
    queued = small.submit(h.add, 1, 1, timeout_s=600)
    deadline = time.monotonic() + 120
    while not slow.running() and time.monotonic() < deadline:  # in flight at close
        time.sleep(0.01)
    small.close()
    assert slow.result().status == "error" and queued.cancelled()
    assert all(s.proc is None for s in small._slots) and not any(s.thread.is_alive() for s in small._slots)
    with pytest.raises(RuntimeError, match="closed"):
        small.submit(h.add, 1, 1, timeout_s=1)
