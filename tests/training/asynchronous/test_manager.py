"""The rollout manager process (training/asynchronous/manager.py) on test_producer.py's fake
runtime, built in the spawned process: the same batches, in the same prompt order, as the
producer thread; pause / continue reach the manager's engine; a resume loses and repeats no
prompt; the manager's crash and hang end the wait with a one-line failure, never a hang; an error
in the producer reaches the trainer in one line.

Mutation tried: `follow_servers` not rejoining the trainer's servers fails
`test_follow_servers_takes_the_trainers_servers_in_use`."""

from __future__ import annotations

import dataclasses

import os
import signal
import threading
from types import SimpleNamespace

import pytest

from hapo_megatron.training.asynchronous.manager import RolloutManager, RolloutManagerFailed, follow_servers
from hapo_megatron.training.asynchronous.producer import AsyncRollout
from hapo_megatron.training.rollout_protocol import RolloutAbandoned
from tests.training.asynchronous.test_producer import B, N, _prompts, _rt, _sampler_order

slow = pytest.mark.slow  # each spawns a manager process (imports torch): seconds to start


def fake_runtime(k=1, fail=None, step=0, sampler_state=None, hang_after=None):
    """test_producer's fake runtime, in the manager process; its engine's version follows the
    pauses (the trainer's weight update happens between pause and continue)."""
    rt = _rt(k, step=step, sampler_state=sampler_state)
    engine = rt.engine
    engine.version = step
    if fail is not None:
        engine.fail = RuntimeError(fail)
    calls, aborted = [0], threading.Event()
    base = engine.generate

    def generate(prompt_ids, params, on_samples=None):
        calls[0] += 1
        if hang_after is not None and calls[0] > hang_after:
            aborted.wait()  # a server that answers only when its requests are aborted
            raise RuntimeError("aborted")
        return base(prompt_ids, params, on_samples)
    engine.generate = generate
    engine.abort_requests = aborted.set
    base_continue = engine.continue_generation

    def continue_generation():
        engine.version += 1
        base_continue()
    engine.continue_generation = continue_generation
    return rt


def _train_manager(mgr, steps, start=0):
    got = []
    for s in range(start, start + steps):
        kept, metrics, snap, seq_stats = mgr.take_step(s + 1)
        assert metrics["rollout/staleness_max"] <= 1 and len(seq_stats) == len(kept) == B * N
        got.append((_prompts(kept), metrics, snap, kept))
        with mgr.paused(s + 1):
            pass
    return got


@slow
def test_manager_batches_match_the_thread_producer():
    mgr = RolloutManager(fake_runtime, (1,))
    try:
        got = _train_manager(mgr, 4)
        snap = mgr.snapshot()
    finally:
        mgr.close()
    assert not mgr._proc.is_alive() and mgr._proc.exitcode == 0
    assert [p for g in got for p in g[0]] == _sampler_order(4 * B)
    assert snap["pending"] and "sampler" in snap
    # the arrays that came through the pipe are the batch the producer built
    rt = _rt(1)
    ar = AsyncRollout(rt).start()
    try:
        kept, *_ = ar.take_step(1)
    finally:
        ar.close()
    assert got[0][3] == kept
    assert got[0][3].group_ids == kept.group_ids and got[0][3].scores == kept.scores
    for key in ("timing/producer_cpu_s", "timing/manager_transport_s", "timing/trainer_wait_s"):
        assert key in got[-1][1]


@slow
def test_resume_through_the_manager_loses_and_repeats_no_prompt():
    mgr = RolloutManager(fake_runtime, (1,))
    try:
        first = _train_manager(mgr, 2)
    finally:
        mgr.close()
    snap = first[-1][2]
    assert snap["pending"]
    mgr = RolloutManager(fake_runtime, (1, None, 2, snap["sampler"]), pending=snap["pending"])
    try:
        again = _train_manager(mgr, 2, start=2)
    finally:
        mgr.close()
    assert [p for g in first + again for p in g[0]] == _sampler_order(4 * B)


@slow
def test_an_error_in_the_producer_reaches_the_trainer_in_one_line():
    mgr = RolloutManager(fake_runtime, (1, "all servers gone"))
    with pytest.raises(RolloutManagerFailed, match="all servers gone") as err:
        mgr.take_step(1)
    assert "\n" not in str(err.value)
    mgr.close()
    assert not mgr._proc.is_alive()


