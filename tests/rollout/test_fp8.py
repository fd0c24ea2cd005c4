"""The blockwise FP8 quantizer (hapo_megatron/rollout/fp8.py, docs/fp8.md) against hand-computed
values and a slow block-by-block reference.

E4M3 facts used for the hand-computed values: 3 mantissa bits, so the representable values in
[2^e, 2^(e+1)) are 2^e * (1 + m/8); the largest finite value is 1.75 * 2^8 = 448; subnormals are
multiples of 2^-9 below 2^-6; the cast rounds to nearest, ties to even."""

import math

import pytest
import torch

from hapo_megatron.rollout.fp8 import (BLOCK, E4M3_MAX, FP8_DTYPE, ZERO_BLOCK_SCALE, dequantize_blockwise,
                                       quantize_blockwise, scale_shape)


def slow_quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block, element by element: the obviously correct version of the format."""
    n, k = w.shape
    bn, bk = block
    sn, sk = math.ceil(n / bn), math.ceil(k / bk)
    scale = torch.empty(sn, sk)
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    for i in range(sn):
        for j in range(sk):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = float(blk.abs().max()) / 448.0
            s = torch.tensor(s, dtype=torch.float32)
            s = s if s > 0 else torch.tensor(1.0)
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / s).clamp(-448, 448).to(FP8_DTYPE)
    return q, scale


def test_one_block_hand_computed_and_exact_round_trip():
    """amax 7 -> scale 7/448 = 2^-6; q = 64 w, every value representable, so dequantising is exact."""
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.5, -7.0]])
    q, s = quantize_blockwise(w)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32
    assert s.shape == (1, 1) and s.item() == 2.0 ** -6
    assert q.float().tolist() == [[64.0, -128.0, 32.0], [0.0, 224.0, -448.0]]
    assert torch.equal(dequantize_blockwise(q, s), w)


def test_rounding_to_nearest_even_and_subnormals():
    """Scale 1 (amax 448): 1.0625 is half-way between 1 and 1.125 -> 1 (even); 1.09375 -> 1.125;
    2^-10 is half of the smallest subnormal 2^-9 -> 0; 3 * 2^-10 is half-way between 2^-9 and
    2^-8 -> 2^-8 (even); 300 lies between 288 and 320 -> 288 (nearer)."""
    w = torch.tensor([[448.0, 1.0625, 1.09375, 2.0 ** -10, 3 * 2.0 ** -10, 300.0]])
    q, s = quantize_blockwise(w)
    assert s.item() == 1.0
    assert q.float().tolist() == [[448.0, 1.0, 1.125, 0.0, 2.0 ** -8, 288.0]]


def test_block_max_maps_to_448_and_never_beyond():
    """Saturation: each block's largest |entry| becomes +-448 exactly, also when amax / 448 and
    the division round (the clamp); no entry is NaN or beyond 448."""
    torch.manual_seed(0)
    for amax in [7.0 * (1 + i * 2.0 ** -20) for i in range(50)] + [3.3e-3, 1e30, 0.1]:
        w = torch.rand(4, 5) * amax
        w[1, 2], w[3, 0] = amax, -amax
        q, s = quantize_blockwise(w)
        qf = q.float()
        assert not torch.isnan(qf).any()
        assert qf[1, 2] == 448.0 and qf[3, 0] == -448.0 and qf.abs().max() == 448.0


def test_partial_blocks_at_the_edges_hand_computed():
    """A 3 x 5 matrix in 2 x 2 blocks: scale grid 2 x 3; the last block row holds one row, the
    last block column one column, each scaled by its own amax."""
    w = torch.tensor([[1.0, 2.0, 0.0, 4.0, 8.0],
                      [-4.0, 0.5, 16.0, 0.0, 0.0],
                      [0.25, 0.0, 0.0, -32.0, 0.5]])
    q, s = quantize_blockwise(w, block=(2, 2))
    assert scale_shape((3, 5), (2, 2)) == (2, 3) and s.shape == (2, 3)
    amax = torch.tensor([[4.0, 16.0, 8.0], [0.25, 32.0, 0.5]])
    assert torch.equal(s, amax / 448)
    # each entry / its block's scale = 448 * entry / amax: powers of two times 448 or 224 ... all exact
    expected = torch.tensor([[112.0, 224.0, 0.0, 112.0, 448.0],
                             [-448.0, 56.0, 448.0, 0.0, 0.0],
                             [448.0, 0.0, 0.0, -448.0, 448.0]])
    assert torch.equal(q.float(), expected)
    assert torch.equal(dequantize_blockwise(q, s, block=(2, 2)), w)


def test_default_blocks_partial_edges_match_the_slow_version():
    """300 x 200 in 128 x 128 blocks: a 3 x 2 grid whose last row / column of blocks is partial;
    bit-identical to the block-by-block reference, in float32 and from bf16."""
    torch.manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(300, 200) * torch.logspace(-3, 3, 200)).to(dtype)
        q, s = quantize_blockwise(w)
        rq, rs = slow_quantize(w, BLOCK)
        assert s.shape == (3, 2) == scale_shape((300, 200))
        assert torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_all_zero_block_gets_scale_one_and_dequantises_to_zero():
    """A zero block, and one whose amax / 448 underflows float32 (the smallest subnormal), get
    ZERO_BLOCK_SCALE = 1.0 (never 0 / NaN); both dequantise to exact zeros."""
    w = torch.zeros(4, 4)
    w[0:2, 2:4] = torch.tensor([[1.0, -0.5], [0.25, 2.0]])
    w[2, 0] = 1e-45  # float32's smallest subnormal; / 448 underflows to 0
    q, s = quantize_blockwise(w, block=(2, 2))
    assert ZERO_BLOCK_SCALE == 1.0
    assert s.tolist() == [[1.0, torch.tensor(2.0 / 448, dtype=torch.float32).item()], [1.0, 1.0]]
    assert torch.isfinite(s).all() and (s > 0).all()
    d = dequantize_blockwise(q, s, block=(2, 2))
    assert torch.equal(d[0:2, 0:2], torch.zeros(2, 2)) and torch.equal(d[2:4], torch.zeros(2, 4))
    assert torch.equal(d[0:2, 2:4], w[0:2, 2:4])


def test_scale_layout_rows_are_output_features():
    """weight_scale_inv[i, j] belongs to rows 128 i.. (output features) and columns 128 j..
    (input features), SGLang's layout: only block (1, 0) of a 256 x 384 weight is non-zero."""
    w = torch.zeros(256, 384)
    w[128:256, 0:128] = 0.5
    w[200, 5] = -3.0
    q, s = quantize_blockwise(w)
    expected = torch.ones(2, 3)
    expected[1, 0] = 3.0 / 448
    assert torch.equal(s, expected)
    assert q.float()[200, 5] == -448.0


