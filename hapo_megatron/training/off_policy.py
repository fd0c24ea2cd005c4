"""The proximal policy's log-probs for the off-policy correction, and its step metrics
(docs/algorithm.md, "Off-policy correction (`rollout_is`)").

The engine records each token's log-prob under the distribution it sampled from, ``softmax(z /
T_t)`` with the token's (adaptive) temperature ``T_t``. The old-log-prob pass takes the actor's
at ``T_base`` (what the PPO ratio and the entropy statistics use). The importance weight must
compare the two policies under the same distribution, so the proximal log-probs are taken at
``T_t``: the ``T_base`` ones when every ``T_t`` is ``T_base`` (no adaptive temperature), else a
second forward-only pass at the per-token temperatures (`MicroBatch.temperatures`).
"""

from __future__ import annotations

from hapo_megatron.algo import mismatch_metrics, mismatch_sums, rollout_is_weights
from hapo_megatron.algo.rollout_is import behaviour_log_ratio
from hapo_megatron.parallel.collectives import all_gather_objects, sum_metrics
from hapo_megatron.parallel.loss import DEFAULT_LOGPROB_CHUNK
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.rollout.engine import SamplingParams
from hapo_megatron.training.runtime import Runtime


def needs_sampling_temperature_pass(rt: Runtime) -> bool:
    """Whether the sampling temperatures can differ from ``T_base`` (adaptive temperature)."""
    params = SamplingParams.from_config(rt.cfg.rollout, rt.cfg.algo, entropy_stats=rt.rl.rollout_entropy_stats)
    return bool(params.uses_adaptive)


def with_proximal_logprobs(rt: Runtime, flat: list[MicroBatch]) -> tuple[list[MicroBatch], dict[str, float]]:
    """``flat`` (after the old-log-prob pass and `recompute_temperatures`) with
    ``proximal_logprobs``, and the ``rollout_is/*`` metrics of the step (behaviour/proximal
    mismatch over every valid token on every rank). Collective over the trainer's ranks."""
    g = rt.groups
    if needs_sampling_temperature_pass(rt):
        out = rt.actor.compute_logprobs_entropy(flat, temperature="per_token", chunk_size=DEFAULT_LOGPROB_CHUNK)
        if g.is_pipeline_last:
            flat = [mb.with_(proximal_logprobs=lp) for mb, (lp, _) in zip(flat, out)]
    elif g.is_pipeline_last:
        flat = [mb.with_(proximal_logprobs=mb.recomputed_logprobs) for mb in flat]
    sums: dict[str, float] = {}
    w_max = 0.0
    if g.is_pipeline_last:
        for mb in flat:
            s = micro_batch_mismatch_sums(mb, rt.cfg.algo.loss.rollout_is_mode, rt.cfg.algo.loss.rollout_is_cap)
            w_max = max(w_max, s.pop("weight_max"))
            for k, v in s.items():
                sums[k] = sums.get(k, 0.0) + v
    contribute = rt.contributes_metrics and g.is_pipeline_last
    tot = sum_metrics(sums, contribute=contribute)
    w_max = max(all_gather_objects(w_max if contribute else 0.0))
    return flat, mismatch_metrics(tot, w_max)


def micro_batch_mismatch_sums(mb: MicroBatch, mode: str, cap: float) -> dict[str, float]:
    """`algo.mismatch_sums` of one micro-batch of full sequences (a packed row is cut into one row
    per sequence first, so ``seq_tis`` sums each sequence)."""
    rows = mb.unpacked()
    valid = rows.loss_mask != 0
    log_w = behaviour_log_ratio(rows.proximal_logprobs, rows.rollout_logprobs, valid)
    w, capped = rollout_is_weights(log_w, valid, mode, cap)
    return mismatch_sums(log_w, valid, w, capped)


__all__ = ["micro_batch_mismatch_sums", "needs_sampling_temperature_pass", "with_proximal_logprobs"]
