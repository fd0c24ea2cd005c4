"""Supervised warm start: cross-entropy on reference solutions, through the same Megatron actor.

Used by the CPU example so that RL starts from a model that solves some problems (a base accuracy
between "never" and "always", where group-relative advantages have signal). The target of a
prompt is its row's ``extra_info.solution`` when present, else ``"Answer: <ground truth>"``,
followed by the tokenizer's eos token.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import torch

from hapo_megatron.data import PromptSampler
from hapo_megatron.parallel.collectives import sum_metrics
from hapo_megatron.parallel.loss import DEFAULT_LOGPROB_CHUNK, logprobs_entropy_from_logits
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.training.batches.micro_batches import SequenceData, build_rank_micro_batches
from hapo_megatron.training.metrics.sinks import on_terminal


def reference_response(record: Any) -> str:
    extra = getattr(record, "extra_info", None) or {}
    sol = extra.get("solution") if isinstance(extra, dict) else None
    return str(sol) if sol else f"Answer: {record.ground_truth}"


def sft_sequences(records: Sequence[Any], tokenizer) -> list[SequenceData]:
    """Prompt + reference response (+ eos) of each record; only the response is trained on."""
    texts = [reference_response(r) for r in records]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return [SequenceData(prompt_ids=list(r.prompt_ids), response_ids=list(x) + ([eos] if eos is not None else []),
                         index=i) for i, (r, x) in enumerate(zip(records, ids))]


def cross_entropy_loss_factory(tp_group):
    """``make_loss(mb)``: summed token cross-entropy over ``loss_mask`` (per-token normalised by
    Megatron). Metrics ``sft/loss_sum``, ``sft/num_tokens``, ``sft/correct`` (argmax hits)."""

    def make_loss(mb: MicroBatch):
        def loss_func(output):  # logits, or HiddenStates with the fused output layer
            # the data's likelihood under the plain softmax: no sampling temperature
            lp, _ = logprobs_entropy_from_logits(output, mb.labels, tp_group=tp_group,
                                                 chunk_size=DEFAULT_LOGPROB_CHUNK, temperature=1.0)
            mask = mb.loss_mask.to(lp.dtype)
            loss = -(lp * mask).sum()
            return loss, mask.sum().to(torch.int), {"sft/loss_sum": loss.detach().double(),
                                                    "sft/num_tokens": mask.sum().double()}
        return loss_func
    return make_loss


def run_sft(rt) -> dict[str, float]:
    """``trainer.sft_warmup_steps`` optimizer steps of ``data.train_batch_size`` prompts each.

    Prompts come from their own sampler (seeded apart from the RL one, whose cursor is left
    untouched). Per-step metrics go to ``<run_dir>/sft_metrics.jsonl``; returns the last ones.
    """
    cfg, g = rt.cfg, rt.groups
    steps = cfg.trainer.sft_warmup_steps
    sampler = PromptSampler(rt.train_ds, min(cfg.data.train_batch_size, len(rt.train_ds)),
                            seed=cfg.data.seed + 7919, shuffle=True)
    make_loss = cross_entropy_loss_factory(g.tp)
    bar = None
    if rt.is_main and cfg.logging.console and on_terminal():  # a log file: the summary line only
        from tqdm import tqdm
        bar = tqdm(total=steps, desc="sft warm start", unit="step", dynamic_ncols=True)
    path = os.path.join(rt.run_dir, "sft_metrics.jsonl")
    last: dict[str, float] = {}
    for step in range(1, steps + 1):
        seqs = sft_sequences(sampler.next_batch(), rt.tokenizer)
        mbs = build_rank_micro_batches(seqs, dp_rank=g.dp_rank, dp_size=g.dp_size,
                                       micro_batch_size=cfg.parallel.micro_batch_size,
                                       max_tokens_per_micro_batch=cfg.parallel.max_tokens_per_micro_batch)
        res = rt.actor.train_step(mbs, make_loss)
        tot = sum_metrics({k: float(v) for k, v in res.metrics.items()},
                                       contribute=rt.contributes_metrics)
        last = {"step": step, "sft/loss": tot.get("sft/loss_sum", 0.0) / max(tot.get("sft/num_tokens", 0.0), 1.0),
                "sft/grad_norm": res.grad_norm, "sft/lr": res.lr, "sft/skipped": float(res.skipped)}
        if rt.is_main:
            with open(path, "a") as f:
                f.write(json.dumps(last) + "\n")
            if bar is not None:
                bar.set_postfix_str(f"loss={last['sft/loss']:.3f}", refresh=False)
                bar.update(1)
    if bar is not None:
        bar.close()
    rt.rl.sft_done = True
    return last
