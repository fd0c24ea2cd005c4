"""Clip-Cov / KL-Cov's ``cov/*`` metrics (`parallel.cov.global_cov_distribution`; docs/algorithm.md,
"Clip-Cov and KL-Cov"): a hand-computed case, a sort-based reference, and the same numbers, bit for
bit, from 2 ranks holding unequal parts (one of them with no valid token)."""

import math

import numpy as np
import torch

from hapo_megatron.parallel.cov import COV_QUANTILES, global_cov_distribution
from tests.distributed import run_distributed


def _reference(adv, lp, mask) -> dict:
    """Sort the valid tokens' (A - mean A)(lp - mean lp); nearest rank round(q (n - 1))."""
    a, l_ = adv[mask != 0].double().numpy(), lp[mask != 0].double().numpy()
    cov = (a - math.fsum(a) / len(a)) * (l_ - math.fsum(l_) / len(l_))
    srt = np.sort(cov)
    return {"cov/mean": math.fsum(cov) / len(cov),
            **{f"cov/{name}": float(srt[round(q * (len(cov) - 1))]) for name, q in COV_QUANTILES},
            "cov/max": float(srt[-1])}


def _data(seed=0, b=6, s=7):
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(b, 1, generator=g).expand(b, s).contiguous()
    lp = -torch.rand(b, s, generator=g) * 4
    mask = (torch.rand(b, s, generator=g) > 0.25).float()
    return adv, lp, mask


def test_hand_computed():
    # means 0 and -3: covariances 2*2, 0*1, -2*-3 = 4, 0, 6 (the fourth token is masked out)
    adv, lp = torch.tensor([2.0, 0.0, -2.0, 9.0]), torch.tensor([-1.0, -2.0, -6.0, 0.0])
    got = global_cov_distribution(adv, lp, torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert got == {"cov/mean": 10 / 3, "cov/p1": 0.0, "cov/p10": 0.0, "cov/p50": 4.0, "cov/p90": 6.0,
                   "cov/p99": 6.0, "cov/max": 6.0}
    assert global_cov_distribution(adv, lp, torch.zeros(4)) == {}


def test_matches_the_sorted_reference():
    for seed in range(5):
        adv, lp, mask = _data(seed)
        got, want = global_cov_distribution(adv, lp, mask), _reference(adv, lp, mask)
        assert got.keys() == want.keys()
        for k in want:  # the quantiles are elements (exact); the mean is a correctly rounded sum
            assert got[k] == want[k] if k != "cov/mean" else math.isclose(got[k], want[k], rel_tol=1e-12), k


def _worker(rank, world_size):
    import torch.distributed as dist
    adv, lp, mask = _data(3)
    rows = {0: slice(0, 2), 1: slice(2, 6)}[rank]  # unequal parts
    split = global_cov_distribution(adv[rows], lp[rows], mask[rows], group=dist.group.WORLD)
    empty = torch.zeros_like(mask[rows]) if rank == 0 else mask[rows]  # rank 0: no valid token
    lopsided = global_cov_distribution(adv[rows], lp[rows], empty, group=dist.group.WORLD)
    return split, lopsided


def test_two_unequal_ranks_give_the_single_process_numbers():
    adv, lp, mask = _data(3)
    (s0, l0), (s1, l1) = run_distributed(_worker, 2, timeout=120)
    assert s0 == s1 == global_cov_distribution(adv, lp, mask)
    only = mask.clone()
    only[:2] = 0
    assert l0 == l1 == global_cov_distribution(adv, lp, only)
