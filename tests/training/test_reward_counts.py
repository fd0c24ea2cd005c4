"""Rank 0's rollout reports the rewards that hit their time limit (`reward/timeouts`), counted over
every generation round of the step, with the real math reward and its bounded verification."""

from types import SimpleNamespace

from hapo_megatron.config import HapoConfig
from hapo_megatron.rewards import get_reward_fn
from hapo_megatron.rewards import math as math_reward
from hapo_megatron.rollout.engine import Sample
from hapo_megatron.training import stages
from hapo_megatron.training.rl_step import DynamicSampler

ANSWERS = ["\\boxed{2^{10}}", "\\boxed{9^{9^{9}}}", "\\boxed{7}", "\\boxed{9^{9^{9}}}"]  # per prompt x sample


class _Engine:
    """Returns the response texts of ANSWERS, one character per token."""

    def generate(self, prompt_ids, params):
        return [[Sample(prompt_ids=p, response_ids=[ord(c) for c in ANSWERS[(2 * i + k) % len(ANSWERS)]],
                        rollout_logprobs=[-1.0] * len(ANSWERS[(2 * i + k) % len(ANSWERS)]), temperatures=[],
                        finish_reason="stop", prompt_index=i, sample_index=k) for k in range(params.n)]
                for i, p in enumerate(prompt_ids)]

    def release_memory(self):
        pass

    def resume_memory(self):
        pass


def _runtime(filter_groups: bool):
    cfg = HapoConfig.from_dict({
        "data": {"train_batch_size": 2}, "trainer": {"ppo_mini_batch_size": 2}, "rollout": {"n": 2, "max_response_length": 64},
        "algo": {"adaptive_temperature": False, "filter_groups": filter_groups, "max_num_gen_batches": 3},
        "reward": {"reward_fn": "math", "reward_kwargs": {"verify_timeout_s": 0.5}}})
    records = [SimpleNamespace(prompt_ids=[1, 2], ground_truth="1024", data_source="d", extra_info=None)] * 2
    sampler = SimpleNamespace(next_batch=lambda: records, state_dict=lambda: {})
    return SimpleNamespace(cfg=cfg, engine=_Engine(), engine_released=set(), tokenizer=SimpleNamespace(
        decode=lambda ids, skip_special_tokens: "".join(map(chr, ids)), eos_token_id=None),
        reward_fn=get_reward_fn(cfg.reward.reward_fn), sampling_seed=lambda step, i: 0,
        rl=SimpleNamespace(dyn=DynamicSampler(enabled=filter_groups, max_num_gen_batches=3), sampler=sampler,
                           entropy_stats=None))


def test_timeouts_are_counted_over_every_round(monkeypatch):
    monkeypatch.setattr(math_reward, "exceeds_digits", lambda *a, **k: False)  # 9^(9^9) reaches sympy
    monkeypatch.setattr(stages, "broadcast_object", lambda obj: obj)  # the heartbeat between rounds
    _, metrics, _ = stages._rollout_rank0(_runtime(filter_groups=False), 1)
    assert metrics["rollout/num_gen_batches"] == 1.0 and metrics["reward/timeouts"] == 2.0  # 2 of 4
    assert metrics["rollout/acc"] == 0.25
    # prompt 1's group (7, timeout) is all wrong: dynamic sampling keeps one group of 2 per round,
    # so it runs 2 rounds, each with 2 timeouts
    _, metrics, _ = stages._rollout_rank0(_runtime(filter_groups=True), 1)
    assert metrics["rollout/num_gen_batches"] == 2.0 and metrics["reward/timeouts"] == 4.0
