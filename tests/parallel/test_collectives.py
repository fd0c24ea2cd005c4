"""The object collectives: the same answer on every rank, for the default group and a subgroup,
and the single-process answers without a process group."""

import torch.distributed as dist

from hapo_megatron.parallel import collectives as C
from tests.distributed import run_distributed


def _ranks(rank, world):
    odd = dist.new_group([1, 3], backend="gloo")  # every rank must call new_group
    out = {
        "rank_world": C.rank_and_world(),
        "bcast": C.broadcast_object({"from": rank}, src=2),
        "gather": C.all_gather_objects(rank * 10),
        "sum": C.sum_metrics({"a": rank, f"only{rank}": 1.0}, contribute=rank != 0),
    }
    if rank in (1, 3):
        out["sub_rank_world"] = C.rank_and_world(odd)
        out["sub_gather"] = C.all_gather_objects(rank, odd)
        out["sub_bcast"] = C.broadcast_object(f"hello from {rank}", src=3, group=odd)
        out["sub_sum"] = C.sum_metrics({"x": rank}, group=odd)
    return out


def test_collectives_agree_on_every_rank():
    res = run_distributed(_ranks, 4)
    for r, out in enumerate(res):
        assert out["rank_world"] == (r, 4)
        assert out["bcast"] == {"from": 2}
        assert out["gather"] == [0, 10, 20, 30]
        # rank 0 does not contribute: its keys are absent, its "a" (0) would not show anyway
        assert out["sum"] == {"a": 6.0, "only1": 1.0, "only2": 1.0, "only3": 1.0}
    for r in (1, 3):
        assert res[r]["sub_rank_world"] == ((0 if r == 1 else 1), 2)
        assert res[r]["sub_gather"] == [1, 3]
        assert res[r]["sub_bcast"] == "hello from 3"
        assert res[r]["sub_sum"] == {"x": 4.0}


def test_single_process_without_a_process_group():
    assert not dist.is_initialized()
    assert C.rank_and_world() == (0, 1) and C.global_rank() == 0
    assert C.broadcast_object("x", src=0) == "x"
    assert C.all_gather_objects(5) == [5]
    assert C.sum_metrics({"a": 2}, contribute=True) == {"a": 2.0}
    assert C.sum_metrics({"a": 2}, contribute=False) == {}
