"""Fused log-prob + entropy over vocab-sharded logits (tensor parallel).

With Megatron's `parallel_output=True` each tensor-parallel rank holds a vocab shard of the
logits, `[..., V/tp]`, covering global ids `[rank * V/tp, (rank + 1) * V/tp)` (Megatron's
`VocabUtility.vocab_range_from_per_partition_vocab_size`). For every row we need

    logprob = z_target - logsumexp(z)        entropy = logsumexp(z) - sum_v softmax(z)_v z_v

with `z = logits / temperature`. Both follow from three per-row sums taken after subtracting
the global row max `m`: `S = sum exp(z - m)`, `A = sum exp(z - m) (z - m)` and the shifted
target logit (nonzero on exactly one rank). So the forward needs one MAX all-reduce of `[N]`
and one SUM all-reduce of the packed `[N, 3]` tensor:

    logZ = log S,   logprob = z_t - m - logZ,   entropy = logZ - A / S.

Backward recomputes the softmax chunk by chunk from the saved (unmodified) input instead of
keeping a `[N, V/tp]` probability tensor alive between forward and backward:

    d logprob / dz = onehot(target) - p,     d entropy / dz = -p * (log p + entropy),

divided by the temperature for d/dlogits. It needs no communication. All math is float32
whatever the input dtype (bf16 logits are upcast one chunk at a time); the gradient comes
back in the input's dtype.

Entries of `-inf` (masked vocabulary) are fine: after the shift any `z - m < -1e4` has
`exp(z - m) == 0` exactly in float32, so clamping it to -1e4 changes nothing but keeps
`0 * -inf` NaNs out of the sums. The clamp pass only runs when a row holds such an entry
(found with the row max via `aminmax`, one host sync per call).

On CUDA (and under Triton's interpreter) the per-row sums and the backward come from the Triton
kernels of `vocab_kernels.py` instead, one read of each row; the shards' sums are combined with
the same two all-reduces (`combine_shards`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional, Union

import torch
import torch.distributed as dist

# exp(x) underflows to exactly 0 in float32 for x < -104, so clamping there is exact.
_CLAMP_LOW = -1.0e4


def vocab_range(partition_vocab: int, tp_rank: int) -> tuple[int, int]:
    """Global ids `[start, end)` of a rank's shard: Megatron's contiguous split
    (`VocabUtility.vocab_range_from_per_partition_vocab_size`; a test checks they agree).
    Written out so this module does not import Megatron (slow to import in spawned ranks)."""
    start = tp_rank * partition_vocab
    return start, start + partition_vocab


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton_kernels(logits: torch.Tensor) -> bool:
    """The Triton kernels for CUDA logits where Triton imports; under Triton's interpreter
    (`TRITON_INTERPRET=1`, a debugging mode) for CPU logits too."""
    if not _triton_importable():
        return False
    return logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def vocab_kernels():
    """The Triton kernels' module, imported only where they run (`use_triton_kernels`): Triton is
    not installed everywhere, and importing it takes seconds."""
    from hapo_megatron.parallel import vocab_kernels as kernels
    return kernels


def _vocab_start(partition_vocab: int, tp_group) -> int:
    if tp_group is None:
        return 0
    return vocab_range(partition_vocab, dist.get_rank(tp_group))[0]


def _shifted_chunk(out: torch.Tensor, logits_c: torch.Tensor, temp_c: Optional[torch.Tensor],
                   shift_c: torch.Tensor) -> torch.Tensor:
    """`logits_c / temp - shift` in float32, written into the reused buffer `out` `[n, V/tp]`.

    Writing into a preallocated buffer matters on CPU, where every fresh large tensor costs
    page faults; the input chunk is only read."""
    if out.data_ptr() != logits_c.data_ptr():  # in place when the chunk already is the buffer
        out.copy_(logits_c)
    if temp_c is not None:
        out.div_(temp_c.unsqueeze(-1))
    return out.sub_(shift_c.unsqueeze(-1))


def _chunk_sums(z: torch.Tensor, ebuf: torch.Tensor, local_t: torch.Tensor, in_range: torch.Tensor,
                clamp: bool, out: torch.Tensor) -> None:
    """Per-row sums of one shifted chunk `z` `[n, V/tp]` (float32, overwritten) into `out` `[n, 3]`:
    `S = sum exp(z)`, `A = sum exp(z) z` and the target's `z` (0 where the target is on another
    rank). `ebuf` is a reused `[n, V/tp]` float32 buffer."""
    zt = z.gather(1, local_t.unsqueeze(1)).squeeze(1)
    out[:, 2] = torch.where(in_range, zt, torch.zeros_like(zt))
    if clamp:
        z.clamp_(min=_CLAMP_LOW)
    ez = torch.exp(z, out=ebuf)
    out[:, 0] = ez.sum(dim=-1)
    out[:, 1] = z.mul_(ez).sum(dim=-1)  # sum exp(z) z (z is not needed after this)


def _finish(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(logprobs, entropy, log Z)` from the TP-summed `[N, 3]` sums of `_chunk_sums`."""
    log_z = torch.log(packed[:, 0])
    return packed[:, 2] - log_z, log_z - packed[:, 1] / packed[:, 0], log_z


