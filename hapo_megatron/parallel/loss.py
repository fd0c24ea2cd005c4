"""The HAPO loss for Megatron's `forward_backward_func` (`calculate_per_token_loss=True`).

Megatron's per-token-loss path expects a loss function returning `(loss_sum, num_tokens,
reporting)`: it backpropagates `loss_sum` as is, adds the integer `num_tokens` of every
micro-batch, and `finalize_model_grads` broadcasts the total from the last pipeline stage,
SUM-all-reduces it over the data x context parallel group and scales every gradient by
`1 / total` (data-parallel gradients are summed, not averaged, in this mode). So with

    loss = sum over ranks and micro-batches of loss_sum / sum of num_tokens

the gradient is independent of how the mini-batch is split over DP, CP and micro-batches.
What `num_tokens` counts depends on `loss_agg_mode`:

- `token-mean`: valid tokens on this rank (CP ranks hold different tokens, so no double count);
- `seq-mean-token-sum`, `seq-mean-token-mean`: sequences with a valid token, counted on CP rank
  0 only (a sequence is split over the CP ranks); `seq-mean-token-mean` divides each
  token by the sequence's full length, SUM-all-reduced over `cp_group`;
- `seq-mean-token-sum-norm`: sequences as above; `loss_sum` is divided by the horizon
  (`loss_scale_factor`, default the full, un-split sequence length of the batch) so
  the count stays an integer as Megatron requires.

Under tensor parallelism every TP rank computes the same loss from its vocab shard
(`vocab_parallel_logprobs_entropy`); under context parallelism the batch tensors given here
are already this rank's CP shard (`MicroBatch.split_for_cp`).

A packed micro-batch (`MicroBatch.is_packed`, one row of several sequences) is laid out as one
row per sequence (`MicroBatch.sequence_layout`) before the per-sequence aggregation, so every
`loss_agg_mode` sees the same sequences as with padding; the per-token fields go back to the
packed row.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from hapo_megatron.algo import (
    EntropyStats,
    PolicyLossConfig,
    PolicyTokenFields,
    COV_LOSSES,
    SEQUENCE_RATIO_LOSSES,
    CovStats,
    compute_entropy_stats,
    forking_select,
    hapo_policy_loss,
    normalize_entropy,
    position_keys,
    select_with_stats,
    sequence_log_ratio,
    sequence_ratio_terms,
)
from hapo_megatron.parallel.linear import HiddenStates, logprobs_entropy_from_hidden
from hapo_megatron.parallel.micro_batch import MicroBatch
from hapo_megatron.parallel.vocab_parallel import vocab_parallel_logprobs_entropy

#: tokens per chunk of the fused log-prob/entropy: 2 float32 buffers of 1024 x V/tp (~0.6 GB at
#: V/tp = 76k) instead of 2 x T x V/tp for the whole micro-batch.
DEFAULT_LOGPROB_CHUNK = 1024
_REQUIRED = ("old_logprobs", "advantages")  # besides labels / loss_mask, which every MicroBatch has


def _cp_size(cp_group) -> int:
    return 1 if cp_group is None else dist.get_world_size(cp_group)


def _cp_rank(cp_group) -> int:
    return 0 if cp_group is None else dist.get_rank(cp_group)


Output = Union[torch.Tensor, HiddenStates]


def logprobs_entropy_from_logits(logits: Output, labels: torch.Tensor, *, tp_group=None,
                                 temperature: Union[float, torch.Tensor],
                                 chunk_size: Optional[int] = DEFAULT_LOGPROB_CHUNK,
                                 entropy_grad: bool = False):
    """Per-token `(logprobs, entropy)` `[b, s]` float32 from GPTModel logits `[b, s, V/tp]`, or
    from its final hidden states (`HiddenStates`, the fused output layer: no logits are made).

    For the old-log-prob / reference passes (run it under `torch.no_grad()`), and used by the
    loss. `labels [b, s]` are the global ids of the tokens predicted at each position."""
    kw = dict(tp_group=tp_group, temperature=temperature, chunk_size=chunk_size, entropy_grad=entropy_grad)
    if isinstance(logits, HiddenStates):
        return logprobs_entropy_from_hidden(logits, labels, **kw)
    if logits.dim() != 3:
        raise ValueError(f"logits must be [b, s, V/tp], got shape {tuple(logits.shape)}")
    return vocab_parallel_logprobs_entropy(logits, labels, **kw)


def zero_loss_like(output: Output) -> torch.Tensor:
    """A 0-dim float32 zero on the output's device (the loss of a forward-only pass)."""
    t = output.hidden if isinstance(output, HiddenStates) else output
    return t.new_zeros((), dtype=torch.float32)


