"""The synchronous loop's rollout in the rollout manager process (``rollout.sync_producer:
process``; training/asynchronous/manager.py, `stages._rollout_rank0`): bit for bit the batches,
metrics and sampler cursors of the rollout in trainer rank 0 (`stages.generate_step` inline), over
three steps with dynamic sampling that needs several generation rounds (the progress between
rounds reaches the trainer's other ranks the same way), on a seeded engine
(tests/training/asynchronous/sync_manager_parts.py).

Mutations tried: the manager not loading the trainer's sampler cursor (its own runs on from where
it was: the same here for steps 1-3, so the test also hands the manager a cursor moved past what
it saw): both cases fail; the entropy statistics not forwarded: the adaptive-temperature case fails."""

from __future__ import annotations

import pytest

from hapo_megatron.algo import EntropyStats
from hapo_megatron.config import load_config
from hapo_megatron.training import stages
from hapo_megatron.training.asynchronous import manager as manager_mod
from hapo_megatron.training.asynchronous.manager import RolloutManager
from tests.training.asynchronous.sync_manager_parts import make_runtime

def _steps(rt, steps, stats_of):
    out = []
    for step in steps:
        rt.rl.step, rt.rl.rollout_entropy_stats = step, stats_of(step)
        kept, metrics, state = stages._rollout_rank0(rt, step)
        rt.rl.sampler.load_state_dict(state)  # every rank takes rank 0's cursor (stages._apply_sampler_state)
        out.append((kept, {k: v for k, v in metrics.items() if not k.startswith("timing/")}, state))
    return out


def _stats(step):
    # the sampling temperatures follow the trainer's entropy statistics (algo.adaptive_temperature)
    return EntropyStats(pivot=-0.5 + 0.1 * step, std=1.0, pos_max=2.0 + step, neg_min=-3.0)


@pytest.mark.parametrize("overrides", [[], ["algo.adaptive_temperature=true"]], ids=["plain", "adaptive_temperature"])
def test_the_manager_rolls_out_the_same_steps_bit_for_bit(overrides):
    inline = make_runtime(overrides)
    expected = _steps(inline, [1, 2, 3], _stats)
    assert sum(kind == "progress" for kind, _ in inline.sent) >= 3  # several rounds per step

    rt = make_runtime(overrides)
    rt.rl.sampler.load_state_dict(expected[0][2])  # the trainer resumed past step 1 ...
    rt.sync_manager = RolloutManager(make_runtime, (overrides,), asynchronous=False,
                                     on_progress=lambda kind, body: rt.sent.append((kind, body)))
    try:
        got = _steps(rt, [2, 3], _stats)  # ... the manager's sampler (fresh) must follow it
    finally:
        rt.sync_manager.close()
    for (kept, metrics, state), (kept2, metrics2, state2) in zip(expected[1:], got):
        assert kept2 == kept and len(kept) == 9
        assert metrics2 == metrics
        assert state2 == state
    assert rt.sent == [m for m in inline.sent if m[1]["step"] >= 2]


def test_over_sampling_pool_travels_between_the_trainer_and_the_manager():
    """Over-sampling through the manager: the pool of groups started comes back with each step
    (the trainer checkpoints it) and goes out with the next, so a fresh manager (a resumed run)
    continues it: every group started is trained once or is still in the pool, serials 0 .. next
    without a gap or a repeat (as inline, tests/training/test_partial_rollouts.py). Mutations
    tried: the trainer not sending its pool, the manager not returning it: both repeat serials."""
    from hapo_megatron.training.partial_rollouts import PartialPool
    overrides = ["rollout.over_sampling=2", "algo.filter_groups=false"]  # no group dropped by the filter
    rt = make_runtime(overrides)
    trained = []
    for step in (1, 2):  # each step in a manager of its own: the second starts from the trainer's pool
        rt.sync_manager = RolloutManager(make_runtime, (overrides,), asynchronous=False,
                                         on_progress=lambda kind, body: None)
        try:
            rt.rl.step = step
            kept, _, state = stages._rollout_rank0(rt, step)
        finally:
            rt.sync_manager.close()
        stages._apply_sampler_state(rt, state)
        assert state["partial"] and len(kept) == 9
        trained += [int(g) for g in dict.fromkeys(kept.group_ids)]
    pool = PartialPool.from_dict(rt.rl.partial_rollouts)
    assert pool.next_serial > len(trained)  # over-sampling started more groups than it trained
    assert sorted(trained + [g.serial for g in pool.groups]) == list(range(pool.next_serial))


def test_the_loop_starts_the_manager_for_the_synchronous_loop_only_when_asked(monkeypatch):
    started = []
    monkeypatch.setattr(manager_mod, "start_manager", lambda rt, **kw: started.append(kw) or "manager")

    def start(*overrides):
        rt = make_runtime(list(overrides))
        rt.is_main = True
        manager_mod.start_rollout_producer(rt)
        return rt.sync_manager
    assert start() is None and not started  # rollout.sync_producer: inline (the default)
    assert start("rollout.sync_producer=process") == "manager" and started == [{"pending": None, "on_failure": None}]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.sync_producer=sideways"], "rollout.sync_producer must be 'inline' or 'process'"),
    (["rollout.sync_producer=process", "rollout.engine=hf"], "set rollout.engine=sglang (is 'hf')"),
])
def test_impossible_settings_are_one_line_refusals(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        load_config(overrides=overrides)
    assert "\n" not in str(e.value)
