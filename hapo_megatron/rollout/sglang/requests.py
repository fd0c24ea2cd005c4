"""The bodies of SGLang's ``/generate`` and the parsing of its answers: pure functions, no I/O
(the engine, rollout/sglang/engine.py, sends them; over-sampling, rollout/sglang/partial.py, uses
the per-group form).

SGLang 0.5.23 answers ``POST /abort_request {"abort_all": true}`` by ending every request it holds
(``scheduler.abort_request``): a running one finishes with ``meta_info.finish_reason`` ``{"type":
"abort", "status_code": null, ...}`` and the tokens and log-probs it had sampled, a queued one
with none; the ``/generate`` call still answers 200 (``tokenizer_manager`` raises only for an
abort that carries an HTTP status): `parse_row` keeps such rows, `parse_generate_item` refuses them.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Optional, Sequence

import numpy as np

from hapo_megatron.rollout.engine import ABORT, RowRequest, RowResult, Sample, SamplingParams
from hapo_megatron.rollout.routed_experts import decode_routed_experts
from hapo_megatron.rollout.sglang.client import SGLangError

_SEED_MOD = 2**63 - 1


def _processor():
    """The processor class, imported on first adaptive request (importing SGLang is slow and
    patches transformers, so a non-adaptive client never pays for it)."""
    from hapo_megatron.rollout.sglang.processor import AdaptiveTemperatureProcessor

    return AdaptiveTemperatureProcessor


def row_sampling_params(params: SamplingParams, *, seed: Optional[int] = None) -> dict:
    """SGLang ``sampling_params`` of one row (adaptive rows carry our ``custom_params``)."""
    sp: dict[str, Any] = {
        "temperature": float(params.temperature), "top_p": float(params.top_p),
        "top_k": int(params.top_k), "max_new_tokens": int(params.max_new_tokens),
        "ignore_eos": bool(params.ignore_eos), "no_stop_trim": True, "skip_special_tokens": False,
    }
    if params.stop_token_ids:
        sp["stop_token_ids"] = list(params.stop_token_ids)
    if params.uses_adaptive:
        sp["custom_params"] = _processor().custom_params(
            params.entropy_stats, params.temperature, params.temperature_tau, params.h_hat_mode)
    if seed is not None:
        sp["sampling_seed"] = int(seed)
    return sp


def row_seeds(params: SamplingParams, rows: Sequence[int]) -> list[Optional[int]]:
    """Per-row ``sampling_seed`` derived from ``params.seed`` and the global row index (so the
    chunking does not matter); ``None`` entries when ``params.seed`` is None."""
    if params.seed is None:
        return [None] * len(rows)
    return [(int(params.seed) * 1_000_003 + int(r)) % _SEED_MOD for r in rows]


def generate_payload(input_ids: list[list[int]], params: SamplingParams, *,
                     seeds: Optional[Sequence[Optional[int]]] = None) -> dict:
    """Body of one batched ``POST /generate`` (one row per entry of ``input_ids``)."""
    seeds = list(seeds) if seeds is not None else [None] * len(input_ids)
    if len(seeds) != len(input_ids):
        raise ValueError(f"seeds has {len(seeds)} entries for {len(input_ids)} rows")
    body: dict[str, Any] = {
        "input_ids": [list(map(int, r)) for r in input_ids],
        "sampling_params": [row_sampling_params(params, seed=s) for s in seeds],
        "return_logprob": True,
    }
    if params.return_routes:  # the server needs --enable-return-routed-experts
        body["return_routed_experts"] = True
    if params.uses_adaptive:
        body["custom_logit_processor"] = [_processor().to_str()] * len(input_ids)
    return body


def _answer_arrays(item: dict, *, aborts: bool) -> tuple[np.ndarray, np.ndarray, str]:
    """``(response_ids int64, logprobs float64, finish_reason)`` of one ``/generate`` answer; an
    aborted one only with ``aborts`` (it may carry no log-probs when aborted before its first
    token). `generate_item_arrays` and `parse_row` read answers through it."""
    if not isinstance(item, dict) or "meta_info" not in item:
        raise SGLangError(f"unexpected /generate answer: {str(item)[:500]}")
    meta = item["meta_info"]
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else str(fr)
    if kind not in (("stop", "length", ABORT) if aborts else ("stop", "length")):
        raise SGLangError(f"SGLang request finished with {fr!r}" + ("" if aborts else " (abort / error)"))
    triples = meta.get("output_token_logprobs")
    if triples is None and not (aborts and kind == ABORT):
        raise SGLangError("SGLang answer has no output_token_logprobs (return_logprob ignored?)")
    triples = triples or []
    ids = np.fromiter(map(itemgetter(1), triples), np.int64, count=len(triples))
    logps = np.fromiter(map(itemgetter(0), triples), np.float64, count=len(triples))
    out_ids = item.get("output_ids")
    if out_ids is not None and not np.array_equal(np.asarray(out_ids, dtype=np.int64), ids):
        raise SGLangError(f"output_ids ({len(out_ids)}) disagree with output_token_logprobs ({len(ids)})")
    return ids, logps, kind


def generate_item_arrays(item: dict) -> tuple[np.ndarray, np.ndarray, str]:
    """``(response_ids int64, logprobs float64, finish_reason)`` from one answer of ``/generate``
    that finished (``stop`` / ``length``).

    Token ids come from ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]``
    triples, stop token included), cross-checked against ``output_ids``. Read into arrays in C
    loops (``np.fromiter`` over the triples), not through a Python object per token.
    """
    return _answer_arrays(item, aborts=False)


def parse_generate_item(item: dict) -> tuple[list[int], list[float], str]:
    """`generate_item_arrays` as Python lists."""
    ids, logps, kind = generate_item_arrays(item)
    return ids.tolist(), logps.tolist(), kind


def parse_weight_versions(item: dict, num_tokens: int):
    """Per-token weight versions ``[num_tokens]`` int32 of one ``/generate`` answer, from SGLang's
    ``meta_info.weight_versions`` spans (``{"version", "start", "end"}``, reported when updates carry
    ``weight_version``); empty when absent or not integers (updates that were never tagged)."""
    meta = item.get("meta_info", {}) if isinstance(item, dict) else {}
    spans = meta.get("weight_versions")
    if not spans and meta.get("weight_version") is not None:
        spans = [{"version": meta["weight_version"], "start": 0, "end": num_tokens}]
    out = np.full(num_tokens, -1, np.int64)
    try:
        for sp in spans or ():
            out[int(sp["start"]):int(sp["end"])] = int(sp["version"])
    except (KeyError, TypeError, ValueError):
        return np.zeros(0, np.int32)
    if not spans or (out < 0).any():
        return np.zeros(0, np.int32)
    return out.astype(np.int32)


def parse_routed_experts(item: dict, positions: int):
    """``[positions, layers * top_k]`` experts of one ``/generate`` answer (`rollout.routed_experts`)."""
    encoded = item.get("meta_info", {}).get("routed_experts")
    if encoded is None:
        raise SGLangError("SGLang answer has no routed_experts: start the servers with "
                          "--enable-return-routed-experts (the trainer adds it for model.routing_replay)")
    return decode_routed_experts(encoded, positions)


def answer_samples(answer: Any, prompts: Sequence[Sequence[int]], rows: Sequence[tuple[int, int]], *,
                   return_routes: bool) -> list[Sample]:
    """The `Sample`s of one ``/generate`` call's answer (a list, one item per row of the call);
    ``rows[i]``: the (prompt index into ``prompts``, sample index) of the call's i-th row."""
    if not isinstance(answer, list) or len(answer) != len(rows):
        raise SGLangError(f"/generate returned {type(answer).__name__} for {len(rows)} rows")
    out = []
    for item, (p, k) in zip(answer, rows):
        ids, logps, reason = generate_item_arrays(item)
        out.append(Sample(prompt_ids=list(prompts[p]), response_ids=ids, rollout_logprobs=logps, temperatures=[],
                          finish_reason=reason, prompt_index=p, sample_index=k,
                          routed_experts=(parse_routed_experts(item, len(prompts[p]) + len(ids) - 1)
                                          if return_routes else None),
                          weight_versions=parse_weight_versions(item, len(ids))))
    return out


def parse_row(item: dict) -> RowResult:
    """A `RowResult` of one ``/generate`` answer, aborted ones included (token ids from
    ``meta_info.output_token_logprobs``, cross-checked with ``output_ids``)."""
    ids, logps, kind = _answer_arrays(item, aborts=True)
    return RowResult(tuple(ids.tolist()), tuple(logps.tolist()), kind,
                     tuple(int(v) for v in parse_weight_versions(item, len(ids))))


def group_payload(rows: Sequence[RowRequest], params: SamplingParams) -> dict:
    """The body of one group's ``/generate``: every row with its own input and token budget."""
    body = generate_payload([list(r.input_ids) for r in rows], params, seeds=[r.seed for r in rows])
    for sp, r in zip(body["sampling_params"], rows):
        sp["max_new_tokens"] = int(r.max_new_tokens)
    return body

__all__ = ["answer_samples", "generate_item_arrays", "generate_payload", "group_payload", "parse_generate_item",
           "parse_routed_experts", "parse_row", "parse_weight_versions", "row_sampling_params", "row_seeds"]
