"""A reward that misbehaves by the prompt's ground truth, for the reward-pool tests (loaded by
dotted path ``tests.training.misbehaving_reward:score``).

``int(ground_truth) % 8``: 0 hangs (a Python sleep: the worker's timer stops it), 1 is stuck (it
ignores the timer: the worker is killed), 2 raises, 3 kills its process, 4 sleeps briefly and
then scores; the rest score at once (+1 when the response is the ground truth, else -1). Each
call first appends its kind to ``<log_dir>/calls.log``, so a test can count what happened."""

import os
import signal
import time

KINDS = {0: "hang", 1: "stuck", 2: "raise", 3: "kill", 4: "sleep"}


def kind_of(ground_truth) -> str:
    return KINDS.get(int(ground_truth) % 8, "ok")


def score(solution_str: str, ground_truth: str, log_dir: str = "") -> float:
    kind = kind_of(ground_truth)
    if log_dir:
        with open(os.path.join(log_dir, "calls.log"), "a") as f:  # one short append: atomic
            f.write(kind + "\n")
    if kind == "hang":
        time.sleep(3600)
    elif kind == "stuck":
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        time.sleep(3600)
    elif kind == "raise":
        raise RuntimeError("a bug in the reward")
    elif kind == "kill":
        os._exit(7)
    elif kind == "sleep":
        time.sleep(0.05)
    return 1.0 if solution_str.strip() == str(ground_truth) else -1.0


def read_calls(log_dir: str) -> list[str]:
    path = os.path.join(log_dir, "calls.log")
    return open(path).read().split() if os.path.exists(path) else []
