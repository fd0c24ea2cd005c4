"""The doctor's two-rank launcher (doctor/two_ranks.py) on gloo: each rank's answer by rank, a
collective between them, and a rank's error reported as the doctor shows it."""

import torch

from hapo_megatron.doctor.two_ranks import run_two_ranks


def _sum_of_ranks(rank, device, offset):
    t = torch.tensor([float(rank + offset)])
    torch.distributed.all_reduce(t)
    return (rank, device, float(t))


def _fails_on_rank_1(rank, device):
    if rank == 1:
        raise ValueError("rank 1 broke")
    return rank


def test_answers_by_rank_and_a_collective_between_them():
    assert run_two_ranks(_sum_of_ranks, 10, use_cuda=False, timeout_s=300) == {0: (0, "cpu", 21.0),
                                                                                 1: (1, "cpu", 21.0)}


def test_a_rank_error_comes_back_as_the_error():
    out = run_two_ranks(_fails_on_rank_1, use_cuda=False, timeout_s=300)
    assert out == {"error": "rank 1: ValueError: rank 1 broke"}
