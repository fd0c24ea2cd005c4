import functools
import math
import random

import pytest
import torch

from hapo_megatron.algo import (
    filter_groups,
    grpo_advantages,
    overlong_penalty,
    token_level_group_advantages,
)
from tests.algo import loops


def _random_batch(seed):
    rng = random.Random(seed)
    n_groups = rng.randint(1, 5)
    sizes = [rng.randint(1, 5) for _ in range(n_groups)]
    group_ids = []
    for g, n in enumerate(sizes):
        group_ids += [f"uid-{g}"] * n
    rng.shuffle(group_ids)
    b = len(group_ids)
    t = rng.randint(1, 9)
    lengths = [rng.randint(0, t) for _ in range(b)]
    if seed % 3 == 0:
        rewards = [rng.choice([-1.0, 1.0]) for _ in range(b)]
    else:
        rewards = [rng.gauss(0, 2) for _ in range(b)]
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, L in enumerate(lengths):
        mask[i, :L] = True
    return rewards, group_ids, lengths, mask


def _expand(per_resp, lengths, t):
    return torch.tensor([[per_resp[i] if j < L else 0.0 for j in range(t)] for i, L in enumerate(lengths)],
                        dtype=torch.float64)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_loop(seed, norm):
    rewards, gids, lengths, mask = _random_batch(seed)
    got = grpo_advantages(torch.tensor(rewards), gids, mask, norm_adv_by_std=norm)
    assert got.dtype == torch.float32 and got.shape == mask.shape
    want = _expand(loops.grpo(rewards, gids, lengths, norm), lengths, mask.shape[1])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("norm", [True, False])
def test_tlga_matches_loop(seed, norm):
    rewards, gids, lengths, mask = _random_batch(seed)
    thr = [5.0, 1.2, None][seed % 3]
    got, fb = token_level_group_advantages(torch.tensor(rewards), gids, mask, norm_adv_by_std=norm,
                                           fallback_threshold=thr, return_fallback=True)
    adv, fbw = loops.tlga(rewards, gids, lengths, norm, thr=thr)
    torch.testing.assert_close(got.double(), _expand(adv, lengths, mask.shape[1]), rtol=1e-5, atol=1e-5)
    # flags: the loop leaves groups without valid tokens unflagged, and so do we
    assert fb.tolist() == fbw


def test_group_ids_as_int_tensor_and_float_mask():
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    a = token_level_group_advantages(rewards, torch.tensor([7, 7, 3, 3, 3]), mask,
        norm_adv_by_std=True, fallback_threshold=5.0)
    b = token_level_group_advantages(rewards, ["a", "a", "b", "b", "b"], mask,
        norm_adv_by_std=True, fallback_threshold=5.0)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(grpo_advantages(rewards, torch.tensor([7, 7, 3, 3, 3]), mask, norm_adv_by_std=True),
                               grpo_advantages(rewards, [(0, 1), (0, 1), 2, 2, 2], mask, norm_adv_by_std=True))


def test_tlga_hand_case():
    # group: r = [1, -1], lengths [3, 1] -> mu = (3 - 1)/4 = 0.5, sigma = sqrt((3*0.25 + 2.25)/4) = sqrt(0.75)
    rewards = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = token_level_group_advantages(rewards, [0, 0], mask, norm_adv_by_std=True, fallback_threshold=5.0)
    s = math.sqrt(0.75)
    assert adv[0].tolist() == pytest.approx([0.5 / (s + 1e-6)] * 3, rel=1e-6)
    assert adv[1].tolist() == pytest.approx([-1.5 / (s + 1e-6), 0, 0], rel=1e-6)
    # GRPO on the same: mean 0, unbiased std sqrt(2) -> +-1/sqrt(2)
    g = grpo_advantages(rewards, [0, 0], mask, norm_adv_by_std=True)
    assert g[0, 0].item() == pytest.approx(1 / (math.sqrt(2) + 1e-6), rel=1e-6)
    # Dr.GRPO
    assert grpo_advantages(rewards, [0, 0], mask, norm_adv_by_std=False)[1, 0].item() == pytest.approx(-1.0)