def test_rounding_error_within_half_an_e4m3_ulp():
    """|dequant(w) - w| <= max(2^-4 |w|, 2^-10 s): half a unit in the last place of a 3-bit
    mantissa (relative 2^-4) for normal E4M3 values, half the subnormal spacing 2^-9 (times the
    block's scale s) below 2^-6 -- the per-weight bound the logits test propagates."""
    torch.manual_seed(2)
    w = torch.randn(256, 256) * torch.logspace(-8, 2, 256)
    q, s = quantize_blockwise(w)
    d = dequantize_blockwise(q, s)
    s_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    bound = torch.maximum(w.abs() * 2.0 ** -4, s_full * 2.0 ** -10)
    assert ((d - w).abs() <= bound).all()


def test_on_the_weights_device_and_shapes():
    w = torch.randn(130, 260, dtype=torch.bfloat16)
    q, s = quantize_blockwise(w)
    assert q.shape == w.shape and q.device == w.device and s.device == w.device and q.is_contiguous()
    assert dequantize_blockwise(q, s, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("bad, match", [
    (torch.tensor([[1.0, float("nan")]]), "inf/NaN"),
    (torch.tensor([[float("inf"), 1.0]]), "inf/NaN"),
    (torch.ones(3), "2-D"),
    (torch.ones(2, 2, dtype=torch.int32), "floating-point"),
])
def test_bad_weights_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        quantize_blockwise(bad)


def test_dequantize_checks_the_scale_grid():
    q, s = quantize_blockwise(torch.randn(256, 130))
    with pytest.raises(ValueError, match=r"must be \(2, 2\)"):
        dequantize_blockwise(q, s[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_blockwise(q.float(), s)


_SGLANG_DEQUANT = """import sys, torch
from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
d = torch.load(sys.argv[1])
torch.save(block_quant_dequant(d["q"], d["s"], [128, 128], torch.float32), sys.argv[2])
"""


def test_matches_sglang_own_block_dequantisation(tmp_path):
    """SGLang's reference dequantiser (fp8_utils.block_quant_dequant, what its loaders apply to
    block-FP8 checkpoints) reads our pair as we mean it, partial edge blocks included. It runs in
    a subprocess with the CPU server's environment: importing SGLang needs the import-only
    stand-ins, which must never reach this process."""
    import importlib.util
    import subprocess
    import sys

    from hapo_megatron.rollout.sglang.launch import cpu_stubs_dir, server_env

    if importlib.util.find_spec("sglang") is None or cpu_stubs_dir() is None:
        pytest.skip("needs SGLang and tools/sglang_cpu_stubs")
    torch.manual_seed(3)
    q, s = quantize_blockwise(torch.randn(300, 200))
    torch.save({"q": q, "s": s}, tmp_path / "in.pt")
    run = subprocess.run([sys.executable, "-c", _SGLANG_DEQUANT, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                         env=server_env(cpu=True), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert torch.equal(torch.load(tmp_path / "out.pt"), dequantize_blockwise(q, s))
    assert E4M3_MAX == torch.finfo(FP8_DTYPE).max


def test_the_callers_weights_are_left_alone():
    """A float32 weight of whole blocks (no padded copy) is not divided in place (the quantiser
    works on its own copy; mutation: dividing `blocks.to(torch.float32)` in place)."""
    w = torch.randn(256, 128) * 10
    before = w.clone()
    quantize_blockwise(w)
    quantize_blockwise(w.t())  # a non-contiguous view
    assert torch.equal(w, before)