def _check_batch(batch: MicroBatch) -> None:
    if not isinstance(batch, MicroBatch):
        raise TypeError(f"batch must be a MicroBatch, got {type(batch).__name__}")
    for name in _REQUIRED:
        if getattr(batch, name) is None:
            raise ValueError(f"batch.{name} is required by the loss (needs {_REQUIRED})")


def _h_hat(cfg: PolicyLossConfig, stats: Optional[EntropyStats], batch, entropy, valid):
    """Normalised entropy `[b, s]` (detached) or None when it is neither needed nor computable."""
    if cfg.h_hat_entropy == "old":
        if batch.old_entropy is None:
            if cfg.needs_h_hat:
                raise ValueError("batch.old_entropy is required with h_hat_entropy='old'")
            return None, stats
        source = batch.old_entropy.detach()
    else:
        source = entropy.detach()
    if cfg.entropy_stats_scope == "microbatch":
        # The public implementation's behaviour: statistics of this micro-batch on this rank only.
        stats = compute_entropy_stats(source, valid, entropy_pivot=cfg.entropy_pivot) \
            if bool(valid.any()) else EntropyStats.neutral()
    elif stats is None:
        if cfg.needs_h_hat:
            raise ValueError("stats is required with entropy_stats_scope='global' (from "
                             "global_entropy_stats over the rollout batch)")
        return None, None
    return normalize_entropy(source, stats, cfg.h_hat_mode), stats


def _sequence_counts(valid: torch.Tensor, cp_group):
    """Full-sequence valid-token counts `[b]` (summed over CP) and this rank's sequence count."""
    lengths = valid.sum(dim=-1).to(torch.float32)
    if _cp_size(cp_group) > 1:
        dist.all_reduce(lengths, group=cp_group)
    n_seq = int((lengths > 0).sum()) if _cp_rank(cp_group) == 0 else 0
    return lengths, n_seq


def _seq_is_log_ratio(cfg: PolicyLossConfig, t: dict, cp_group) -> Optional[torch.Tensor]:
    """``seq_tis``: each sequence's sum of ``proximal - behaviour`` log-probs ``[b]``, summed
    over the CP ranks that hold its chunks (None for the other modes: nothing to reduce)."""
    if cfg.rollout_is_mode != "seq_tis":
        return None
    d = (t["proximal"] - t["rollout"]).detach().float()
    sums = sequence_log_ratio(d, t["valid"])
    if _cp_size(cp_group) > 1:
        dist.all_reduce(sums, group=cp_group)
    return sums


def _seq_ratio_terms_sum(cfg: PolicyLossConfig, t: dict, cp_group) -> Optional[torch.Tensor]:
    """GSPO / GMPO: each sequence's sum of its per-token log-ratio terms ``[b]`` over all its valid
    tokens, summed over the CP ranks that hold its chunks (detached: the gradient of each token
    flows through its own log-prob, docs/algorithm.md, "The field's objectives")."""
    if cfg.policy_loss not in SEQUENCE_RATIO_LOSSES:
        return None
    terms = sequence_ratio_terms(cfg.policy_loss, t["logprobs"], t["old"], t["adv"], t["valid"],
                                 float(cfg.clip_ratio_low), float(cfg.clip_ratio_high))
    sums = terms.sum(dim=-1)
    if _cp_size(cp_group) > 1:
        dist.all_reduce(sums, group=cp_group)
    return sums


def _forking_select(cfg: PolicyLossConfig, batch: MicroBatch, valid, threshold: Optional[float]):
    """The forking tokens of this micro-batch ``[b, s]`` (None when ``forking_tokens`` is off)."""
    if not cfg.forking_tokens:
        return None
    if batch.old_entropy is None:
        raise ValueError("batch.old_entropy is required with forking_tokens (the selection's entropy)")
    if threshold is None and bool(valid.any()):
        raise ValueError("forking_threshold is required with forking_tokens (from "
                         "parallel.stats.global_forking_threshold over the step batch)")
    return forking_select(batch.old_entropy, valid, threshold)


