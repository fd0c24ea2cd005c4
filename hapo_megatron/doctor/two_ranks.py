"""Two local ranks for the doctor's parallel checks: spawned processes, one process group (NCCL
on two GPUs, gloo on CPU), each rank's answer or its error sent back to the doctor."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, use_cuda: bool, body: Callable, args: tuple, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        device = f"cuda:{rank}" if use_cuda else "cpu"
        if use_cuda:
            torch.cuda.set_device(rank)
        torch.distributed.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=2)
        results.put((rank, "ok", body(rank, device, *args)))
    except BaseException:  # noqa: BLE001 - sent back to the doctor
        results.put((rank, "error", traceback.format_exc().strip().splitlines()[-1]))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_two_ranks(body: Callable[..., Any], *args, use_cuda: bool, timeout_s: float,
                  on_timeout: str = "") -> dict:
    """``{0: answer, 1: answer}`` of ``body(rank, device, *args)`` (a module-level function: the
    ranks are spawned) on two ranks, or ``{"error": message}`` (the first rank's error, or no
    answer within ``timeout_s``, followed by ``on_timeout``)."""
    import queue

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, use_cuda, body, args, results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    out: dict = {}
    try:
        for _ in range(2):
            rank, status, answer = results.get(timeout=timeout_s)
            if status != "ok":
                return {"error": f"rank {rank}: {answer}"}
            out[rank] = answer
    except queue.Empty:
        return {"error": f"no answer within {timeout_s:.0f} s{on_timeout}"}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out
