"""The other ranks' wait during rank 0's rollout (stages.rollout, training/rollout_protocol.py):
heartbeats from rank 0 DURING a round, progress between rounds, the batch at the end, rank 0's
failure raised on every rank; every message over the CPU (gloo) control group, never a collective
of the default group."""

import datetime
import threading
from types import SimpleNamespace

from tests.distributed import run_distributed

COLLECTIVES = ("broadcast", "all_reduce", "barrier", "all_gather", "gather", "scatter", "reduce", "send", "recv",
               "broadcast_object_list", "all_gather_object", "gather_object", "reduce_scatter", "all_to_all")


def _record_collectives(calls):
    """Every torch.distributed collective from now on appends (name, group) to ``calls``."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def wrap(name, fn):
        def recorded(*a, **k):
            calls.append((name, k.get("group")))
            return fn(*a, **k)
        return recorded
    for name in COLLECTIVES:
        fn = getattr(c10d, name)
        setattr(c10d, name, wrap(name, fn))  # what broadcast_object_list calls inside
        setattr(dist, name, getattr(c10d, name))


def _rollout_protocol(rank, world, fail):
    import torch.distributed as dist

    from hapo_megatron.training import rollout_protocol, stages
    from hapo_megatron.training.rl_step import RolloutBatch
    from hapo_megatron.parallel.collectives import broadcast_object
    from hapo_megatron.training.engine_memory import EngineMemory
    from hapo_megatron.training.rollout_protocol import Rank0Channel

    channel = Rank0Channel.create(timeout_minutes=5, heartbeat_s=0.02)
    kinds, beats = [], threading.Event()
    real = rollout_protocol.broadcast_object

    def counting(obj, *a, **k):  # every message of the protocol, on every rank
        out = real(obj, *a, **k)
        kinds.append(out[0])
        if kinds.count("heartbeat") >= 2:
            beats.set()
        return out
    rollout_protocol.broadcast_object = counting

    def fake_rank0(rt, step):
        for r in range(3):  # three rounds before the batch is full; the first outlasts two heartbeats
            if r == 0:
                assert beats.wait(timeout=240), "no heartbeat while rank 0 was inside a round"
            rt.control.send("progress", {"step": step, "round": r + 1})
        if fail:
            raise ValueError("server went away")
        batch = RolloutBatch(prompt_ids=[[1, 2]], response_ids=[[3]], rollout_logprobs=[[-0.5]],
                             temperatures=[[1.0]], finish_reasons=["stop"], group_ids=[0], scores=[1.0],
                             accs=[True], rewards=[1.0], data_sources=["x"])
        return batch, {"m": 1.0}, {"epoch": 7}
    stages._rollout_rank0 = fake_rank0
    sampler = SimpleNamespace(state=None, load_state_dict=lambda s: setattr(sampler, "state", s))
    rt = SimpleNamespace(is_main=rank == 0, memory=EngineMemory(), rl=SimpleNamespace(sampler=sampler), control=channel,
                         groups=SimpleNamespace(dp_rank=0, dp_size=1, pp_rank=0, pp_size=1),
                         actor=SimpleNamespace(routing="off"))  # one DP group: both ranks get the batch
    calls = []
    _record_collectives(calls)
    try:
        batch, metrics = stages.rollout(rt, 5)
        out = dict(ok=True, n=len(batch), metrics=metrics, sampler=sampler.state)
    except Exception as e:  # noqa: BLE001
        out = dict(ok=False, error=f"{type(e).__name__}: {e}")
    foreign = [(name, repr(g)) for name, g in calls if g is not channel.group]
    out.update(foreign=foreign, n_calls=len(calls), backend=dist.get_backend(channel.group),
               default_group=channel.group is None or channel.group is dist.group.WORLD)
    assert broadcast_object("still in sync") == "still in sync"
    return dict(out, kinds=kinds)


def _squash(kinds):
    """Runs of heartbeats collapse to one 'heartbeat' (how many depends on the clock)."""
    out = []
    for k in kinds:
        if not (k == "heartbeat" and out and out[-1] == "heartbeat"):
            out.append(k)
    return out


def test_other_ranks_get_heartbeats_during_a_round_then_the_batch_over_the_cpu_group():
    for r in run_distributed(_rollout_protocol, 2, False, timeout=400):
        assert r["ok"], r
        assert r["n_calls"] > 0 and r["foreign"] == [], r["foreign"]  # no collective outside the control group
        assert r["backend"] == "gloo" and not r["default_group"]
        assert r["kinds"].count("heartbeat") >= 2, r["kinds"]
        assert _squash(r["kinds"])[0] == "heartbeat" and r["kinds"][-1] == "done", r["kinds"]
        assert [k for k in r["kinds"] if k != "heartbeat"] == ["progress"] * 3 + ["done"], r["kinds"]
        assert r["n"] == 1 and r["metrics"] == {"m": 1.0} and r["sampler"] == {"epoch": 7}


def test_rank0_failure_stops_every_rank():
    out = run_distributed(_rollout_protocol, 2, True, timeout=400)
    assert out[0]["error"] == "ValueError: server went away"
    assert out[1]["error"].startswith("RuntimeError: rank 0 failed during the rollout or evaluation: "
                                      "ValueError: server went away")
    assert out[1]["kinds"][-1] == "error" and out[0]["foreign"] == out[1]["foreign"] == []


def test_timeout_shorter_than_one_round_is_refused():
    import pytest

    from hapo_megatron.config import HapoConfig
    from hapo_megatron.train import check_dist_timeout, rollout_round_bound_s
    # the case: 8192 rows (512 prompts x 16) = 128 calls of 64 over 4 servers x 8 = 32
    # workers -> 4 waves x 1800 s x 4 tries = 28,800 s, against a 180-minute (10,800 s) timeout
    cfg = HapoConfig.from_dict({"data": {"train_batch_size": 512}, "trainer": {"ppo_mini_batch_size": 512,
                                                                               "dist_timeout_minutes": 180},
                                "rollout": {"engine": "sglang", "n": 16, "sglang": {
                                    "num_servers": 4, "request_timeout_s": 1800, "max_retries": 3}}})
    assert rollout_round_bound_s(cfg) == 4 * 1800 * 4 == 28800.0
    with pytest.raises(ValueError) as e:
        check_dist_timeout(cfg)
    msg = str(e.value)
    for part in ("trainer.dist_timeout_minutes=180", "10800 s", "28800 s", "4 waves", "8192 rows",
                 "rollout.sglang.request_timeout_s=1800", "rollout.sglang.max_retries=3"):
        assert part in msg, msg
    cfg.trainer.dist_timeout_minutes = 481  # 28,860 s
    check_dist_timeout(cfg)
    cfg.rollout.sglang.num_servers = 16  # 128 workers: one wave
    assert rollout_round_bound_s(cfg) == 1800 * 4
    cfg.rollout.sglang.num_servers = 0  # colocated: one per server_tp_size training GPUs
    cfg.rollout.sglang.colocate, cfg.rollout.sglang.server_tp_size = True, 2
    assert rollout_round_bound_s(cfg, world_size=8) == 4 * 1800 * 4  # 4 servers
    assert rollout_round_bound_s(cfg, world_size=16) == 2 * 1800 * 4  # 8 servers
    cfg.rollout.sglang.colocate = False  # not known before launch: one server, 8 workers, 16 waves
    assert rollout_round_bound_s(cfg, world_size=8) == 16 * 1800 * 4
    cfg.rollout.generate_batch_size = 1024  # the rows of a round follow the generation batch
    assert rollout_round_bound_s(cfg) == 32 * 1800 * 4
    cfg.rollout.engine = "hf"  # no per-request bound to check against
    cfg.trainer.dist_timeout_minutes = 1
    check_dist_timeout(cfg)
    assert datetime.timedelta(minutes=cfg.trainer.dist_timeout_minutes)
