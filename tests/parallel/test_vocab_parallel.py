"""Fused vocab-parallel log-prob + entropy vs an independent float64 reference (TP 1, 2, 4)."""

import itertools
import math

import pytest
import torch

from hapo_megatron.parallel.vocab_parallel import vocab_parallel_logprobs_entropy
from tests.distributed import run_distributed

V = 48  # divisible by 1, 2, 4
N = 23  # rows (tokens): chunk_size 5 leaves a ragged last chunk


def _reference(logits, targets, temperature, g_lp, g_ent, entropy_grad):
    """Obviously-correct float64 version, a loop over rows: values and d/dlogits."""
    x = logits.double().detach().requires_grad_(True)
    lps, ents, scales = [], [], []
    for i in range(x.shape[0]):
        t = temperature if not torch.is_tensor(temperature) else temperature[i].double()
        z = x[i] / t
        zmax = z.max()
        logz = zmax + torch.log(torch.exp(z - zmax).sum())
        logp = z - logz
        p = torch.exp(logp)
        lps.append(logp[targets[i]])
        ents.append(-(p[p > 0] * logp[p > 0]).sum())
        scales.append(z[torch.isfinite(z)].abs().max().item())
    lp, ent = torch.stack(lps), torch.stack(ents)
    obj = (lp * g_lp.double()).sum()
    if entropy_grad:
        obj = obj + (ent * g_ent.double()).sum()
    obj.backward()
    # float32 rounding of logits / temperature is relative to the row's largest |z|
    return lp.detach(), ent.detach(), x.grad, 1.0 + torch.tensor(scales, dtype=torch.float64)


def _case_data(seed, dtype, temp_kind):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g) * 4
    if seed % 3:  # masked entries (the clamp path); every third case has none
        logits[0, :40] = float("-inf")  # mostly masked row
        logits[3, 5] = float("-inf")
    logits[7] += 1000.0  # huge logits
    logits = logits.to(dtype)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[0] = 44  # a finite entry of the masked row
    if temp_kind == "scalar1":
        temp = 1.0
    elif temp_kind == "scalar":
        temp = 0.7
    else:
        temp = torch.rand(N, generator=g) + 0.4
    g_lp = torch.randn(N, generator=g)
    g_ent = torch.randn(N, generator=g)
    return logits, targets, temp, g_lp, g_ent


CASES = list(itertools.product([torch.float32, torch.bfloat16], ["scalar1", "scalar", "token"],
                               [None, 5], [False, True]))


def _run_cases(tp_group, tp_rank, tp_size, device="cpu", chunks=(None, 5)):
    """Every case (of these chunk sizes) on this rank's shard (on ``device``); returns the worst
    errors per dtype (rank-local)."""
    shard = V // tp_size
    errs = {}
    for ci, (dtype, temp_kind, chunk, eg) in enumerate(CASES):
        if chunk not in chunks:
            continue
        logits, targets, temp, g_lp, g_ent = _case_data(ci, dtype, temp_kind)
        ref_lp, ref_ent, ref_grad, row_scale = _reference(logits, targets, temp, g_lp, g_ent, eg)
        local = logits[:, tp_rank * shard:(tp_rank + 1) * shard].clone().to(device).requires_grad_(True)
        before = local.detach().clone()
        temp = temp.to(device) if torch.is_tensor(temp) else temp
        lp, ent = vocab_parallel_logprobs_entropy(local, targets.to(device), tp_group=tp_group,
                                                  temperature=temp, chunk_size=chunk, entropy_grad=eg)
        lp, ent = lp.cpu(), ent.cpu()
        assert lp.dtype == torch.float32 and ent.dtype == torch.float32
        assert ent.requires_grad == eg
        obj = (lp * g_lp).sum() + ((ent * g_ent).sum() if eg else 0.0)
        obj.backward()
        assert torch.equal(local.detach(), before), "input modified"
        assert local.grad.dtype == dtype
        grad = local.grad.cpu()
        ref_g = ref_grad[:, tp_rank * shard:(tp_rank + 1) * shard]
        e = errs.setdefault(str(dtype), [0.0, 0.0, 0.0])
        e[0] = max(e[0], ((lp.double() - ref_lp).abs() / row_scale).max().item())
        e[1] = max(e[1], ((ent.double() - ref_ent).abs() / row_scale).max().item())
        # bf16 gradients are rounded to bf16: measure in units of the rounding
        scale = ref_g.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 0.0) + 1e-6 * row_scale[:, None]
        e[2] = max(e[2], ((grad.double() - ref_g).abs() / scale).max().item())
    return errs