def _cov_inputs(cfg: PolicyLossConfig, batch: MicroBatch, valid, stats: Optional[CovStats]):
    """Clip-Cov / KL-Cov: ``(cov_select, cov_keys)`` of this micro-batch (this rank's CP shard):
    the step scope's selection from the step's `CovStats`, or the micro-batch scope's keys."""
    if cfg.policy_loss not in COV_LOSSES:
        return None, None
    if stats is None:
        raise ValueError(f"cov_stats is required with policy_loss={cfg.policy_loss} (from "
                         "parallel.cov.global_cov_stats, or only its seed with cov_scope=micro_batch)")
    if batch.seq_index is None:
        raise ValueError(f"batch.seq_index is required with policy_loss={cfg.policy_loss} (the tokens' "
                         "positions in the step batch seed their random keys)")
    keys = position_keys(stats.seed, batch.tokens_of_sequences(batch.seq_index), batch.position_ids)
    if cfg.cov_scope == "micro_batch":
        return None, keys
    return select_with_stats(cfg.policy_loss, stats, batch.advantages, batch.old_logprobs, valid, keys,
                             cfg.clip_cov_lb, cfg.clip_cov_ub), None


TokenSink = Callable[[PolicyTokenFields], None]


def hapo_loss_from_logits(logits: Output, batch: MicroBatch, *, cfg: PolicyLossConfig,
                          stats: Optional[EntropyStats], tp_group=None, cp_group=None,
                          temperature: Union[float, torch.Tensor],
                          on_token_fields: Optional[TokenSink] = None,
                          loss_scale_factor: Optional[float] = None,
                          logprob_chunk_size: Optional[int] = DEFAULT_LOGPROB_CHUNK,
                          forking_threshold: Optional[float] = None,
                          cov_stats: Optional[CovStats] = None):
    """HAPO loss of one micro-batch as `(loss_sum, num_tokens, metrics)` for Megatron.

    Args:
        logits: `[b, s, V/tp]` this rank's vocab shard (GPTModel output, batch first), or the
            `HiddenStates` of `models.forward_hidden_states` (fused output layer).
        batch: a `MicroBatch` (this rank's CP shard) with `old_logprobs` and `advantages`;
            `old_entropy` (h_hat_entropy "old"); optional `ref_logprobs` (KL),
            `rollout_logprobs` (tis_cap, rollout_is), `proximal_logprobs` (rollout_is).
        cfg: the loss's knobs. stats: the step's global `EntropyStats` (scope "global").
        tp_group / cp_group: tensor / context parallel groups (None = not split).
        temperature: float or `[b, s]` tensor dividing the logits (the sampling base temperature;
            a tensor is this rank's CP shard, like the batch).
        on_token_fields: called with the `PolicyTokenFields` of this micro-batch (this rank's
            CP shard): the per-token ratio, advantage and clip flags the metrics are sums of.
        loss_scale_factor: horizon of "seq-mean-token-sum-norm" (None = the full, un-split
            sequence length of the batch).
        logprob_chunk_size: tokens per chunk of the fused log-prob/entropy (None = no chunking);
            its peak extra memory is about `2 * chunk * V/tp * 4` bytes.
        forking_threshold: with `forking_tokens`, the step batch's log-entropy threshold
            (`parallel.stats.global_forking_threshold` of the old entropies; None only when no
            token of the step is valid).
        cov_stats: with `policy_loss` clip_cov / kl_cov, the step's `CovStats`
            (`parallel.cov.global_cov_stats`; with `cov_scope: micro_batch` only its seed is read).

    Returns:
        `loss_sum` (0-dim float32, differentiable), `num_tokens` (0-dim int32, see the module
        docstring) and `metrics`: float64 0-dim SUMS (summable over micro-batches and DP x CP
        ranks; `algo.finalize_loss_metrics` turns them into means), i.e. the keys of
        `algo.hapo_policy_loss` (`loss/num_tokens`, `loss/pg_loss_sum`, `loss/clipfrac_*_sum`,
        `loss/entropy_sum` of the current policy, ...) plus `loss/objective_sum` (this
        `loss_sum`) and `loss/normalizer` (this `num_tokens`): their global quotient is the loss.
    """
    if not isinstance(logits, HiddenStates) and logits.dim() != 3:
        raise ValueError(f"logits must be [b, s, V/tp], got shape {tuple(logits.shape)}")
    _check_batch(batch)
    rollout_is = cfg.rollout_is_mode
    if rollout_is != "none" and (batch.rollout_logprobs is None or batch.proximal_logprobs is None):
        raise ValueError(f"rollout_is={rollout_is!r} needs batch.rollout_logprobs (behaviour) and "
                         "batch.proximal_logprobs (the old-log-prob pass at the sampling temperatures)")
    shape = batch.labels.shape
    valid = batch.loss_mask.detach() != 0
    logprobs, entropy = logprobs_entropy_from_logits(
        logits, batch.labels, tp_group=tp_group, temperature=temperature,
        chunk_size=logprob_chunk_size, entropy_grad=cfg.entropy_coeff != 0.0)
    h_hat, _ = _h_hat(cfg, stats, batch, entropy, valid)
    per_token = dict(logprobs=logprobs, old=batch.old_logprobs, adv=batch.advantages, valid=valid,
                     h_hat=h_hat, entropy=entropy, ref=batch.ref_logprobs, rollout=batch.rollout_logprobs,
                     proximal=batch.proximal_logprobs if rollout_is != "none" else None,
                     select=_forking_select(cfg, batch, valid, forking_threshold),
                     select_entropy=batch.old_entropy if cfg.forking_tokens else None)
    per_token["cov_select"], per_token["cov_keys"] = _cov_inputs(cfg, batch, valid, cov_stats)
    layout = batch.sequence_layout()
    if layout is not None:  # one row per sequence: the seq-mean modes count sequences, not rows
        per_token = {k: None if v is None else layout.to_rows(v) for k, v in per_token.items()}
    valid = per_token["valid"]

    mode = cfg.loss_agg_mode
    lengths, n_seq = _sequence_counts(valid, cp_group)
    horizon = None
    if mode == "seq-mean-token-sum-norm":
        row = batch.max_seqlen if batch.is_packed else shape[1] * _cp_size(cp_group)
        horizon = loss_scale_factor or float(row)
    t = per_token
    loss_sum, normalizer, metrics, token_fields = hapo_policy_loss(
        t["logprobs"], t["old"], t["adv"], valid, t["h_hat"], cfg=cfg,
        loss_scale_factor=horizon, seq_token_counts=lengths, num_seqs=float(n_seq),
        entropy=t["entropy"], ref_logprobs=t["ref"], rollout_logprobs=t["rollout"],
        proximal_logprobs=t["proximal"], seq_is_log_ratio=_seq_is_log_ratio(cfg, t, cp_group),
        seq_ratio_terms_sum=_seq_ratio_terms_sum(cfg, t, cp_group), token_select=t["select"],
        select_entropy=t["select_entropy"], cov_select=t["cov_select"], cov_keys=t["cov_keys"],
        return_token_fields=True)
    if layout is not None:
        token_fields = token_fields.apply(layout.to_packed)
    if on_token_fields is not None:
        on_token_fields(token_fields)
    if mode == "token-mean":
        count = int(valid.sum())
    else:
        count = n_seq
        if horizon is not None:  # keep Megatron's count an integer: fold the horizon into the sum
            loss_sum = loss_sum / horizon
    num_tokens = torch.tensor(count, dtype=torch.int, device=loss_sum.device)
    metrics = dict(metrics)
    metrics["loss/objective_sum"] = loss_sum.detach().to(torch.float64)
    metrics["loss/normalizer"] = num_tokens.detach().to(torch.float64)
    return loss_sum, num_tokens, metrics


