"""The other ranks' wait during rank 0's rollout: one broadcast per generation round (a heartbeat),
the batch at the end, and rank 0's failure raised on every rank (stages.rollout)."""

import datetime
from types import SimpleNamespace

from tests.distributed import run_distributed


def _rollout_protocol(rank, world, fail):
    import torch.distributed as dist

    from hapo_megatron.training import stages
    from hapo_megatron.training.rl_step import RolloutBatch
    from hapo_megatron.parallel.collectives import broadcast_object
    from hapo_megatron.training.engine_memory import EngineMemory

    calls = []
    real_broadcast = stages.broadcast_object

    def counting(obj, *a, **k):  # every collective of the protocol, on every rank
        out = real_broadcast(obj, *a, **k)
        calls.append(out[0] if isinstance(out, tuple) else out)
        return out
    stages.broadcast_object = counting

    def fake_rank0(rt, step):
        for r in range(3):  # three rounds before the batch is full
            stages.broadcast_object(("progress", {"step": step, "round": r + 1}))
        if fail:
            raise ValueError("server went away")
        batch = RolloutBatch(prompt_ids=[[1, 2]], response_ids=[[3]], rollout_logprobs=[[-0.5]],
                             temperatures=[[1.0]], finish_reasons=["stop"], group_ids=[0], scores=[1.0],
                             accs=[True], rewards=[1.0], data_sources=["x"])
        return batch.pack(), {"m": 1.0}, {"epoch": 7}
    stages._rollout_rank0 = fake_rank0
    sampler = SimpleNamespace(state=None, load_state_dict=lambda s: setattr(sampler, "state", s))
    rt = SimpleNamespace(is_main=rank == 0, memory=EngineMemory(), rl=SimpleNamespace(sampler=sampler))
    try:
        batch, metrics = stages.rollout(rt, 5)
        out = dict(ok=True, n=len(batch), metrics=metrics, sampler=sampler.state)
    except Exception as e:  # noqa: BLE001
        out = dict(ok=False, error=f"{type(e).__name__}: {e}")
    assert broadcast_object("still in sync") == "still in sync"
    return dict(out, calls=calls)


def test_other_ranks_get_a_heartbeat_per_round_then_the_batch():
    for r in run_distributed(_rollout_protocol, 2, False, timeout=120):
        assert r["ok"], r
        assert r["calls"] == ["progress"] * 3 + ["done"], r["calls"]
        assert r["n"] == 1 and r["metrics"] == {"m": 1.0} and r["sampler"] == {"epoch": 7}


def test_rank0_failure_stops_every_rank():
    out = run_distributed(_rollout_protocol, 2, True, timeout=120)
    assert out[0]["error"] == "ValueError: server went away"
    assert out[1]["error"].startswith("RuntimeError: rank 0 failed during the rollout or evaluation: ValueError: server went away")
    assert out[1]["calls"][-1] == "error"


def test_timeout_shorter_than_one_round_is_refused():
    import pytest

    from hapo_megatron.config import HapoConfig
    from hapo_megatron.train import check_dist_timeout, rollout_round_bound_s
    cfg = HapoConfig.from_dict({"rollout": {"engine": "sglang", "sglang": {"request_timeout_s": 3600, "max_retries": 3}},
                                "trainer": {"dist_timeout_minutes": 180}})
    assert rollout_round_bound_s(cfg) == 4 * 3600.0
    with pytest.raises(ValueError) as e:
        check_dist_timeout(cfg)
    msg = str(e.value)
    for part in ("trainer.dist_timeout_minutes=180", "10800 s", "14400 s", "rollout.sglang.request_timeout_s=3600",
                 "rollout.sglang.max_retries=3"):
        assert part in msg, msg
    cfg.trainer.dist_timeout_minutes = 250
    check_dist_timeout(cfg)
    cfg.rollout.engine = "hf"  # no per-request bound to check against
    cfg.trainer.dist_timeout_minutes = 1
    check_dist_timeout(cfg)
    assert datetime.timedelta(minutes=cfg.trainer.dist_timeout_minutes)

