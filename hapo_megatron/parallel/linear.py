"""Log-prob + entropy straight from hidden states: the output layer fused into `vocab_parallel`.

`linear_logprobs_entropy(hidden, weight, targets)` gives what `vocab_parallel_logprobs_entropy`
gives on `hidden @ weight^T` (`weight` = this rank's vocab shard `[V/tp, H]` of the output layer
or of the tied embedding) without ever holding the `[N, V/tp]` logits or their gradient: tokens
are processed in chunks, each chunk's logits exist only while its sums are taken.

Forward, per chunk: logits `l = h_c W^T` (in the weight's dtype, as the output layer computes
them), `z = l / T`, this rank's row max `m_r` and the sums `S_r`, `A_r` and target logit of
`vocab_parallel` (its `_chunk_sums`) after subtracting `m_r`. The chunk's max cannot be the
global one without a collective per chunk, so the shards are combined once at the end: with
`M = max_r m_r` (one MAX all-reduce of `[N]`) and `d_r = m_r - M <= 0`,

    S = sum_r e^{d_r} S_r,    A = sum_r e^{d_r} (A_r + d_r S_r),    z_t - M = z_t - m_r + d_r

(one SUM all-reduce of the packed `[N, 3]`). At tp = 1, `d = 0` and every number equals the
logits path's bit for bit (same matmul, same float32 passes).

Backward recomputes each chunk's logits from the saved hidden states and the shift `M + log Z`,
turns them into `d z` with `vocab_parallel`'s `_chunk_grad`, and accumulates `d h_c = d l_c W`
and `d W += d l_c^T h_c`. `d hidden` is SUM-all-reduced over TP (the identity-forward /
all-reduce-backward of a column-parallel layer's input); under sequence parallelism `hidden` is
this rank's sequence shard, all-gathered in forward (and again in backward, instead of keeping the
gathered copy) and `d hidden` is reduce-scattered. So a call makes a constant number of
collectives: forward MAX + SUM (+ gather), backward one all-reduce or reduce-scatter (+ gather).

Memory beyond inputs and outputs: two float32 `[chunk, V/tp]` buffers in forward, one (two with
an entropy gradient) in backward, plus a `[chunk, V/tp]` low-precision buffer and a float32
`[V/tp, H]` accumulator for `d W` when the weight is bf16/fp16 (a float32 weight's gradient
is accumulated in place).

Padded vocabulary: `vocab_size` (global, unpadded) sets the logits of ids `>= vocab_size` to
`PADDED_VOCAB_LOGIT`, as `models.gpt`'s output-layer hook does on the logits path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from hapo_megatron.parallel.vocab_parallel import (
    _chunk_grad,
    _chunk_sums,
    _finish,
    _local_targets,
    _prepare_temperature,
    _row_factors,
    _shifted_chunk,
    _vocab_start,
)

# Same value as hapo_megatron.models.gpt.PADDED_VOCAB_LOGIT (a test checks); not imported so that
# this module stays free of the model layer.
PADDED_VOCAB_LOGIT = -1.0e4


@dataclass
class HiddenStates:
    """The last pipeline stage's output when the output layer is fused into the loss.

    `hidden` `[s, b, H]` are the final (normed) hidden states, sequence-first as Megatron keeps
    them (this rank's sequence shard under sequence parallelism); `weight` is the output layer's
    vocab shard `[V/tp, H]`; ids `>= vocab_size` are vocab padding."""

    hidden: torch.Tensor
    weight: torch.Tensor
    sequence_parallel: bool = False
    vocab_size: Optional[int] = None


def _tp_size(tp_group) -> int:
    return 1 if tp_group is None else dist.get_world_size(tp_group)


def _gather_rows(x: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gather along dim 0 (sequence parallelism's layout)."""
    out = x.new_empty((x.shape[0] * _tp_size(tp_group),) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=tp_group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, tp_group) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // _tp_size(tp_group),) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=tp_group)
    return out


def _padding_start(vocab_size: Optional[int], vocab_start: int, partition_vocab: int) -> Optional[int]:
    """First padded column of this shard, or None when the shard has no padding."""
    if vocab_size is None or vocab_size - vocab_start >= partition_vocab:
        return None
    return max(vocab_size - vocab_start, 0)


def _chunk_logits(h_c, weight, fp32_buf, low_buf, pad_from):
    """`h_c @ weight^T` `[n, V/tp]` in the weight's dtype, written into a reused buffer (the float32
    one itself for a float32 weight), padded ids masked."""
    n = h_c.shape[0]
    out = fp32_buf[:n] if low_buf is None else low_buf[:n]
    torch.mm(h_c, weight.t(), out=out)
    if pad_from is not None:
        out[:, pad_from:] = PADDED_VOCAB_LOGIT
    return out


class _LinearLogprobEntropy(torch.autograd.Function):
    """hidden `[N(/tp), H]`, weight `[V/tp, H]` (same dtype), targets `[N]` global ids,
    temperature `[N]` float32 or None."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, tp_group, chunk_size, entropy_grad,
                sequence_parallel, vocab_size):
        tp = _tp_size(tp_group)
        full = _gather_rows(hidden, tp_group) if sequence_parallel and tp > 1 else hidden
        n, vp = full.shape[0], weight.shape[0]
        vocab_start = _vocab_start(vp, tp_group)
        local_t, in_range = _local_targets(targets, vocab_start, vp)
        pad_from = _padding_start(vocab_size, vocab_start, vp)
        step = min(chunk_size or max(n, 1), max(n, 1))
        zbuf = torch.empty(step, vp, dtype=torch.float32, device=full.device)
        ebuf = torch.empty_like(zbuf)
        low = None if weight.dtype == torch.float32 else torch.empty(step, vp, dtype=weight.dtype,
                                                                      device=full.device)
        m_local = torch.empty(n, dtype=torch.float32, device=full.device)
        packed = torch.zeros(n, 3, dtype=torch.float32, device=full.device)
        for s in range(0, n, step):
            e_ = min(s + step, n)
            t_c = None if temperature is None else temperature[s:e_]
            logits_c = _chunk_logits(full[s:e_], weight, zbuf, low, pad_from)
            m_c = logits_c.amax(dim=-1).float()  # as vocab_parallel: max(l) / T == max(l / T)
            m_local[s:e_] = m_c if t_c is None else m_c / t_c
            z = _shifted_chunk(zbuf[: e_ - s], logits_c, t_c, m_local[s:e_])
            _chunk_sums(z, ebuf[: e_ - s], local_t[s:e_], in_range[s:e_], False, packed[s:e_])
        del zbuf, ebuf, low
        m = _combine_shards(packed, m_local, in_range, tp_group)
        logprobs, entropy, log_z = _finish(packed)

        ctx.tp_group, ctx.chunk_size, ctx.entropy_grad = tp_group, chunk_size, entropy_grad
        ctx.sequence_parallel, ctx.pad_from = sequence_parallel and tp > 1, pad_from
        ctx.has_temperature = temperature is not None
        saved_t = temperature if temperature is not None else m.new_empty(0)
        ctx.save_for_backward(hidden, weight, local_t, in_range, saved_t, m + log_z, entropy)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local_t, in_range, temperature, shift, entropy = ctx.saved_tensors
        full = _gather_rows(hidden, ctx.tp_group) if ctx.sequence_parallel else hidden
        n, vp = full.shape[0], weight.shape[0]
        g1 = grad_logprobs if grad_logprobs is not None else torch.zeros_like(shift)
        g2 = grad_entropy if (ctx.entropy_grad and grad_entropy is not None) else None
        g1, g2, g1_hit = _row_factors(g1, g2, temperature, in_range, ctx.has_temperature)
        step = min(ctx.chunk_size or max(n, 1), max(n, 1))
        lbuf = torch.empty(step, vp, dtype=torch.float32, device=full.device)
        pbuf = None if g2 is None else torch.empty_like(lbuf)  # p in place of log p without g2
        fp32 = weight.dtype == torch.float32
        low = None if fp32 else torch.empty(step, vp, dtype=weight.dtype, device=full.device)
        grad_full = torch.empty_like(full)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, n, step):
            e_ = min(s + step, n)
            t_c = temperature[s:e_] if ctx.has_temperature else None
            logits_c = _chunk_logits(full[s:e_], weight, lbuf, low, ctx.pad_from)
            logp = _shifted_chunk(lbuf[: e_ - s], logits_c, t_c, shift[s:e_])  # log softmax
            grad = _chunk_grad(logp, logp if pbuf is None else pbuf[: e_ - s], g1[s:e_],
                               None if g2 is None else g2[s:e_], entropy[s:e_], local_t[s:e_],
                               g1_hit[s:e_], False)
            if ctx.pad_from is not None:  # the masking's backward: padded logits are constants
                grad[:, ctx.pad_from:] = 0.0
            g = grad if fp32 else low[: e_ - s].copy_(grad)  # d logits in the logits' dtype
            torch.mm(g, weight, out=grad_full[s:e_])
            if fp32:
                grad_w.addmm_(g.t(), full[s:e_])
            else:  # low-precision partial product, float32 accumulation over chunks
                grad_w.add_(torch.mm(g.t(), full[s:e_]))
        del lbuf, pbuf, low
        grad_hidden = _reduce_hidden_grad(grad_full, ctx.tp_group, ctx.sequence_parallel)
        return (grad_hidden, grad_w if fp32 else grad_w.to(weight.dtype),
                None, None, None, None, None, None, None)


def _combine_shards(packed, m_local, in_range, tp_group) -> torch.Tensor:
    """Rescale each rank's sums from its own row max to the global one and SUM them (in place);
    returns the global row max `M`."""
    if _tp_size(tp_group) == 1:
        return m_local
    m = m_local.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    d = m_local - m  # <= 0; a shard of padding only has d ~ -1e4 and weight exp(d) == 0
    scale = torch.exp(d)
    packed[:, 1] = scale * (packed[:, 1] + d * packed[:, 0])
    packed[:, 0] *= scale
    packed[:, 2] = torch.where(in_range, packed[:, 2] + d, torch.zeros_like(d))
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
    return m


def _reduce_hidden_grad(grad_full, tp_group, sequence_parallel):
    """Sum the TP ranks' partial `d hidden` (every rank saw all tokens, its vocab shard only)."""
    if _tp_size(tp_group) == 1:
        return grad_full
    if sequence_parallel:
        return _reduce_scatter_rows(grad_full, tp_group)
    dist.all_reduce(grad_full, group=tp_group)
    return grad_full


def linear_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group=None,
    temperature: Union[float, torch.Tensor] = 1.0,
    chunk_size: Optional[int] = None,
    entropy_grad: bool = False,
    sequence_parallel: bool = False,
    vocab_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy of `softmax(hidden @ weight^T / temperature)` over a
    vocab sharded across `tp_group`, never materialising the `[N, V/tp]` logits.

    Args:
        hidden: `[N, H]` final hidden states (under `sequence_parallel`, this rank's `[N/tp, H]`
            shard of the rows, Megatron's layout). Cast to the weight's dtype if it differs.
        weight: `[V/tp, H]` this rank's vocab shard of the output layer (or tied embedding).
        targets: `[N]` int64 global token ids (all N rows, also under sequence parallelism).
        tp_group, temperature, entropy_grad: as in `vocab_parallel_logprobs_entropy`
            (temperature a positive float or an `[N]` tensor).
        chunk_size: tokens per chunk (None = all at once). Peak extra memory is about
            `2 * chunk_size * V/tp * 4` bytes.
        sequence_parallel: `hidden` is sequence-sharded (gathered here, gradient reduce-scattered).
        vocab_size: global unpadded vocab; logits of ids `>= vocab_size` are PADDED_VOCAB_LOGIT.

    Returns:
        `(logprobs, entropy)` float32 `[N]`, identical on every rank of `tp_group`.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V/tp, H], got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"weight must be floating point, got {weight.dtype}")
    n = hidden.shape[0] * (_tp_size(tp_group) if sequence_parallel else 1)
    if targets.shape != (n,):
        raise ValueError(f"targets must have shape ({n},), got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64 token ids, got {targets.dtype}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if hidden.dtype != weight.dtype:  # e.g. Float16Module's float32 output of the last stage
        hidden = hidden.to(weight.dtype)
    temp = _prepare_temperature(temperature, (n,), hidden.device)
    return _LinearLogprobEntropy.apply(hidden.contiguous(), weight, targets.long(), temp, tp_group,
                                       chunk_size, bool(entropy_grad), bool(sequence_parallel),
                                       vocab_size)


def logprobs_entropy_from_hidden(states: HiddenStates, labels: torch.Tensor, **kw):
    """`(logprobs, entropy)` `[b, s]` from a `HiddenStates` (sequence-first `[s, b, H]`) and batch-
    first `labels` `[b, s]`; `kw` go to `linear_logprobs_entropy` (a tensor temperature is
    `[b, s]` like the labels)."""
    h = states.hidden
    if h.dim() != 3:
        raise ValueError(f"HiddenStates.hidden must be [s, b, H], got shape {tuple(h.shape)}")
    b, s = labels.shape
    temp = kw.pop("temperature", 1.0)
    if torch.is_tensor(temp) and temp.dim() == 2:
        temp = temp.t().reshape(-1)
    lp, ent = linear_logprobs_entropy(h.reshape(-1, h.shape[-1]), states.weight, labels.t().reshape(-1),
                                      temperature=temp, sequence_parallel=states.sequence_parallel,
                                      vocab_size=states.vocab_size, **kw)
    return lp.view(s, b).t().contiguous(), ent.view(s, b).t().contiguous()
