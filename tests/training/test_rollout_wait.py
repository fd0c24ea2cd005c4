"""The other ranks' wait during rank 0's rollout (stages.rollout, training/rollout_protocol.py):
heartbeats from rank 0 DURING a round, progress between rounds, the batch at the end, rank 0's
failure raised on every rank; every message over the CPU (gloo) control group, never a collective
of the default group."""

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

    from hapo_megatron.config import HapoConfig
    from hapo_megatron.training import rollout_protocol, stages
    from hapo_megatron.training.batches.rollout_batch import RolloutBatch
    from hapo_megatron.parallel.collectives import broadcast_object
    from hapo_megatron.training.memory.engine_memory import EngineMemory
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

    def fake_rank0(rt, step, stop_check=None):
        for r in range(3):  # three rounds before the batch is full; the first outlasts two heartbeats
            if r == 0:
                assert beats.wait(timeout=240), "no heartbeat while rank 0 was inside a round"
            rt.control.send("progress", {"step": step, "round": r + 1})
        if fail == "stop":
            from hapo_megatron.rollout.engine import GenerationAborted
            raise GenerationAborted("generation stopped by a stop request")  # what the SGLang engine raises
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
                         actor=SimpleNamespace(routing="off"),  # one DP group: both ranks get the batch
                         async_rollout=None, sync_manager=None,
                         # the step plan is made where the batch is shared out (stages._plan)
                         cfg=HapoConfig.from_dict({"trainer": {"ppo_mini_batch_size": 1},
                                                   "data": {"train_batch_size": 1}}))
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


def test_rollout_given_up_on_a_stop_request_reaches_every_rank():
    """The engine's GenerationAborted on rank 0 becomes RolloutAbandoned on every rank (an
    ``abandoned`` message, not ``error``), which the trainer answers by saving the last finished
    step (mutation: without the ABANDONED branch of stages.rollout rank 1 raises RuntimeError)."""
    out = run_distributed(_rollout_protocol, 2, "stop", timeout=400)
    for r in out:
        assert r["error"] == "RolloutAbandoned: generation stopped by a stop request", r
        assert r["foreign"] == []
    assert out[1]["kinds"][-1] == "abandoned"


def test_nccl_timeout_must_outlast_the_single_waits_not_a_round():
    """The start check of trainer.dist_timeout_minutes: longer than one weight-sync request and the
    servers' start (the waits a trainer collective can span), however long a generation round is
    (8192 rows in 4 waves x 1800 s x 4 tries = 8 h no longer matter: the wait runs on the
    control group). Fails when the check drops a bound (tried: without the request timeout, 30
    minutes passes; without the launch bound, 15 minutes passes)."""
    import pytest

    from hapo_megatron.config import HapoConfig
    from hapo_megatron.train import check_dist_timeout, collective_wait_bounds_s
    cfg = HapoConfig.from_dict({"data": {"train_batch_size": 512}, "trainer": {"ppo_mini_batch_size": 512,
                                                                               "dist_timeout_minutes": 30},
                                "rollout": {"engine": "sglang", "n": 16, "sglang": {
                                    "num_servers": 4, "request_timeout_s": 1800, "max_retries": 3}}})
    assert sorted(collective_wait_bounds_s(cfg).values()) == [900.0, 1800.0]
    with pytest.raises(ValueError) as e:
        check_dist_timeout(cfg)  # 1800 s is not longer than one 1800 s weight-sync request
    msg = str(e.value)
    for part in ("trainer.dist_timeout_minutes=30", "1800 s", "rollout.sglang.request_timeout_s=1800",
                 "above 30 minutes"):
        assert part in msg, msg
    cfg.trainer.dist_timeout_minutes = 31
    check_dist_timeout(cfg)  # minutes, not the 8 hours a round may take
    cfg.rollout.sglang.request_timeout_s = 300  # now the servers' start (900 s) is the longest wait
    cfg.trainer.dist_timeout_minutes = 15
    with pytest.raises(ValueError, match="start of the servers"):
        check_dist_timeout(cfg)
    cfg.rollout.sglang.server_urls = ["http://127.0.0.1:30000"]  # attached: the trainer launches none
    assert list(collective_wait_bounds_s(cfg).values()) == [300.0]
    check_dist_timeout(cfg)
    cfg.rollout.engine = "hf"  # no server: nothing to outlast
    cfg.trainer.dist_timeout_minutes = 1
    check_dist_timeout(cfg)
    assert collective_wait_bounds_s(cfg) == {}


def test_recipes_keep_nccl_timeouts_in_minutes():
    """The GPU recipes' NCCL timeout is sized for the collectives (under an hour), and passes the
    start check; the long wait is the control group's (fails with the old 500-1000 minutes)."""
    import glob
    import os

    from hapo_megatron.config import load_config
    from hapo_megatron.train import check_dist_timeout
    from tests.training.tiny_setup import ROOT
    recipes = [p for p in glob.glob(os.path.join(ROOT, "examples", "*", "config.yaml")) if "cpu" not in p]
    assert len(recipes) >= 5
    for path in recipes:
        cfg = load_config(path, [])
        assert cfg.trainer.dist_timeout_minutes <= 60, path
        check_dist_timeout(cfg, 16)
        assert cfg.trainer.control_timeout_minutes >= cfg.trainer.dist_timeout_minutes, path


def test_fit_gives_each_group_its_timeout(monkeypatch):
    """`fit` wiring: Megatron's (NCCL) groups get trainer.dist_timeout_minutes, the stop-agreement
    gloo group trainer.control_timeout_minutes (fails when either reads the other field; tried).
    The control channel of `build_runtime` reads the same field (training/build.py)."""
    import pytest

    import hapo_megatron.parallel.groups as groups
    from hapo_megatron.config import HapoConfig
    from hapo_megatron.training import trainer

    seen = {}

    class Built(Exception):
        pass

    def build_runtime(*a, **k):
        raise Built
    monkeypatch.setattr(groups, "initialize_parallel", lambda **kw: seen.setdefault("nccl", kw["timeout_minutes"]))
    monkeypatch.setattr(trainer, "shield_checkpoint_writer", lambda signals: None)
    monkeypatch.setattr(trainer, "cpu_group_over_world", lambda minutes: seen.__setitem__("control", minutes))
    monkeypatch.setattr(trainer, "build_runtime", build_runtime)
    cfg = HapoConfig.from_dict({"trainer": {"dist_timeout_minutes": 17, "control_timeout_minutes": 123}})
    with pytest.raises(Built):
        trainer.fit(cfg)
    assert seen == {"nccl": 17, "control": 123}
