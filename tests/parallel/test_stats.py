"""Exact global entropy statistics over DP x CP splits vs the single-process statistics."""

import math
import warnings

import pytest
import torch

from hapo_megatron.algo import EntropyStats, compute_entropy_stats, stats_from_reductions
from hapo_megatron.parallel.context_parallel import split_for_cp
from hapo_megatron.parallel.stats import exact_global_sum, global_entropy_stats, global_token_count
from tests.distributed import run_distributed
from hapo_megatron.algo.loss_config import PolicyLossConfig

NUM_DRAWS = 24
B, T = 6, 16  # T divisible by 2 * cp for cp <= 2


def _draw(seed):
    """(entropy [B, T], mask [B, T], q): ties, duplicates at the quantile, near-equal floats."""
    g = torch.Generator().manual_seed(seed)
    kind = seed % 5
    if kind == 0:
        ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    elif kind == 1:  # few distinct values, including 0 and values under the 1e-8 floor
        vals = torch.tensor([0.0, 1e-9, 1e-8, 0.5, 1.0, 2.0], dtype=torch.float64)
        ent = vals[torch.randint(0, len(vals), (B, T), generator=g)]
    elif kind == 2:  # almost all equal: the quantile sits in a block of duplicates
        ent = torch.full((B, T), 0.7, dtype=torch.float64)
        ent[torch.rand(B, T, generator=g) < 0.1] = 1.3
    elif kind == 3:  # neighbours one ulp apart: the selection must resolve the last key bits
        base = torch.full((B, T), 1.25, dtype=torch.float64)
        steps = torch.randint(0, 6, (B, T), generator=g)
        ent = base
        for _ in range(5):
            ent = torch.where(steps > 0, torch.nextafter(ent, torch.tensor(9.0, dtype=torch.float64)), ent)
            steps = steps - 1
    else:  # float32 entropies, as the model produces them
        ent = (torch.rand(B, T, generator=g) * 5).float()
    mask = torch.rand(B, T, generator=g) < torch.rand(B, 1, generator=g)  # uneven lengths
    q = [0.8, 0.5, 0.2, 0.95, 0.8][seed % 5]
    return ent, mask, q


def _fsum_reference(ent, mask, q):
    """The single-process formula with a correctly rounded sum of squares (math.fsum)."""
    ref = compute_entropy_stats(ent, mask, entropy_pivot=q)
    x = torch.log(ent.double().clamp_min(1e-8))[mask]
    d = x - ref.pivot
    return stats_from_reductions(ref.pivot, math.fsum((d * d).tolist()), x.numel(),
                                 d.max().item(), d.min().item())


def _shard(ent, mask, dp, cp, dp_rank, cp_rank, empty_rank):
    """This rank's tokens: an uneven split of the rows over DP, then Megatron's CP layout."""
    bounds = [0, 1, B] if dp == 2 else [0, B]  # dp rank 0 gets 1 row, rank 1 the rest
    rows = slice(bounds[dp_rank], bounds[dp_rank + 1])
    e, m = split_for_cp(ent[rows], cp, cp_rank), split_for_cp(mask[rows], cp, cp_rank)
    if empty_rank == (dp_rank, cp_rank):
        m = torch.zeros_like(m)
    return e, m


def _layout_mask(mask, dp, cp, empty_rank):
    """The global mask with the empty rank's tokens removed, for the reference."""
    mask = mask.clone()
    if empty_rank is None:
        return mask
    bounds = [0, 1, B] if dp == 2 else [0, B]
    d, c = empty_rank
    from hapo_megatron.parallel.context_parallel import cp_chunk_indices

    cols = cp_chunk_indices(T, cp, c)
    mask[bounds[d]:bounds[d + 1], cols] = False
    return mask