@slow
def test_a_killed_manager_fails_the_wait():
    """SIGKILL mid-run: the trainer's wait ends with the exit code, and with ``on_failure`` the
    step is given up (the trainer then stops at its safe point, the last step saved)."""
    failures = []
    mgr = RolloutManager(fake_runtime, (1, None, 0, None, B), on_failure=failures.append)
    try:
        _train_manager(mgr, 1)  # the second batch never comes: generation hangs
        os.kill(mgr.pid, signal.SIGKILL)
        with pytest.raises(RolloutAbandoned, match=r"exited with code -9"):
            mgr.take_step(2)
    finally:
        mgr.close()
    assert len(failures) == 1 and "rollout manager process" in failures[0]
    with mgr.paused(3):  # after a failure the weight update goes on; nothing raises
        pass


@slow
def test_a_silent_manager_is_declared_hung_and_killed():
    """SIGSTOP (no beat): after ``timeout_s`` the trainer kills it and fails the wait."""
    mgr = RolloutManager(fake_runtime, (1, None, 0, None, 0), timeout_s=3.0)
    try:
        os.kill(mgr.pid, signal.SIGSTOP)
        with pytest.raises(RolloutManagerFailed, match="sent nothing for 3 s"):
            mgr.take_step(1)
    finally:
        mgr.close()
    assert not mgr._proc.is_alive()


@slow
def test_a_stop_request_gives_the_step_up():
    mgr = RolloutManager(fake_runtime, (1, None, 0, None, 0))
    try:
        with pytest.raises(RolloutAbandoned, match="stop requested"):
            mgr.take_step(1, stop_check=lambda: True)
    finally:
        mgr.close()
    assert mgr._proc.exitcode == 0


class _Supervisor:
    def __init__(self, state):
        self.state, self.log = dict(state), []

    def in_use(self):
        return [i for i, s in self.state.items() if s]

    def rejoined(self, indices):
        self.log.append(("rejoined", list(indices)))
        for i in indices:
            self.state[i] = True

    def mark_unhealthy(self, i, reason):
        self.log.append(("out", i))
        self.state[i] = False


def test_follow_servers_takes_the_trainers_servers_in_use():
    sup = _Supervisor({0: True, 1: False, 2: True})
    follow_servers(sup, [0, 1])  # 1 restarted and synced by the trainer; 2 failed there
    assert sup.state == {0: True, 1: True, 2: False}


def test_spec_of_takes_the_servers_key_and_seed_mode_of_the_trainers_engine():
    """Launched servers: rank 0's engine is a `NodeServersEngine`, whose API key is its cluster
    engine's; the manager's engine must send it, to the same servers, with the same seed mode."""
    import transformers

    from hapo_megatron.config import load_config
    from hapo_megatron.rollout.sglang.client import ServerHandle
    from hapo_megatron.training.asynchronous.manager import spec_of
    cfg = load_config(overrides=["rollout.engine=sglang", "rollout.sglang.colocate=false", "rollout.max_staleness=1"])
    hf = transformers.LlamaConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, intermediate_size=32)
    from hapo_megatron.rollout.sglang.engine import SGLangEngine
    from hapo_megatron.rollout.sglang.node_servers import NodeServersEngine
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    cluster = SGLangEngine(dataclasses.replace(cfg.rollout.sglang, server_urls=urls), launch=False,
                           wait_for_servers=False, api_key="secret", send_sampling_seed=True,
                           quantization="none", kv_cache_dtype="auto")
    engine = NodeServersEngine(ctx=SimpleNamespace(rank=0), slots=[], own=[ServerHandle(url=urls[0])],
                               cluster=cluster, node_sync=None, weight_sync="disk", leaders_group=None, dtype=None)
    rt = SimpleNamespace(cfg=cfg, hf_config=hf, engine=engine, tokenizer=None, train_ds=[],
                         actor=SimpleNamespace(routing="replay"),
                         rl=SimpleNamespace(sampler=SimpleNamespace(state_dict=lambda: {"pos": 3}), step=4,
                                            rollout_entropy_stats=None))
    spec = spec_of(rt)
    assert spec.api_key == "secret" and spec.send_sampling_seed and spec.step == 4
    assert spec.routing == "replay" and spec.asynchronous  # MoE replay: every step fetches routes
    assert spec.rollout_cfg.sglang.server_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert spec.sampler_state == {"pos": 3} and cfg.rollout.sglang.server_urls == []  # the run's config untouched
    assert spec_of(SimpleNamespace(**{**vars(rt), "engine": cluster})).api_key == "secret"  # attached servers
    with pytest.raises(TypeError, match="needs an SGLang engine"):
        spec_of(SimpleNamespace(**{**vars(rt), "engine": object()}))