def make_loss_func(batch: MicroBatch, **kw) -> Callable[[torch.Tensor], tuple]:
    """`loss_func(output_tensor)` for `forward_backward_func`; `kw` go to `hapo_loss_from_logits`."""

    def loss_func(output_tensor: torch.Tensor):
        return hapo_loss_from_logits(output_tensor, batch, **kw)

    return loss_func


def make_logprob_func(labels: torch.Tensor, *, tp_group=None, temperature,
                      chunk_size: Optional[int] = DEFAULT_LOGPROB_CHUNK) -> Callable[[torch.Tensor], tuple]:
    """`loss_func` for a `forward_only=True` pass collecting `(logprobs, entropy)` `[b, s]`.

    Returns Megatron's 3-tuple with a zero loss, `num_tokens = 0` and
    `{"logprobs": ..., "entropy": ...}` (detached float32), which `forward_backward_func` appends to
    its returned list on the last pipeline stage, one dict per micro-batch."""

    def loss_func(output_tensor: torch.Tensor):
        with torch.no_grad():
            lp, ent = logprobs_entropy_from_logits(output_tensor, labels, tp_group=tp_group,
                                                   temperature=temperature, chunk_size=chunk_size)
        zero = zero_loss_like(output_tensor)
        return zero, torch.tensor(0, dtype=torch.int, device=zero.device), \
            {"logprobs": lp.detach(), "entropy": ent.detach()}

    return loss_func