def _chunk_grad(logp: torch.Tensor, p_out: torch.Tensor, g1: torch.Tensor, g2: Optional[torch.Tensor],
                entropy: torch.Tensor, local_t: torch.Tensor, g1_hit: torch.Tensor,
                clamp: bool) -> torch.Tensor:
    """d/dz of `g1 * logprob + g2 * entropy` for one chunk from its log-softmax `logp` (float32,
    overwritten); `p_out` receives the result (it may be `logp` itself when `g2` is None).

        d logprob / dz = onehot(target) - p,     d entropy / dz = -p * (log p + entropy)

    `g1_hit` is `g1` where the target lies on this rank, else 0 (all `[n]`)."""
    if clamp:
        logp.clamp_(min=_CLAMP_LOW)
    if g2 is None:  # -p * g1
        grad = torch.exp(logp, out=p_out).mul_(-g1.unsqueeze(-1))
    else:  # -p * (g1 + g2 * (log p + H))
        p = torch.exp(logp, out=p_out)
        grad = logp.add_(entropy.unsqueeze(-1)).mul_(g2.unsqueeze(-1))
        grad = p.mul_(grad.add_(g1.unsqueeze(-1))).neg_()
    return grad.scatter_add_(1, local_t.unsqueeze(-1), g1_hit.unsqueeze(-1))  # + g1 * onehot


def _row_factors(g1, g2, temperature, in_range, has_temperature):
    """Per-row upstream gradients with 1/T folded in (d/dlogits = d/dz / T) and `g1_hit`."""
    if has_temperature:
        g1 = g1 / temperature
        g2 = None if g2 is None else g2 / temperature
    return g1, g2, torch.where(in_range, g1, torch.zeros_like(g1))


