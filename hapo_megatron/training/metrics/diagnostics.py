"""Training-time token diagnostics: the ``diag/*`` metrics of a step and its saved rollouts.

They run after the PPO update, on the micro-batches `stages.ppo_update` returned: the entropy,
h_hat and temperature of every response token, and for every update the loss's own clip flags
and redistributed advantages (`MicroBatch.updates`, one `algo.PolicyTokenFields` per PPO epoch;
nothing is recomputed here). The accumulator and the file format live in `hapo_megatron.analysis`.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from hapo_megatron.algo import EntropyStats, normalize_entropy
from hapo_megatron.analysis import TokenDiagnostics, rollout_path, write_rollouts
from hapo_megatron.config.sections import AlgoConfig
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.training.batches.rollout_batch import RolloutBatch
from hapo_megatron.training.batches.rollout_share import SequenceMeta
from hapo_megatron.training.runtime import Runtime


def diagnostic_h_hat(mb: MicroBatch, stats: EntropyStats, algo: AlgoConfig) -> torch.Tensor:
    """``[b, s]`` normalised old-policy entropy with the step's global statistics: the entropy
    class (h_hat > 0: high) the diagnostics split tokens by."""
    return normalize_entropy(mb.old_entropy, stats, algo.h_hat_mode)


def accumulate_token_diagnostics(micro_batches: list[MicroBatch], stats: EntropyStats, algo: AlgoConfig, *,
                                 finish_reasons: Optional[list[str]] = None) -> TokenDiagnostics:
    """`TokenDiagnostics` over the valid tokens of `micro_batches` (PPO update done): entropy,
    h_hat and temperature once per token, clip flags and advantages once per update of it, and
    the response lengths of the real sequences (`seq_index >= 0`; truncated = finish reason
    "length" in `finish_reasons[seq_index]`)."""
    diag = TokenDiagnostics()
    for mb in (m.unpacked() for m in micro_batches):  # one row per sequence (packed rows too)
        mask = mb.loss_mask != 0
        h_hat = diagnostic_h_hat(mb, stats, algo)
        diag.update_tokens(entropy=mb.old_entropy, h_hat=h_hat, mask=mask, token_ids=mb.labels,
                           temperatures=mb.temperatures)
        for u in mb.updates:
            diag.update_policy(h_hat=h_hat, mask=mask, token_ids=mb.labels, adv_before=mb.advantages,
                               adv_after=u.adv_after, clip_low=u.clip_low, clip_high=u.clip_high,
                               clip_dual=u.clip_dual)
        idx = mb.seq_index.tolist()
        real = [r for r, i in enumerate(idx) if i >= 0]
        diag.update_responses(mask[real].sum(dim=1), None if finish_reasons is None else
                              [finish_reasons[idx[r]] == "length" for r in real])
    return diag


def rollout_records(micro_batches: list[MicroBatch], batch: RolloutBatch | SequenceMeta, stats: EntropyStats,
                    algo: AlgoConfig, step: int) -> list[dict]:
    """Saved-rollout records (`analysis.ROLLOUT_FIELDS`, plus `index` in the step's batch) of the
    real sequences of `micro_batches`; ratio, A' and clip flags are the loss's in the last update."""
    out = []
    for mb in (m.unpacked() for m in micro_batches):
        per_tok = {"entropy": mb.old_entropy, "h_hat": diagnostic_h_hat(mb, stats, algo),
                   "adv_before": mb.advantages, "temperatures": mb.temperatures}
        if mb.updates:
            last = mb.updates[-1]
            per_tok.update(adv_after=last.adv_after, ratio=last.ratio, clip_low=last.clip_low,
                           clip_high=last.clip_high, clip_dual=last.clip_dual)
        for r, i in enumerate(mb.seq_index.tolist()):
            if i < 0:
                continue
            m = mb.loss_mask[r] != 0
            rec = {"step": step, "index": i, "uid": int(batch.group_ids[i]), "data_source": batch.data_sources[i],
                   "reward": float(batch.rewards[i]), "acc": bool(batch.accs[i]),
                   "finish_reason": batch.finish_reasons[i], "response_ids": mb.labels[r][m].tolist()}
            rec.update({k: v[r][m].tolist() for k, v in per_tok.items()})
            out.append(rec)
    return out


def token_diagnostics(rt: Runtime, minis: list[list[MicroBatch]], batch: RolloutBatch | SequenceMeta,
                      stats: EntropyStats, step: int) -> dict[str, float]:
    """``diag/*`` metrics of the step (same on every rank) and, every
    ``logging.save_rollouts_interval`` steps, ``<run_dir>/rollouts/step_<step>.jsonl`` (rank 0).

    The old-log-prob pass and the update left whole (CP-gathered) sequences on every TP/CP rank
    of the last stage, so only TP rank 0 / CP rank 0 of the last stage contributes and the sum
    runs over the world (= over DP among contributors, and it reaches rank 0 on the first stage too).
    """
    cfg, g = rt.cfg, rt.groups
    mbs = [mb for mini in minis for mb in mini]
    contribute = rt.contributes_metrics and g.cp_rank == 0
    diag = (accumulate_token_diagnostics(mbs, stats, cfg.algo, finish_reasons=batch.finish_reasons)
            if contribute else TokenDiagnostics())
    if dist.is_initialized() and dist.get_world_size() > 1:
        diag.all_reduce(device=rt.actor.device)
    metrics = {**diag.summary(pivot=math.exp(stats.pivot)), **entropy_histogram_summary(diag)}
    every = cfg.logging.save_rollouts_interval
    if every and step % every == 0:
        rows = rollout_records(mbs, batch, stats, cfg.algo, step) if contribute else []
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list = [None] * dist.get_world_size() if rt.is_main else None
            dist.gather_object(rows, gathered, dst=0)
            rows = [r for part in (gathered or []) for r in part]
        if rt.is_main:
            write_rollouts(rollout_path(rt.run_dir, step), sorted(rows, key=lambda r: r["index"]))
    return metrics


def entropy_histogram_summary(diag: TokenDiagnostics, prefix: str = "diag") -> dict[str, float]:
    """The entropy histogram in three numbers: shares of tokens below 1e-3 and 0.1 nats and at or
    above 1 nat (all bin edges of `analysis.ENTROPY_BIN_EDGES`)."""
    total = int(diag.entropy_hist.sum())
    if not total:
        return {}
    rows = diag.histogram()
    share = lambda pred: sum(r["count"] for r in rows if pred(r)) / total  # noqa: E731
    return {f"{prefix}/entropy_frac_lt_1e-3": share(lambda r: r["hi"] <= 1e-3 * (1 + 1e-9)),
            f"{prefix}/entropy_frac_lt_0.1": share(lambda r: r["hi"] <= 0.1 * (1 + 1e-9)),
            f"{prefix}/entropy_frac_ge_1": share(lambda r: r["lo"] >= 1.0 * (1 - 1e-9))}


__all__ = ["accumulate_token_diagnostics", "diagnostic_h_hat", "entropy_histogram_summary", "rollout_records",
           "token_diagnostics"]
