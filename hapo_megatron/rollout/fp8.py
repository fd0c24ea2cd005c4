"""Blockwise FP8 (E4M3) quantisation of weight matrices in SGLang's block-FP8 format (docs/fp8.md).

Format (SGLang 0.5.23 ``layers/quantization/fp8.py``, ``Fp8LinearMethod.create_fp8_weight_``
with ``weight_block_size``): a weight ``W [N, K]`` is stored as ``q [N, K]`` in
``torch.float8_e4m3fn`` and ``weight_scale_inv [ceil(N / 128), ceil(K / 128)]`` in float32, and
``W ~= q * scale`` blockwise: ``W[i, j] ~= q[i, j] * scale[i // 128, j // 128]`` (the name says
"inverse" because the scale is the one the kernels multiply back with). Each block's scale is
``amax(|block|) / 448`` (448 = the largest finite E4M3 value), so the block's largest entry maps
onto 448 exactly and nothing saturates. Blocks at the right / bottom edge of a matrix whose sides
are not multiples of 128 are partial blocks: their scale comes from the entries they do hold.

An all-zero block (and one whose ``amax / 448`` underflows float32) gets the scale 1.0: every
entry of it quantises to 0 and dequantises to exactly 0 with any finite positive scale, 1.0 is
exact in every scale format a server may convert to (float32, UE8M0 powers of two), and its
inverse is finite, so no kernel divides by 0 or multiplies by inf/NaN.

Torch's own ``float8_e4m3fn`` cast (round to nearest even) does the rounding: vectorised, on the
weights' device, no extra dependency. Why not nvidia-modelopt: docs/fp8.md, "Which quantizer".
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
#: largest finite float8_e4m3fn value (S.1111.110 = 1.75 * 2**8)
E4M3_MAX = 448.0
#: SGLang's (and DeepSeek-V3's) block shape: rows (output features) x columns (input features)
BLOCK = (128, 128)
#: scale given to blocks whose amax is 0 (see the module docstring)
ZERO_BLOCK_SCALE = 1.0


def scale_shape(shape: tuple[int, int], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    """``(ceil(N / bn), ceil(K / bk))``: the shape of ``weight_scale_inv`` for a ``[N, K]`` weight."""
    (n, k), (bn, bk) = shape, block
    return -(-int(n) // int(bn)), -(-int(k) // int(bk))


def _check_matrix(w: torch.Tensor, block: tuple[int, int]) -> None:
    if not torch.is_tensor(w) or w.dim() != 2:
        raise ValueError(f"blockwise FP8 quantises 2-D weight matrices, got "
                         f"{tuple(w.shape) if torch.is_tensor(w) else type(w).__name__}")
    if not w.is_floating_point():
        raise ValueError(f"blockwise FP8 quantises floating-point weights, got {w.dtype}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be two positive sizes, got {block}")


def quantize_blockwise(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, weight_scale_inv)`` of ``w [N, K]``: ``q`` float8_e4m3fn ``[N, K]``, the scales float32
    ``scale_shape(w.shape)``, both on ``w``'s device. Raises ValueError on non-finite weights
    (their block's scale would be inf/NaN: a bad export, never silently served)."""
    _check_matrix(w, block)
    (n, k), (bn, bk) = w.shape, block
    sn, sk = scale_shape((n, k), block)
    x = w.detach()
    if (sn * bn, sk * bk) != (n, k):  # partial edge blocks: zeros never raise an amax
        x = torch.nn.functional.pad(x, (0, sk * bk - k, 0, sn * bn - n))
    blocks = x.reshape(sn, bn, sk, bk)
    # |x| and max are exact in the weights' own dtype: no float32 copy needed for the amax
    amax = blocks.abs().amax(dim=(1, 3)).to(torch.float32)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"cannot quantise a weight [{n}, {k}] with inf/NaN entries to FP8")
    scale = amax / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.full_like(scale, ZERO_BLOCK_SCALE))
    # one float32 copy (never the caller's tensor), divided in place; x / scale <= 448 up to the
    # division's rounding: the clamp keeps a 448.00003 from becoming NaN
    q = blocks.to(torch.float32, copy=True).div_(scale[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    return q.to(FP8_DTYPE).view(sn * bn, sk * bk)[:n, :k].contiguous(), scale


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` blockwise (the inverse of :func:`quantize_blockwise` up to E4M3 rounding)."""
    if q.dim() != 2 or q.dtype != FP8_DTYPE:
        raise ValueError(f"q must be a 2-D {FP8_DTYPE} tensor, got {q.dtype} {tuple(q.shape)}")
    want = scale_shape(tuple(q.shape), block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv of a {tuple(q.shape)} weight must be {want} for blocks {tuple(block)}, "
                         f"got {tuple(scale_inv.shape)}")
    n, k = q.shape
    full = scale_inv.to(torch.float32).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return (q.to(torch.float32) * full).to(dtype)


__all__ = ["FP8_DTYPE", "E4M3_MAX", "BLOCK", "ZERO_BLOCK_SCALE", "scale_shape", "quantize_blockwise",
           "dequantize_blockwise"]