def _local_targets(targets: torch.Tensor, vocab_start: int, partition_vocab: int):
    """Targets as indices into this rank's shard (0 where off-shard) and the on-shard mask."""
    local_t = targets - vocab_start
    in_range = (local_t >= 0) & (local_t < partition_vocab)
    return torch.where(in_range, local_t, torch.zeros_like(local_t)), in_range


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """logits `[N, V/tp]`, targets `[N]` (global ids), temperature `[N]` float32 or None."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, tp_group, chunk_size, entropy_grad):
        n, vp = logits.shape
        local_t, in_range = _local_targets(targets, _vocab_start(vp, tp_group), vp)
        kernels = use_triton_kernels(logits)
        if kernels:  # one-pass sums on the shard's own max, moved onto the global one and summed
            packed = torch.empty(n, 3, dtype=torch.float32, device=logits.device)
            m_shard = kernel_row_sums(logits, _inverse(temperature), local_t, in_range, packed)
            m = combine_shards(packed, m_shard, in_range, tp_group)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # an all -inf row: no nan shift
            clamp = False
        else:
            packed, m, clamp = _chunked_sums(logits, local_t, in_range, temperature, tp_group, chunk_size)
            if tp_group is not None and dist.get_world_size(tp_group) > 1:
                dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)

        logprobs, entropy, log_z = _finish(packed)

        ctx.tp_group, ctx.chunk_size, ctx.entropy_grad = tp_group, chunk_size, entropy_grad
        ctx.has_temperature, ctx.clamp, ctx.kernels = temperature is not None, clamp, kernels
        saved_t = temperature if temperature is not None else m.new_empty(0)
        # The softmax is recomputed in backward from logits - (m + log Z): keep just that shift.
        ctx.save_for_backward(logits, local_t, in_range, saved_t, m + log_z, entropy)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_t, in_range, temperature, shift, entropy = ctx.saved_tensors
        n, vp = logits.shape
        g1 = grad_logprobs if grad_logprobs is not None else torch.zeros_like(shift)
        g2 = grad_entropy if (ctx.entropy_grad and grad_entropy is not None) else None
        g1, g2, g1_hit = _row_factors(g1, g2, temperature, in_range, ctx.has_temperature)
        if ctx.kernels:
            f32 = [None if t is None else t.float().contiguous() for t in (g1, g2, g1_hit)]
            inv_t = _inverse(temperature) if ctx.has_temperature else None
            return (vocab_kernels().logits_grad(logits, inv_t, shift, f32[0], f32[1], entropy, local_t, f32[2]),
                    None, None, None, None, None)
        grad_input = torch.empty_like(logits)
        step = min(ctx.chunk_size or max(n, 1), max(n, 1))
        lbuf = torch.empty(step, vp, dtype=torch.float32, device=logits.device)
        # float32 input: the gradient is computed straight into grad_input (no second buffer)
        pbuf = None if logits.dtype == torch.float32 else torch.empty_like(lbuf)
        for s in range(0, n, step):
            e_ = min(s + step, n)
            t_c = temperature[s:e_] if ctx.has_temperature else None
            logp = _shifted_chunk(lbuf[: e_ - s], logits[s:e_], t_c, shift[s:e_])  # log softmax
            p_out = grad_input[s:e_] if pbuf is None else pbuf[: e_ - s]
            grad = _chunk_grad(logp, p_out, g1[s:e_], None if g2 is None else g2[s:e_], entropy[s:e_],
                               local_t[s:e_], g1_hit[s:e_], ctx.clamp)
            if pbuf is not None:
                grad_input[s:e_].copy_(grad)
        return grad_input, None, None, None, None, None


def _global_max(m: torch.Tensor, tp_group) -> torch.Tensor:
    """The row max over the TP shards (0 for a row that is -inf everywhere: no nan shift)."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _chunked_sums(logits, local_t, in_range, temperature, tp_group, chunk_size):
    """The torch path: `(packed [N, 3] before the TP sum, global max m, clamp)` chunk by chunk."""
    n, vp = logits.shape
    # Division by a positive temperature is monotone, so max(l / T) == max(l) / T exactly.
    if n > 0:  # amax/amin: no index output, much cheaper than max()/aminmax() on CPU
        lo, m = logits.amin(dim=-1).float(), logits.amax(dim=-1).float()
    else:
        lo = m = logits.new_zeros(0, dtype=torch.float32)
    if temperature is not None:
        lo, m = lo / temperature, m / temperature
    m = _global_max(m, tp_group)
    # Clamping costs a pass over the chunk: only needed when some shifted logit is -inf.
    clamp = bool(n > 0 and not torch.isfinite(lo - m).all())

    packed = torch.zeros(n, 3, dtype=torch.float32, device=logits.device)
    step = min(chunk_size or max(n, 1), max(n, 1))
    zbuf = torch.empty(step, vp, dtype=torch.float32, device=logits.device)
    ebuf = torch.empty_like(zbuf)
    for s in range(0, n, step):
        e_ = min(s + step, n)
        t_c = None if temperature is None else temperature[s:e_]
        z = _shifted_chunk(zbuf[: e_ - s], logits[s:e_], t_c, m[s:e_])
        _chunk_sums(z, ebuf[: e_ - s], local_t[s:e_], in_range[s:e_], clamp, packed[s:e_])
    return packed, m, clamp


