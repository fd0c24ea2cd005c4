"""Triton kernels of the fused log-prob + entropy (`vocab_parallel.py`) for CUDA logits.

The torch path of `vocab_parallel.py` makes about seven float32 passes over each chunk of
logits (upcast, shift, exp, two sums, ...), each a kernel launch; on a GPU that is memory
traffic several times the logits' own and, at the chunk sizes that bound its buffers, launch
overhead (tools/bench/README.md, "GPU"). Here one program per row reads the row once:

- `row_stats`: the forward's per-row sums in one pass with an online max (as in online
  softmax): `m` = the row's max of `z = logits / T`, `S = sum exp(z - m)`,
  `A = sum exp(z - m) (z - m)`. When a block raises the max from `m` to `m'`, the sums so far
  are rescaled: `S <- S e^(m - m')`, `A <- e^(m - m') (A + S (m - m'))`.
- `logits_grad`: the backward, one read of the row and one write of its gradient.

Both run on a tensor-parallel rank's shard alone (or one vocab slice of it: the fused output
layer of `linear.py` calls them on each slice's logits); `vocab_parallel.py` combines the
shards' sums with the same two all-reduces as its torch path (`combine_shards`). Entries of
`-inf` (masked vocabulary) add nothing: their `exp` is 0 and their `0 * -inf` is masked, as the torch path's clamp does.
Under Triton's interpreter (`TRITON_INTERPRET=1`) the kernels run on CPU tensors: the CPU
tests check them that way (tests/parallel/test_vocab_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# 4096 columns per block: a bf16 row of 76k-152k logits is 19-38 blocks; 8 warps keep a
# block's loads in flight.
BLOCK_V = 4096
NUM_WARPS = 8
_LOGP_LOW = tl.constexpr(-1.0e4)  # exp underflows to exactly 0 in float32 far above this (as in vocab_parallel.py)


@triton.jit
def _row_stats_kernel(logits_ptr, row_stride, inv_temp_ptr, out_ptr, V,
                      HAS_TEMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    inv_t = 1.0
    if HAS_TEMP:
        inv_t = tl.load(inv_temp_ptr + row)
    neg_inf = float("-inf")
    m = tl.full((), neg_inf, tl.float32)
    s = tl.zeros((), tl.float32)
    a = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=neg_inf).to(tl.float32) * inv_t
        new_m = tl.maximum(m, tl.max(z, 0))
        safe_m = tl.where(new_m == neg_inf, 0.0, new_m)  # a row all -inf so far: shift by 0
        delta = tl.where(m == neg_inf, 0.0, m - safe_m)  # s == a == 0 while m is -inf
        scale = tl.exp(delta)
        zs = z - safe_m
        e = tl.exp(zs)
        a = scale * (a + s * delta) + tl.sum(tl.where(z == neg_inf, 0.0, e * zs), 0)
        s = s * scale + tl.sum(e, 0)
        m = new_m
    tl.store(out_ptr + row * 3, m)
    tl.store(out_ptr + row * 3 + 1, s)
    tl.store(out_ptr + row * 3 + 2, a)


@triton.jit
def _logits_grad_kernel(logits_ptr, row_stride, grad_ptr, grad_stride, inv_temp_ptr, shift_ptr, g1_ptr, g2_ptr,
                        entropy_ptr, target_ptr, g1_hit_ptr, V,
                        HAS_TEMP: tl.constexpr, HAS_G2: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    out = grad_ptr + row * grad_stride
    inv_t = 1.0
    if HAS_TEMP:
        inv_t = tl.load(inv_temp_ptr + row)
    shift = tl.load(shift_ptr + row)
    g1 = tl.load(g1_ptr + row)
    target = tl.load(target_ptr + row)
    g1_hit = tl.load(g1_hit_ptr + row)
    if HAS_G2:
        g2 = tl.load(g2_ptr + row)
        h = tl.load(entropy_ptr + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32) * inv_t
        logp = tl.maximum(z - shift, _LOGP_LOW)  # -inf entries: p = 0 and p * (log p + H) = 0
        p = tl.exp(logp)
        if HAS_G2:
            grad = -p * (g1 + g2 * (logp + h))
        else:
            grad = -p * g1
        grad = tl.where(cols == target, grad + g1_hit, grad)
        tl.store(out + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < V)


def row_stats(logits: torch.Tensor, inv_temp: torch.Tensor | None) -> torch.Tensor:
    """`[N, 3]` float32 per row of `logits` `[N, V]` (rows contiguous): (max of z, sum exp(z - max),
    sum exp(z - max)(z - max)) for `z = logits * inv_temp`; the max is -inf (and the sums 0) for a
    row that is all -inf. `inv_temp`: `[N]` float32 (1 / temperature, computed once by the caller
    so that every path scales by the same numbers) or None for temperature 1."""
    n, v = logits.shape
    out = torch.empty(n, 3, dtype=torch.float32, device=logits.device)
    if n:
        _row_stats_kernel[(n,)](logits, logits.stride(0), inv_temp if inv_temp is not None else out, out, v,
                                HAS_TEMP=inv_temp is not None, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return out


def logits_grad(logits: torch.Tensor, inv_temp: torch.Tensor | None, shift: torch.Tensor,
                g1: torch.Tensor, g2: torch.Tensor | None, entropy: torch.Tensor,
                local_t: torch.Tensor, g1_hit: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """d/dlogits of `g1 * logprob + g2 * entropy` (g1, g2 per row with 1/T folded in, `g1_hit` = g1
    where the target is on this shard, else 0; all `[N]` float32), in the logits' dtype, written
    into ``out`` (a reused `[N, V]` buffer of that dtype) or a new tensor; `shift` = max + log Z of z."""
    n, v = logits.shape
    grad = torch.empty_like(logits) if out is None else out
    if n:
        _logits_grad_kernel[(n,)](logits, logits.stride(0), grad, grad.stride(0),
                                  inv_temp if inv_temp is not None else shift, shift, g1,
                                  g2 if g2 is not None else g1, entropy, local_t, g1_hit, v,
                                  HAS_TEMP=inv_temp is not None, HAS_G2=g2 is not None,
                                  BLOCK=BLOCK_V, num_warps=NUM_WARPS)
    return grad


__all__ = ["BLOCK_V", "logits_grad", "row_stats"]
