"""Log-prob + entropy straight from hidden states: the output layer fused into `vocab_parallel`.

`linear_logprobs_entropy(hidden, weight, targets)` gives what `vocab_parallel_logprobs_entropy`
gives on `hidden @ weight^T` (`weight` = this rank's vocab shard `[V/tp, H]` of the output layer
or of the tied embedding) without ever holding the `[N, V/tp]` logits or their gradient: the
vocab is processed in slices, each slice's logits exist only while its sums are taken.

Slices cut the vocab shard, not the tokens: slice `v` covers all N tokens and the rows `W_v`
(`chunk_size * V/tp / N` of them, so a slice has as many entries as `chunk_size` tokens of the
whole shard). Forward and backward cut the same way, so the logits recomputed in backward are
bit-identical to the forward's (recomputing them with another blocking changes their float32
rounding, which the entropy gradient of rows with logits in the thousands amplifies tenfold).

Forward, per slice: logits `l = h W_v^T` (in the weight's dtype, as the output layer computes
them), `z = l / T`, the slice's row max `m_v` and the sums of `vocab_parallel` (its
`_chunk_sums`: `S = sum exp(z - m)`, `A = sum exp(z - m)(z - m)` and the target's `z - m`).
Sums taken after different shifts merge exactly: with `M = max(m_a, m_b)`, `d = m - M <= 0`,

    S = sum e^{d} S_m,    A = sum e^{d} (A_m + d S_m),    z_t - M = (z_t - m) + d.

The same merge combines the TP ranks once at the end: one MAX all-reduce of the row maxima
`[N]` and one SUM all-reduce of the packed `[N, 3]` sums, whatever the number of slices.

Backward recomputes each slice's logits from the saved hidden states and the shift `M + log Z`,
turns them into `d z` with `vocab_parallel`'s `_chunk_grad` and takes `d W_v = d l_v^T h` (one
matmul over all tokens: no `[V/tp, H]` accumulator, the logits path's rounding) and
`d h += d l_v W_v` (float32 accumulation). `d hidden` is SUM-all-reduced over TP (the
identity-forward / all-reduce-backward of a column-parallel layer's input); under sequence
parallelism `hidden` is this rank's sequence shard, all-gathered in forward (and again in
backward, instead of keeping the gathered copy) and `d hidden` is reduce-scattered. So a call
makes a constant number of collectives: forward MAX + SUM (+ gather), backward one all-reduce or
reduce-scatter (+ gather).

Memory beyond inputs and outputs: two float32 slice buffers (`chunk_size * V/tp` entries each)
in forward, one (two with an entropy gradient) in backward; with a bf16/fp16 weight also one
slice buffer in that dtype and a float32 `[N, H]` accumulator for `d hidden` (`2H / (V/tp)` of
the bf16 logits: 0.09 for Qwen2.5-7B at TP2).

On CUDA each slice's sums and gradient come from the Triton kernels of `vocab_kernels.py` (one
read of the slice's logits in the weight's dtype, the gradient written over them): no float32
slice buffers then.

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
    _inverse,
    _local_targets,
    _prepare_temperature,
    _row_factors,
    _shifted_chunk,
    _vocab_start,
    combine_shards,
    kernel_row_sums,
    rescale_sums,
    use_triton_kernels,
    vocab_kernels,
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
    sequence_parallel: bool
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


def _chunk_logits(h, weight_slice, fp32_buf, low_buf, pad_from):
    """Logits `h @ weight_slice^T` `[n, w]` in the weight's dtype (as the output layer makes them),
    written into a reused `[n, w]` buffer (the float32 one for a float32 weight), padded ids
    (columns from `pad_from` on) masked."""
    out = fp32_buf if low_buf is None else low_buf
    torch.mm(h, weight_slice.t(), out=out)
    if pad_from is not None:
        out[:, pad_from:] = PADDED_VOCAB_LOGIT
    return out


class _Slices:
    """Vocab slices `[v0, v0 + w)` of all N rows with reused flat buffers: forward and backward
    cut the vocab the same way, so the recomputed logits equal the forward's bit for bit (a
    different cut changes the matmul's rounding, which the entropy gradient of rows with huge
    logits would amplify)."""

    def __init__(self, n, vp, chunk_size, dtype, device, fp32_buffers):
        # as many entries per slice as a chunk of `chunk_size` tokens over the whole shard
        self.n, self.vp = n, vp
        self.width = max(1, min(vp, (chunk_size or n) * vp // max(n, 1)))
        self.fp32 = [torch.empty(n * self.width, dtype=torch.float32, device=device)
                     for _ in range(fp32_buffers)]
        self.low = None if dtype == torch.float32 else torch.empty(n * self.width, dtype=dtype, device=device)

    def __iter__(self):
        return iter(range(0, self.vp, self.width))

    def size(self, v0):
        return min(v0 + self.width, self.vp) - v0

    def view(self, buf, v0):
        return None if buf is None else buf[: self.n * self.size(v0)].view(self.n, self.size(v0))

    def logits_buffer(self, v0):
        """The float32 buffer the logits of a float32 weight go to (None when there is none)."""
        return self.view(self.fp32[0], v0) if self.fp32 else None


def _slice_targets(local_t, in_range, v0, w):
    lt = local_t - v0
    hit = in_range & (lt >= 0) & (lt < w)
    return torch.where(hit, lt, torch.zeros_like(lt)), hit


def _slice_padding(pad_from, v0, w):
    """First padded column within the slice, or None."""
    if pad_from is None or pad_from - v0 >= w:
        return None
    return max(pad_from - v0, 0)


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
        # the Triton kernels read each slice's logits once (no float32 copies: vocab_kernels.py)
        kernels = use_triton_kernels(full)
        inv_t = _inverse(temperature) if kernels else None
        fp32_buffers = (1 if weight.dtype == torch.float32 else 0) if kernels else 2  # kernels: logits only
        sl = _Slices(n, vp, chunk_size, weight.dtype, full.device, fp32_buffers)
        m_local = packed = None
        part = torch.empty(n, 3, dtype=torch.float32, device=full.device)
        for v0 in sl:
            w_ = sl.size(v0)
            logits = _chunk_logits(full, weight[v0:v0 + w_], sl.logits_buffer(v0), sl.view(sl.low, v0),
                                   _slice_padding(pad_from, v0, w_))
            lt, hit = _slice_targets(local_t, in_range, v0, w_)
            if kernels:
                m_s = kernel_row_sums(logits, inv_t, lt, hit, part)
            else:
                m_s = logits.amax(dim=-1).float()  # as vocab_parallel: max(l) / T == max(l / T)
                m_s = m_s if temperature is None else m_s / temperature
                z = _shifted_chunk(sl.view(sl.fp32[0], v0), logits, temperature, m_s)
                _chunk_sums(z, sl.view(sl.fp32[1], v0), lt, hit, False, part)
            if packed is None:
                m_local, packed, seen = m_s, part.clone(), hit
                continue
            m_new = torch.maximum(m_local, m_s)  # merge this slice into the running sums
            rescale_sums(packed, m_local - m_new, seen)
            rescale_sums(part, m_s - m_new, hit)
            packed += part
            m_local, seen = m_new, seen | hit
        del sl, part
        if packed is None:  # no rows
            m_local = torch.zeros(n, dtype=torch.float32, device=full.device)
            packed = torch.zeros(n, 3, dtype=torch.float32, device=full.device)
        m = combine_shards(packed, m_local, in_range, tp_group)
        logprobs, entropy, log_z = _finish(packed)

        ctx.tp_group, ctx.chunk_size, ctx.entropy_grad = tp_group, chunk_size, entropy_grad
        ctx.sequence_parallel, ctx.pad_from = sequence_parallel and tp > 1, pad_from
        ctx.has_temperature, ctx.kernels = temperature is not None, kernels
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
        g1, g2, _ = _row_factors(g1, g2, temperature, in_range, ctx.has_temperature)
        t = temperature if ctx.has_temperature else None
        fp32 = weight.dtype == torch.float32
        kernels = ctx.kernels
        if kernels:  # d logits straight into the slice's logits buffer, in its dtype
            sl = _Slices(n, vp, ctx.chunk_size, weight.dtype, full.device, 1 if fp32 else 0)
            f32 = [None if x is None else x.float().contiguous() for x in (g1, g2)]
            inv_t = _inverse(t)
        else:
            sl = _Slices(n, vp, ctx.chunk_size, weight.dtype, full.device, 1 if g2 is None else 2)
        grad_w = torch.empty_like(weight)
        grad_acc = torch.zeros(full.shape, dtype=torch.float32, device=full.device)
        for v0 in sl:
            w_ = sl.size(v0)
            w_c, pad = weight[v0:v0 + w_], _slice_padding(ctx.pad_from, v0, w_)
            logits = _chunk_logits(full, w_c, sl.logits_buffer(v0), sl.view(sl.low, v0), pad)
            lt, hit = _slice_targets(local_t, in_range, v0, w_)
            g1_hit = torch.where(hit, g1, torch.zeros_like(g1))
            if kernels:
                grad = vocab_kernels().logits_grad(logits, inv_t, shift, f32[0], f32[1], entropy, lt,
                                                   g1_hit.float().contiguous(), out=logits)
            else:
                logp = _shifted_chunk(sl.view(sl.fp32[0], v0), logits, t, shift)  # log softmax
                # p in place of log p unless the entropy gradient needs both
                grad = _chunk_grad(logp, sl.view(sl.fp32[-1], v0), g1, g2, entropy, lt, g1_hit, False)
            if pad is not None:  # the masking's backward: padded logits are constants
                grad[:, pad:] = 0.0
            g = grad if (fp32 or kernels) else sl.view(sl.low, v0).copy_(grad)  # d logits in the logits' dtype
            torch.mm(g.t(), full, out=grad_w[v0:v0 + w_])  # all tokens at once: no d W accumulator
            if fp32:
                grad_acc.addmm_(g, w_c)
            else:  # low-precision partial product, float32 sum over the slices
                grad_acc.add_(torch.mm(g, w_c))
        del sl
        grad_full = grad_acc if fp32 else grad_acc.to(full.dtype)
        grad_hidden = _reduce_hidden_grad(grad_full, ctx.tp_group, ctx.sequence_parallel)
        return grad_hidden, grad_w, None, None, None, None, None, None, None


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
    temperature: Union[float, torch.Tensor],
    chunk_size: Optional[int] = None,
    entropy_grad: bool = False,
    sequence_parallel: bool,
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
        chunk_size: the work is cut into vocab slices of `chunk_size * V/tp` entries (None = all
            at once). Peak extra memory is about `2 * chunk_size * V/tp * 4` bytes.
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
    temp = kw.pop("temperature")
    if torch.is_tensor(temp) and temp.dim() == 2:
        temp = temp.t().reshape(-1)
    lp, ent = linear_logprobs_entropy(h.reshape(-1, h.shape[-1]), states.weight, labels.t().reshape(-1),
                                      temperature=temp, sequence_parallel=states.sequence_parallel,
                                      vocab_size=states.vocab_size, **kw)
    return lp.view(s, b).t().contiguous(), ent.view(s, b).t().contiguous()