def _check(errs, bf16_grad_units=1.0):
    """``bf16_grad_units``: the bf16 gradients' bound in units of 2^-8 relative (1: rounded to
    nearest; 2: truncated, as Triton's interpreter casts)."""
    for dtype, (e_lp, e_ent, e_grad) in errs.items():
        assert e_lp < 1e-6, (dtype, e_lp)  # relative to the row's largest |logit / T|
        assert e_ent < 1e-6, (dtype, e_ent)
        bound = bf16_grad_units if dtype == str(torch.bfloat16) else 1.0
        assert e_grad <= bound, (dtype, e_grad)  # 1e-6 * row scale (+ the bf16 rounding for bf16)


def test_single_process_all_cases():
    _check(_run_cases(None, 0, 1))


def _tp_worker(rank, world_size):
    import torch.distributed as dist

    torch.manual_seed(0)
    errs = _run_cases(dist.group.WORLD, rank, world_size)
    # a rank may hold zero rows: collectives still line up
    empty = torch.zeros(0, V // world_size, requires_grad=True)
    lp, ent = vocab_parallel_logprobs_entropy(empty, torch.zeros(0, dtype=torch.long),
                                              tp_group=dist.group.WORLD, temperature=1.0)
    lp.sum().backward()
    assert lp.shape == (0,) and empty.grad.shape == empty.shape
    return errs


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_reference(tp):
    for errs in run_distributed(_tp_worker, tp, timeout=240):
        _check(errs)


def test_hand_computed_uniform_and_onehot():
    lp, ent = vocab_parallel_logprobs_entropy(torch.zeros(2, 8), torch.tensor([0, 5]), temperature=1.0)
    assert torch.allclose(lp, torch.full((2,), -math.log(8.0)))
    assert torch.allclose(ent, torch.full((2,), math.log(8.0)))
    x = torch.full((1, 4), float("-inf"))
    x[0, 2] = 3.0  # one-hot distribution
    lp, ent = vocab_parallel_logprobs_entropy(x, torch.tensor([2]), temperature=1.0)
    assert lp.item() == 0.0 and ent.item() == 0.0
    # temperature 2 on logits [0, ln 4] -> probs [1/3, 2/3]
    x = torch.tensor([[0.0, math.log(4.0)]])
    lp, ent = vocab_parallel_logprobs_entropy(x, torch.tensor([1]), temperature=2.0)
    assert abs(lp.item() - math.log(2 / 3)) < 1e-6
    assert abs(ent.item() - (-(1 / 3) * math.log(1 / 3) - (2 / 3) * math.log(2 / 3))) < 1e-6


def test_leading_shape_and_bad_input():
    x = torch.randn(2, 3, 10, requires_grad=True)
    t = torch.randint(0, 10, (2, 3))
    lp, ent = vocab_parallel_logprobs_entropy(x, t, temperature=torch.full((2, 3), 0.9), chunk_size=2)
    assert lp.shape == (2, 3) and ent.shape == (2, 3)
    lp.sum().backward()
    assert x.grad.shape == x.shape
    with pytest.raises(ValueError, match="targets"):
        vocab_parallel_logprobs_entropy(x, t[:, :2], temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs_entropy(x, t, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs_entropy(x, t, temperature=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_logprobs_entropy(x, t, chunk_size=0, temperature=1.0)


def test_non_contiguous_input_and_padding_targets():
    base = torch.randn(10, 6)
    x = base.t()  # [6, 10] non-contiguous
    t = torch.tensor([0, 3, -100, 9, 2, 1])
    lp, ent = vocab_parallel_logprobs_entropy(x, t, temperature=1.0)
    ref = torch.log_softmax(x.double(), -1)
    ok = t >= 0
    assert torch.allclose(lp[ok].double(), ref[ok].gather(-1, t[ok, None]).squeeze(-1), atol=1e-6)
    assert torch.isfinite(lp).all()


def test_vocab_range_matches_megatron():
    from megatron.core.tensor_parallel.utils import VocabUtility

    from hapo_megatron.parallel.vocab_parallel import vocab_range

    for world in (1, 2, 4, 8):
        for rank in range(world):
            assert vocab_range(1000, rank) == tuple(
                VocabUtility.vocab_range_from_per_partition_vocab_size(1000, rank, world))