def _empty_rank_for(seed, dp, cp):
    if seed % 3 == 0:
        return None
    return (seed % dp, (seed // 2) % cp)


def _stats_worker(rank, world_size):
    import torch.distributed as dist

    pair = dist.new_group([0, 1]), dist.new_group([2, 3])
    half = pair[rank // 2]
    out = {"2x1": [], "1x2": [], "2x2": []}
    for seed in range(NUM_DRAWS):
        ent, mask, q = _draw(seed)
        for name, (dp, cp, group, r) in {"2x1": (2, 1, half, rank % 2), "1x2": (1, 2, half, rank % 2),
                                         "2x2": (2, 2, dist.group.WORLD, rank)}.items():
            dp_rank, cp_rank = r // cp, r % cp
            e, m = _shard(ent, mask, dp, cp, dp_rank, cp_rank, _empty_rank_for(seed, dp, cp))
            out[name].append(global_entropy_stats(e, m, group=group, entropy_pivot=q).as_tuple())

    # collective count: exactly 6 all-reduces, nothing else
    calls = []
    orig = dist.all_reduce

    def counting(t, *a, **k):
        calls.append(t.numel())
        return orig(t, *a, **k)

    dist.all_reduce = counting
    try:
        ent, mask, _ = _draw(0)
        global_entropy_stats(ent[rank:rank + 1], mask[rank:rank + 1], group=dist.group.WORLD,
            entropy_pivot=PolicyLossConfig().entropy_pivot)
    finally:
        dist.all_reduce = orig
    out["num_collectives"] = len(calls)

    # no valid token anywhere: neutral on every rank, with a warning
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = global_entropy_stats(torch.rand(3), torch.zeros(3, dtype=torch.bool), group=dist.group.WORLD,
            entropy_pivot=PolicyLossConfig().entropy_pivot)
    out["neutral"] = (s.is_neutral, any("no valid token" in str(x.message) for x in w))
    out["count"] = global_token_count(torch.ones(rank + 1, 2), group=dist.group.WORLD)
    out["exact_sum"] = exact_global_sum(torch.tensor([1e16, 1.0, -1e16, 3.0][rank:rank + 1],
                                                     dtype=torch.float64), group=dist.group.WORLD)
    return out


def _assert_matches(got, ent, mask, q, where):
    ref = compute_entropy_stats(ent, mask, entropy_pivot=q)
    exact = _fsum_reference(ent, mask, q) if mask.any() else ref
    # bit-exact with a correctly rounded sum: before the exact sums only elementwise ops run (log,
    # subtract), the same function of each value on every rank, so no reduction order enters and
    # this holds on every CPU kind
    assert got == exact.as_tuple(), (where, got, exact)
    assert got == ref.as_tuple(), (where, got, ref)  # and with the single-process stats, all 4 numbers


def test_single_process_matches_compute_entropy_stats():
    for seed in range(4 * NUM_DRAWS):
        ent, mask, q = _draw(seed)
        got = global_entropy_stats(ent, mask, entropy_pivot=q)
        if not mask.any():
            assert got.is_neutral
            continue
        _assert_matches(got.as_tuple(), ent, mask, q, seed)


def test_dp_cp_splits_match_single_process():
    results = run_distributed(_stats_worker, 4, timeout=300)
    layouts = {"2x1": (2, 1), "1x2": (1, 2), "2x2": (2, 2)}
    for name, (dp, cp) in layouts.items():
        for seed in range(NUM_DRAWS):
            ent, mask, q = _draw(seed)
            m = _layout_mask(mask, dp, cp, _empty_rank_for(seed, dp, cp))
            for rank, res in enumerate(results):
                _assert_matches(res[name][seed], ent, m, q, (name, seed, rank))
    for res in results:
        assert res["num_collectives"] == 6
        assert res["neutral"] == (True, True)
        assert res["count"] == 2 * (1 + 2 + 3 + 4)
        assert res["exact_sum"] == 4.0  # a naive float64 sum in rank order gives 3.0 or 4.0


def test_neutral_and_bad_input():
    with pytest.warns(UserWarning, match="no valid token"):
        assert global_entropy_stats(torch.rand(4), torch.zeros(4),
            entropy_pivot=PolicyLossConfig().entropy_pivot).is_neutral
    with pytest.raises(ValueError, match="mask"):
        global_entropy_stats(torch.rand(4), torch.ones(3), entropy_pivot=PolicyLossConfig().entropy_pivot)
    with pytest.raises(ValueError, match="entropy_pivot"):
        global_entropy_stats(torch.rand(4), torch.ones(4), entropy_pivot=1.0)
    with pytest.raises(ValueError, match="non-finite"):
        global_entropy_stats(torch.tensor([1.0, float("nan")]), torch.ones(2),
            entropy_pivot=PolicyLossConfig().entropy_pivot)


def test_hand_computed():
    # entropies e^-1, e^0, e^1, e^2, e^3 -> x = -1..3; q=0.5 -> k = 2 -> pivot 1
    ent = torch.exp(torch.arange(-1.0, 4.0, dtype=torch.float64))
    s = global_entropy_stats(ent, torch.ones(5), entropy_pivot=0.5)
    assert s.pivot == 1.0
    assert s.std == math.sqrt((4 + 1 + 0 + 1 + 4) / 5)
    assert s.pos_max == 2 / s.std and s.neg_min == -2 / s.std
    assert EntropyStats.from_dict(s.to_dict()) == s
