import pytest
import torch

from tests.distributed import run_distributed


def _sum_ranks(rank, world_size):
    import torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom")
    return rank


def _hang(rank, world_size):
    import torch.distributed as dist
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    else:
        import time
        time.sleep(60)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_on_gloo(world_size):
    out = run_distributed(_sum_ranks, world_size)
    assert out == [world_size * (world_size + 1) / 2] * world_size


def test_rank_error_is_reported():
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed.*boom"):
        run_distributed(_fail_on_rank_one, 2)


def test_hang_fails_instead_of_stalling():
    with pytest.raises(TimeoutError):
        run_distributed(_hang, 2, timeout=5)
