"""Generation that can stop early and keep what it has: one ``/generate`` call per prompt group,
the caller told as each group returns, every request still running aborted once the caller has
enough (docs/algorithm.md, "Over-sampling and partial rollouts").

Each group is one `RolloutEngine.generate_group` call (rows that an abort ends return their
tokens so far, finish reason ``"abort"``: rollout/sglang/requests.py); a row is resumed by sending
prompt + partial response as its input with the remaining token budget.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Callable, Optional, Sequence

from hapo_megatron.rollout.engine import ABORT, GenerationAborted, RolloutEngine, RowRequest, RowResult, SamplingParams
from hapo_megatron.rollout.sglang.client import SGLangError
from hapo_megatron.rollout.sglang.engine import STOP_POLL_S
from hapo_megatron.rollout.sglang.requests import group_payload, parse_row

MAX_CALLS_IN_FLIGHT = 512  # one call per group: the server batches them; this only bounds threads


def generate_groups(engine: RolloutEngine, groups: Sequence[Sequence[RowRequest]], params: Sequence[SamplingParams],
                    on_group: Callable[[int, list[RowResult]], bool], *,
                    stop_check: Optional[Callable[[], bool]] = None) -> list[Optional[list[RowResult]]]:
    """Send every group (one call each, in order, all at once); ``on_group(g, rows)`` hears of
    each one as it returns (one thread at a time) and answers True once the caller has enough:
    then the calls not yet sent are not sent (their entry stays None) and every server aborts what
    it runs (those calls return their partial rows to ``on_group`` as well). ``stop_check`` (a stop
    request of the run) aborts too and raises `GenerationAborted`."""
    if len(groups) != len(params):
        raise ValueError(f"{len(groups)} groups but {len(params)} sampling parameters")
    out: list[Optional[list[RowResult]]] = [None] * len(groups)
    enough = threading.Event()
    told = threading.Lock()

    def run(g: int) -> None:
        if enough.is_set():
            return
        rows = groups[g]
        res = engine.generate_group(rows, params[g])
        if len(res) != len(rows):
            raise SGLangError(f"{type(engine).__name__}.generate_group returned {len(res)} rows for {len(rows)}")
        with told:
            out[g] = res
            if on_group(g, res) and not enough.is_set():
                enough.set()
                engine.abort_requests()

    pool = ThreadPoolExecutor(max_workers=max(1, min(len(groups), MAX_CALLS_IN_FLIGHT)),
                              thread_name_prefix="hapo-partial")
    futures = [pool.submit(run, g) for g in range(len(groups))]
    stopped = False
    try:
        pending = set(futures)
        while pending:
            if stop_check is not None and stop_check():
                stopped = True
                enough.set()
                engine.abort_requests()
                raise GenerationAborted(f"generation stopped by a stop request: {len(groups)} groups' requests "
                                        "aborted")
            done, pending = wait(pending, timeout=STOP_POLL_S if stop_check is not None else None,
                                 return_when=FIRST_COMPLETED)
            for f in done:
                f.result()  # the first failure raises
    except SGLangError:
        if not enough.is_set():  # nothing more is sent, and the calls in flight end now
            enough.set()
            engine.abort_requests()
        raise
    finally:
        pool.shutdown(wait=not stopped, cancel_futures=True)
    return out


__all__ = ["ABORT", "RowRequest", "RowResult", "generate_groups", "group_payload", "parse_row"]