def test_tlga_fallback_hand_case():
    # one long correct response among many short wrong ones: z of the short ones is small, but the
    # group has a tiny sigma when lengths are very unequal -> check the fallback path explicitly
    rewards = torch.tensor([1.0] + [-1.0] * 3)
    mask = torch.zeros(4, 100, dtype=torch.bool)
    mask[0, :100] = True
    mask[1:, :1] = True
    adv, fb = token_level_group_advantages(rewards, [0] * 4, mask, return_fallback=True,
        norm_adv_by_std=True, fallback_threshold=5.0)
    # mu = (100 - 3)/103, sigma small-ish -> |A| of the short ones = 1.94/0.33 ~ 5.8 >= 5 -> GRPO
    assert fb.tolist() == [True] * 4
    torch.testing.assert_close(adv, grpo_advantages(rewards, [0] * 4, mask, norm_adv_by_std=True))
    adv2, fb2 = token_level_group_advantages(rewards, [0] * 4, mask, fallback_threshold=10.0, return_fallback=True,
        norm_adv_by_std=True)
    assert fb2.tolist() == [False] * 4 and adv2[1, 0].item() < -5


def test_fallback_ignores_padding_only_responses():
    # a zero-length response whose (would-be) |A| is huge must not trigger the fallback
    rewards = torch.tensor([1.0, 1.0, 1.0, 100.0])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0], [0, 0]])
    adv, fb = token_level_group_advantages(rewards, [0, 0, 0, 0], mask, return_fallback=True,
        norm_adv_by_std=True, fallback_threshold=5.0)
    assert fb.tolist() == [False] * 4
    assert torch.all(adv == 0)


def test_edge_cases():
    # single-response groups: A = r (GRPO) and TLGA gives 0 (mu = r, sigma = 0)
    rewards = torch.tensor([0.7, -2.0])
    mask = torch.ones(2, 3)
    assert grpo_advantages(rewards, [0, 1], mask, norm_adv_by_std=True)[:, 0].tolist() == pytest.approx([0.7, -2.0])
    assert torch.all(token_level_group_advantages(rewards, [0, 1], mask,
        norm_adv_by_std=True, fallback_threshold=5.0) == 0)
    # all-equal rewards: zero advantages, no NaN
    eq = torch.full((4,), 0.1)
    for fn in (functools.partial(grpo_advantages, norm_adv_by_std=True),
               functools.partial(token_level_group_advantages, norm_adv_by_std=True, fallback_threshold=5.0)):
        out = fn(eq, [0] * 4, torch.ones(4, 5))
        assert torch.isfinite(out).all() and out.abs().max() < 1e-6
    # zero-length everything
    out = token_level_group_advantages(torch.tensor([1.0, -1.0]), [0, 0], torch.zeros(2, 3),
        norm_adv_by_std=True, fallback_threshold=5.0)
    assert torch.all(out == 0)
    # one valid token
    m = torch.zeros(2, 3)
    m[0, 1] = 1
    out = token_level_group_advantages(torch.tensor([1.0, -1.0]), [0, 0], m,
        norm_adv_by_std=True, fallback_threshold=5.0)
    assert out.abs().sum() == 0  # a group whose only valid token is one response: sigma = 0
    assert torch.isfinite(grpo_advantages(torch.tensor([1.0, -1.0]), [0, 0], m, norm_adv_by_std=True)).all()


