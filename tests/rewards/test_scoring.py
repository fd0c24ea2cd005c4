"""RewardScorer: registered and dotted-path rewards give in worker processes what they give in
process; rewards that cannot travel are refused at start; settings are checked."""

from types import SimpleNamespace

import pytest

from hapo_megatron.config import RewardConfig
from hapo_megatron.rewards import registry
from hapo_megatron.rewards.counts import RewardCounts
from hapo_megatron.rewards.scoring import RewardScorer, auto_num_workers, min_score

TEXTS = ["so \\boxed{4}", "Answer: 0.5", "\\boxed{9^{9^{9}}}", "no answer", "Answer: \\frac{1}{2}"]
RECORDS = [SimpleNamespace(ground_truth="4", data_source="a", extra_info={"i": 0}),
           SimpleNamespace(ground_truth="\\frac{1}{2}", data_source="b", extra_info=None)]


def _samples():
    """Two prompts: TEXTS[0:3] for prompt 0, TEXTS[3:5] for prompt 1 (one character per token)."""
    groups = [TEXTS[:3], TEXTS[3:]]
    return [[SimpleNamespace(response_ids=[ord(c) for c in t], prompt_index=p, sample_index=k)
             for k, t in enumerate(g)] for p, g in enumerate(groups)]


def _decode(ids):
    return "".join(map(chr, ids))


def _score(scorer, hand_over_first: bool):
    samples = _samples()
    rnd = scorer.start(RECORDS, _decode)
    if hand_over_first:
        rnd.add(samples[0])  # as an engine would; prompt 1's samples are submitted by results()
    counts = RewardCounts()
    return rnd.results(samples, counts), counts


@pytest.mark.parametrize("reward, fmt", [("math", "01"), ("tests.rewards.test_registry:dict_reward", "pm1")])
def test_workers_give_what_the_process_gives(reward, fmt):
    section = dict(reward_fn=reward, timeout_s=30, score_format=fmt)
    inline, _ = _score(RewardScorer(RewardConfig(**section, num_workers=0)), False)
    scorer = RewardScorer(RewardConfig(**section, num_workers=2))
    try:
        pooled, counts = _score(scorer, True)
    finally:
        scorer.close()
    assert pooled == inline and (counts.timeouts, counts.errors) == (0, 0)
    if reward == "math":
        assert [[r.acc for r in g] for g in pooled] == [[True, False, False], [False, True]]
        assert pooled[0][2].score == 0.0  # the "01" format
    else:  # data_source reached the dotted-path function in the worker (it takes it by name)
        assert [[r.score for r in g] for g in pooled] == [[0.5] * 3, [-0.5] * 2]


def test_rewards_that_cannot_travel_are_refused(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @registry.register_reward("local_reward")
    def local_reward(solution_str, ground_truth):
        return 1.0

    with pytest.raises(ValueError, match="reward 'local_reward' cannot run in reward worker processes"):
        RewardScorer(RewardConfig(reward_fn="local_reward", num_workers=1, timeout_s=1))
    local_reward.__module__ = "__main__"
    with pytest.raises(ValueError, match="lives in '__main__'.*reward.num_workers=0"):
        RewardScorer(RewardConfig(reward_fn="local_reward", num_workers=1, timeout_s=1))
    in_process = RewardScorer(RewardConfig(reward_fn="local_reward", num_workers=0, timeout_s=1))
    assert in_process.pool is None  # in process it is fine


def test_settings_are_checked():
    with pytest.raises(ValueError, match="reward.num_workers must be >= -1"):
        RewardScorer(RewardConfig(reward_fn="math", num_workers=-2, timeout_s=1))
    with pytest.raises(ValueError, match="reward.timeout_s must be > 0"):
        RewardScorer(RewardConfig(reward_fn="math", num_workers=0, timeout_s=0))
    assert (min_score("pm1"), min_score("01")) == (-1.0, 0.0)
    assert 1 <= auto_num_workers() <= 8


def test_from_config_carries_every_field():
    from tests.rewards.test_registry import dict_reward

    cfg = RewardConfig(reward_fn="tests.rewards.test_registry:dict_reward", score_format="01",
                       reward_kwargs={"data_source": "a"}, num_workers=1, timeout_s=7.5)
    defaults = RewardConfig()
    assert (defaults.num_workers, defaults.timeout_s) != (cfg.num_workers, cfg.timeout_s)
    scorer = RewardScorer(cfg)
    try:
        assert scorer.fn is dict_reward and scorer.score_format == "01" and scorer.wrong == 0.0
        assert scorer.reward_kwargs == {"data_source": "a"} and scorer.timeout_s == 7.5
        assert scorer.pool.num_workers == 1
    finally:
        scorer.close()
    auto = RewardScorer(defaults)  # -1: sized from the CPUs
    try:
        assert auto.pool.num_workers == auto_num_workers() and auto.timeout_s == 30.0
    finally:
        auto.close()
