"""Module-level functions the bounded-pool tests send to worker processes (they must pickle)."""

import os
import signal
import time

from hapo_megatron.rewards.bounded import in_worker


def add(a, b, *, c=0):
    return a + b + c


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def ignore_alarm_and_sleep(seconds):
    """Stands for work stuck in one C call: the worker's timer cannot stop it."""
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    time.sleep(seconds)
    return "finished"


def raise_value_error(message):
    raise ValueError(message)


def exit_process(code):
    os._exit(code)


def unpicklable_result():
    return lambda: None


def worker_identity():
    return os.getpid(), in_worker()
