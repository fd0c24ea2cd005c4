"""Run a function on N gloo ranks on CPU and collect each rank's result.

`run_distributed(fn, world_size, *args, timeout=...)` spawns `world_size` processes that join a
gloo process group on a free localhost port, calls `fn(rank, world_size, *args)` in each and
returns the list of return values ordered by rank. A rank that raises re-raises here with its
traceback; a hang fails after `timeout` seconds instead of stalling the test run.
`fn` must be importable by name (defined at module level) because ranks are started afresh.

Ranks are forked from one forkserver per test process that imported torch, Megatron-Core and the
package once (``PRELOADED``): a spawned rank spent 5-20 s of CPU importing them again, which on a
2-core machine was most of a small multi-rank test. A forked rank gets the caller's environment
as it is at the call (the forkserver's own was fixed when it started).
On a CUDA machine ranks are spawned instead (`rank_context`).
Each rank opts into the CPU shims (`hapo_megatron.compat.activate_cpu_shims`, a no-op with CUDA)
before calling `fn`, as the CPU entry points do.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once in the forkserver, before any thread starts there; every rank forks from it.
PRELOADED = ["torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
             "hapo_megatron.compat", "hapo_megatron.training.trainer", "tests.distributed"]


def rank_context():
    """The multiprocessing context that starts ranks: forks of the preloaded forkserver; on a
    CUDA machine fresh spawned processes (a fork of a process whose imports touched CUDA cannot
    use CUDA, and the GPU tests that need ranks are few)."""
    import torch
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)
    return ctx


def rank_process(fn, rank: int, world_size: int, port: int, args: tuple, results):
    """The (unstarted, daemon) process of ``rank``: ``fn(rank, world_size, *args)`` in a gloo group
    on ``port``, its outcome put on ``results`` (a queue of `rank_context`)."""
    return rank_context().Process(target=_worker, daemon=True,
                                  args=(fn, rank, world_size, port, args, results, dict(os.environ)))


def _worker(fn, rank, world_size, port, args, results, environ):
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment now, not the forkserver's from its start
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    from hapo_megatron.compat import activate_cpu_shims

    torch.set_num_threads(1)
    activate_cpu_shims()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - forwarded to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args, timeout: float = 180.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return results by rank."""
    results = rank_context().Queue()
    port = free_port()
    procs = [rank_process(fn, r, world_size, port, args, results) for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    finished = False
    try:
        while len(collected) < world_size:
            try:
                rank, ok, out = results.get(timeout=timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in collected]
                raise TimeoutError(f"distributed run of {fn.__name__} on {world_size} ranks timed out "
                                   f"after {timeout}s; ranks without a result: "
                                   f"{sorted(set(range(world_size)) - set(collected))} (dead: {dead})")
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed in {fn.__name__}:\n{out}")
            collected[rank] = out
        finished = True
    finally:
        for p in procs:
            if not finished:  # a failed or hung run: its other ranks may wait in a collective for ever
                p.kill()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [collected[r] for r in range(world_size)]
