"""Rank 0's rollout with its rewards: scored in worker processes while generation runs, failures
(timeouts, errors, killed workers) scored the format's minimum and counted in ``reward/timeouts``
/ ``reward/errors`` over every generation round; the math reward's own limit in process."""

import time
from types import SimpleNamespace

from hapo_megatron.config import HapoConfig
from hapo_megatron.rewards import get_reward_fn
from hapo_megatron.rewards import math as math_reward
from hapo_megatron.rewards.scoring import RewardScorer
from hapo_megatron.rollout.engine import Sample
from hapo_megatron.training import stages
from hapo_megatron.training.memory.engine_memory import EngineMemory
from hapo_megatron.training.batches.rollout_batch import DynamicSampler
from tests.rollout.standin_engine import StandInEngine
from tests.training.misbehaving_reward import read_calls


class _Engine(StandInEngine):
    """Answers ``answers(prompt, sample)``, one character per token, in two chunks; before the
    second chunk it waits (bounded) until ``ready()``: the first chunk was being scored meanwhile."""

    def __init__(self, answers, ready=lambda: True):
        self.answers, self.ready, self.waited = answers, ready, None

    def generate(self, prompt_ids, params, on_samples=None):
        done = [Sample(prompt_ids=p, response_ids=[ord(c) for c in self.answers(i, k)],
                       rollout_logprobs=[-1.0] * len(self.answers(i, k)), temperatures=[], finish_reason="stop",
                       prompt_index=i, sample_index=k) for i, p in enumerate(prompt_ids) for k in range(params.n)]
        half = len(done) // 2
        for part in (done[:half], done[half:]):
            if on_samples is not None:
                on_samples(part)
            deadline = time.monotonic() + 120
            while not self.ready() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.waited = self.ready() if self.waited is None else self.waited
        out = [[] for _ in prompt_ids]
        for s in done:
            out[s.prompt_index].append(s)
        return out


def _runtime(engine, truths, *, n, filter_groups=False, **reward):
    cfg = HapoConfig.from_dict({
        "data": {"train_batch_size": len(truths)}, "trainer": {"ppo_mini_batch_size": len(truths)},
        "rollout": {"n": n, "max_response_length": 64},
        "algo": {"adaptive_temperature": False, "filter_groups": filter_groups, "max_num_gen_batches": 3},
        "reward": reward})
    records = [SimpleNamespace(prompt_ids=[1, 2], ground_truth=t, data_source="d", extra_info=None) for t in truths]
    sampler = SimpleNamespace(next_batch=lambda: records, state_dict=lambda: {})
    return SimpleNamespace(
        cfg=cfg, engine=engine, memory=EngineMemory(engine), actor=SimpleNamespace(routing="off"),
        control=SimpleNamespace(send=lambda kind, body: None),
        sampling_seed=lambda step, i: 0,
        tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join(map(chr, ids)), eos_token_id=None),
        reward_fn=get_reward_fn(cfg.reward.reward_fn), scorer=RewardScorer(cfg.reward),
        rl=SimpleNamespace(dyn=DynamicSampler(enabled=filter_groups, max_num_gen_batches=3,
            metric='acc'), sampler=sampler,
                           rollout_entropy_stats=None))


def test_math_reward_timeouts_in_process_over_every_round(monkeypatch):
    monkeypatch.setattr(math_reward, "exceeds_digits", lambda *a, **k: False)  # 9^(9^9) reaches sympy
    monkeypatch.setattr(stages, "broadcast_object", lambda obj: obj)  # the heartbeat between rounds
    answers = ["\\boxed{2^{10}}", "\\boxed{9^{9^{9}}}", "\\boxed{7}", "\\boxed{9^{9^{9}}}"]
    engine = _Engine(lambda i, k: answers[(2 * i + k) % 4])
    # 2 s: far above a normal verify on a loaded 2-core machine (its first call also imports the
    # LaTeX parser), far below 9^(9^9)'s
    kw = dict(num_workers=0, reward_fn="math", reward_kwargs={"verify_timeout_s": 2.0})
    _, metrics, _ = stages.generate_step(_runtime(engine, ["1024", "1024"], n=2, **kw), 1)
    assert metrics["rollout/num_gen_batches"] == 1.0 and metrics["reward/timeouts"] == 2.0  # 2 of 4
    assert metrics["rollout/acc"] == 0.25 and metrics["reward/errors"] == 0.0
    # prompt 1's group (7, timeout) is all wrong: dynamic sampling keeps one group of 2 per round,
    # so it runs 2 rounds, each with 2 timeouts
    _, metrics, _ = stages.generate_step(_runtime(engine, ["1024", "1024"], n=2, filter_groups=True, **kw), 1)
    assert metrics["rollout/num_gen_batches"] == 2.0 and metrics["reward/timeouts"] == 4.0


def test_misbehaving_rewards_in_workers_while_generating(tmp_path):
    truths = [str(t) for t in range(8)]  # one prompt of each kind (misbehaving_reward.KINDS)
    calls = lambda: read_calls(str(tmp_path))  # noqa: E731
    engine = _Engine(lambda i, k: truths[i] if k == 0 else "wrong", ready=lambda: len(calls()) >= 8)
    rt = _runtime(engine, truths, n=2, reward_fn="tests.training.misbehaving_reward:score", num_workers=2,
                  timeout_s=2.0, score_format="01", reward_kwargs={"log_dir": str(tmp_path)})  # >> 0.05 s sleeps
    try:
        batch, metrics, _ = stages.generate_step(rt, 1)
    finally:
        rt.scorer.close()
    assert engine.waited  # the first chunk (prompts 0-3) was scored before the second was generated
    assert sorted(calls()) == sorted(2 * ["hang", "stuck", "raise", "kill", "sleep", "ok", "ok", "ok"])
    assert metrics["reward/timeouts"] == 4.0 and metrics["reward/errors"] == 4.0  # each response once
    assert metrics["timing/reward_wait_s"] >= 0.0
    assert rt.scorer.pool.restarts == 4  # stuck and killed workers were replaced (timer-stopped ones kept)
    # failures score the "01" format's minimum; the rest what the reward returned (+1 right, -1 wrong)
    assert batch.scores == [0.0] * 8 + [1.0, -1.0] * 4 and batch.accs == [False] * 8 + [True, False] * 4