def _inverse(temperature: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """1 / T per row for the kernels (None for temperature 1): one rounding, shared by every use."""
    return None if temperature is None or temperature.numel() == 0 else torch.reciprocal(temperature)


def kernel_row_sums(logits, inv_temp, local_t, in_range, out) -> torch.Tensor:
    """The Triton path's sums of `_chunk_sums` for `logits` `[N, w]` (a shard, or a slice of one):
    `out` `[N, 3]` gets `S`, `A` and the target's `z - m` relative to the rows' own max `m`
    (`vocab_kernels.row_stats`), which is returned (-inf for a row that is all -inf here, whose
    sums are 0 and whose target term is its -inf)."""
    stats = vocab_kernels().row_stats(logits, inv_temp)
    m = stats[:, 0]
    out[:, :2] = stats[:, 1:]
    z_t = logits.gather(1, local_t.unsqueeze(1)).squeeze(1).float()
    if inv_temp is not None:
        z_t = z_t * inv_temp
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    out[:, 2] = torch.where(in_range, z_t - shift, torch.zeros_like(z_t))
    return m


def rescale_sums(packed: torch.Tensor, d: torch.Tensor, has_target: torch.Tensor) -> None:
    """Sums `(S, A, z_t)` taken after subtracting `m` re-expressed after subtracting `m - d` (in
    place): `S e^d`, `e^d (A + d S)`, `z_t + d`. A row whose own max was -inf (`d` not finite) has
    no mass: its sums stay 0 and its target term (-inf) stays as it is."""
    finite = torch.isfinite(d)
    d0 = torch.where(finite, d, torch.zeros_like(d))
    scale = torch.where(finite, torch.exp(d0), torch.zeros_like(d0))
    packed[:, 1] = scale * (packed[:, 1] + d0 * packed[:, 0])
    packed[:, 0] *= scale
    packed[:, 2] = torch.where(has_target, packed[:, 2] + d0, torch.zeros_like(d0))


def combine_shards(packed: torch.Tensor, m_local: torch.Tensor, in_range: torch.Tensor, tp_group) -> torch.Tensor:
    """Move each TP rank's sums from its own row max onto the global one and SUM them (in place);
    returns the global row max (one MAX and one SUM all-reduce)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return m_local
    m = m_local.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    rescale_sums(packed, m_local - m, in_range)  # a shard of padding only gets weight exp(-1e4) == 0
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
    return m


def _prepare_temperature(temperature, shape, device) -> Optional[torch.Tensor]:
    """None for the scalar 1.0 (no division), else a positive float32 tensor `[N]`."""
    if isinstance(temperature, torch.Tensor):
        t = temperature.detach().to(device=device, dtype=torch.float32)
        if t.dim() == 0:
            t = t.expand(shape)
        elif tuple(t.shape) != tuple(shape):
            raise ValueError(f"temperature must be a float or a tensor of shape {tuple(shape)}, "
                             f"got shape {tuple(t.shape)}")
        if t.numel() and not bool((t > 0).all()):
            raise ValueError("temperature must be > 0 everywhere")
        return t.reshape(-1).contiguous()
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if temperature == 1.0:
        return None
    return torch.full((int(torch.Size(shape).numel()),), temperature, dtype=torch.float32, device=device)


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group=None,
    temperature: Union[float, torch.Tensor],
    chunk_size: Optional[int] = None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `targets` and entropy of `softmax(logits / temperature)` over a sharded vocab.

    Args:
        logits: `[..., V/tp]` this rank's vocab shard (any float dtype; never modified).
        targets: `[...]` int64 global token ids. A target outside `[0, V)` (e.g. -100 padding)
            gives a finite meaningless log-prob and no gradient through the target term: mask it.
        tp_group: tensor-parallel process group, or None for a single process / unsharded vocab.
        temperature: a positive float or a tensor broadcast-compatible as `[...]` (per token).
        chunk_size: rows (tokens) processed at once; None processes all rows together. Peak
            extra memory is about `2 * chunk_size * V/tp * 4` bytes in forward and backward.
        entropy_grad: also backpropagate through the entropy (entropy bonus). Otherwise the
            entropy output carries no gradient.

    Returns:
        `(logprobs, entropy)`, both float32 `[...]`; identical on every rank of `tp_group`.
    """
    if logits.dim() < 1:
        raise ValueError("logits must have a vocab dimension, got a scalar")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets must have shape {tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64 token ids, got {targets.dtype}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    lead = logits.shape[:-1]
    temp = _prepare_temperature(temperature, lead, logits.device)
    flat = logits.reshape(-1, logits.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    logprobs, entropy = _VocabParallelLogprobEntropy.apply(
        flat, targets.reshape(-1).long(), temp, tp_group, chunk_size, bool(entropy_grad))
    return logprobs.view(lead), entropy.view(lead)
