"""Generation that can stop early and keep what it has: one ``/generate`` call per prompt group,
the caller told as each group returns, every request still running aborted once the caller has
enough (docs/algorithm.md, "Over-sampling and partial rollouts").

SGLang 0.5.23 answers ``POST /abort_request {"abort_all": true}`` by ending every request it holds
(``scheduler.abort_request``): a running one finishes with ``meta_info.finish_reason`` ``{"type":
"abort", "status_code": null, ...}`` and the tokens and log-probs it had sampled, a queued one
with none; the ``/generate`` call still answers 200 (``tokenizer_manager`` raises only for an
abort that carries an HTTP status). A row is resumed by sending prompt + partial response as
``input_ids`` with the remaining token budget.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from hapo_megatron.rollout.engine import GenerationAborted, SamplingParams
from hapo_megatron.rollout.sglang.client import SGLangError
from hapo_megatron.rollout.sglang.engine import STOP_POLL_S, generate_payload

ABORT = "abort"
MAX_CALLS_IN_FLIGHT = 512  # one call per group: the server batches them; this only bounds threads


@dataclass(frozen=True)
class RowRequest:
    """One row: its input (prompt, or prompt + the partial response to continue), its token
    budget and its sampling seed (None: the server's own randomness)."""

    input_ids: tuple[int, ...]
    max_new_tokens: int
    seed: Optional[int] = None


@dataclass(frozen=True)
class RowResult:
    """What one row's request returned: the new tokens, their log-probs, and ``"stop"``,
    ``"length"`` or ``"abort"`` (tokens so far; none when it never started)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str


def parse_row(item: dict) -> RowResult:
    """A `RowResult` of one ``/generate`` answer, aborted ones included (token ids from
    ``meta_info.output_token_logprobs``, cross-checked with ``output_ids``)."""
    if not isinstance(item, dict) or "meta_info" not in item:
        raise SGLangError(f"unexpected /generate answer: {str(item)[:500]}")
    meta = item["meta_info"]
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    if kind not in ("stop", "length", ABORT):
        raise SGLangError(f"SGLang request finished with {fr!r}")
    triples = meta.get("output_token_logprobs")
    if triples is None and kind != ABORT:  # an abort before the first token may carry none
        raise SGLangError("SGLang answer has no output_token_logprobs (return_logprob ignored?)")
    triples = triples or []
    ids = tuple(int(t[1]) for t in triples)
    out_ids = item.get("output_ids")
    if out_ids is not None and tuple(map(int, out_ids)) != ids:
        raise SGLangError(f"output_ids ({len(out_ids)}) disagree with output_token_logprobs ({len(ids)})")
    return RowResult(ids, tuple(float(t[0]) for t in triples), kind)


def group_payload(rows: Sequence[RowRequest], params: SamplingParams) -> dict:
    """The body of one group's ``/generate``: every row with its own input and token budget."""
    body = generate_payload([list(r.input_ids) for r in rows], params, seeds=[r.seed for r in rows])
    for sp, r in zip(body["sampling_params"], rows):
        sp["max_new_tokens"] = int(r.max_new_tokens)
    return body


def generate_groups(engine, groups: Sequence[Sequence[RowRequest]], params: Sequence[SamplingParams],
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
        answer = engine.supervisor.request(g, "/generate", group_payload(rows, params[g]), rows=len(rows))
        if not isinstance(answer, list) or len(answer) != len(rows):
            raise SGLangError(f"/generate returned {type(answer).__name__} for {len(rows)} rows")
        res = [parse_row(item) for item in answer]
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