def test_inputs_not_modified_and_bad_input():
    rewards = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.ones(3, 4)
    r0, m0 = rewards.clone(), mask.clone()
    token_level_group_advantages(rewards, [0, 0, 1], mask, norm_adv_by_std=True, fallback_threshold=5.0)
    grpo_advantages(rewards, [0, 0, 1], mask, norm_adv_by_std=True)
    assert torch.equal(rewards, r0) and torch.equal(mask, m0)
    for fn in (functools.partial(grpo_advantages, norm_adv_by_std=True),
               functools.partial(token_level_group_advantages, norm_adv_by_std=True, fallback_threshold=5.0)):
        with pytest.raises(ValueError, match="rewards"):
            fn(torch.tensor([1.0, math.nan, 0.0]), [0, 0, 1], mask)
        with pytest.raises(ValueError, match="rewards"):
            fn(torch.tensor([1.0, 2.0]), [0, 0, 1], mask)
        with pytest.raises(ValueError, match="group_ids"):
            fn(rewards, [0, 0], mask)
        with pytest.raises(ValueError, match="group_ids"):
            fn(rewards, torch.tensor([0.0, 1.0, 1.0]), mask)
        with pytest.raises(ValueError, match="group_ids"):
            fn(rewards, [[0], [0], [1]], mask)
        with pytest.raises(ValueError, match="loss_mask"):
            fn(rewards, [0, 0, 1], torch.ones(3))
        with pytest.raises(ValueError, match="eps"):
            fn(rewards, [0, 0, 1], mask, eps=0.0)
    with pytest.raises(ValueError, match="fallback_threshold"):
        token_level_group_advantages(rewards, [0, 0, 1], mask, fallback_threshold=0.0, norm_adv_by_std=True)


def test_overlong_penalty():
    lens = torch.tensor([0, 6, 7, 8, 10, 12])
    got = overlong_penalty(lens, max_response_length=10, overlong_buffer_len=4, penalty_factor=0.5)
    want = [min(0.0, -(L - (10 - 4)) / 4 * 0.5) for L in lens.tolist()]
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx(want)
    assert overlong_penalty([10], 10, 4).tolist() == [-1.0]
    assert overlong_penalty([3, 5], 10, 4).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty([1], 10, 0)
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty([1], 10, 11)
    with pytest.raises(ValueError, match="max_response_length"):
        overlong_penalty([1], 0, 1)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty([1], 10, 2, -1.0)
    with pytest.raises(ValueError, match="response_lengths"):
        overlong_penalty([-1], 10, 2)


@pytest.mark.parametrize("seed", range(10))
def test_filter_groups_matches_loop(seed):
    rewards, gids, _, _ = _random_batch(seed)
    rng = random.Random(seed)
    acc = [rng.random() < 0.5 for _ in rewards]
    for metric in (None, acc):
        vals = rewards if metric is None else [float(a) for a in metric]
        keep = filter_groups(torch.tensor(rewards), gids, None if metric is None else torch.tensor(metric))
        groups = loops.groups_of(gids)
        want = [False] * len(rewards)
        for members in groups.values():
            k = len(members) == 1 or len({vals[i] for i in members}) > 1
            for i in members:
                want[i] = k
        assert keep.dtype == torch.bool and keep.tolist() == want


def test_filter_groups_hand_and_bad_input():
    keep = filter_groups([1.0, 1.0, -1.0, 1.0, 0.5], ["a", "a", "b", "b", "c"])
    assert keep.tolist() == [False, False, True, True, True]
    with pytest.raises(ValueError, match="metric_values"):
        filter_groups([1.0, 1.0], [0, 0], metric_values=[1.0])
    with pytest.raises(ValueError, match="rewards"):
        filter_groups([1.0, math.inf], [0, 0])


def test_empty_batch_and_zero_length_horizon():
    assert grpo_advantages(torch.zeros(0), [], torch.zeros(0, 3), norm_adv_by_std=True).shape == (0, 3)
    adv, fb = token_level_group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, 3),
                                           return_fallback=True, norm_adv_by_std=True, fallback_threshold=5.0)
    assert adv.shape == (0, 3) and fb.shape == (0,)
    assert filter_groups(torch.zeros(0), []).shape == (0,)
    assert token_level_group_advantages(torch.ones(2), [0, 1], torch.zeros(2, 0),
        norm_adv_by_std=True, fallback_threshold=5.0).shape == (2, 0)
    assert overlong_penalty([], 10, 2).shape == (0,)
