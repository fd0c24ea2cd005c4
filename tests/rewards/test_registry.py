"""Reward registry: names, dotted paths, kwargs filtering, return normalisation, errors."""

import pytest

from hapo_megatron.rewards import RewardResult, get_reward_fn, register_reward, registered_rewards, to_reward_result
from hapo_megatron.rewards import registry


def length_reward(solution_str, ground_truth):
    return float(len(solution_str))


def dict_reward(solution_str, ground_truth, data_source=None):
    return {"score": 0.5 if data_source == "a" else -0.5, "pred": solution_str}


def kwargs_reward(solution_str, ground_truth, **kwargs):
    return RewardResult(score=float(len(kwargs)), acc=True, pred=None)


NOT_CALLABLE = 3


def test_builtin_math():
    fn = get_reward_fn("math")
    assert "math" in registered_rewards()
    assert fn("Answer: 4", "4", score_format="pm1") == RewardResult(1.0, True, "4")
    assert fn("Answer: 5", "4", score_format="01", data_source="x", extra_info={}).score == 0.0


def test_dotted_paths_and_kwargs_filtering():
    fn = get_reward_fn("tests.rewards.test_registry:length_reward")
    assert fn("abc", "x", data_source="ignored", score_format="pm1") == RewardResult(3.0, True, None)
    fn = get_reward_fn("tests.rewards.test_registry.dict_reward")
    assert fn("p", "x", data_source="a", extra_info={}) == RewardResult(0.5, True, "p")
    assert fn("p", "x", data_source="b") == RewardResult(-0.5, False, "p")
    fn = get_reward_fn("tests.rewards.test_registry:kwargs_reward")
    assert fn("p", "x", a=1, b=2).score == 2.0  # **kwargs functions get everything


def test_register_reward(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_reward("always_one")
    def one(solution_str, ground_truth):
        return 1

    assert get_reward_fn("always_one")("x", "y") == RewardResult(1.0, True, None)
    register_reward("always_one")(one)  # same function again is fine
    with pytest.raises(ValueError, match="reward 'always_one' is already registered"):
        register_reward("always_one")(length_reward)
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        register_reward("")


@pytest.mark.parametrize("name, message", [
    ("nosuch", "reward 'nosuch' is neither a registered name \\(.*math.*\\) nor a dotted path"),
    ("no_such_pkg.mod:fn", "cannot import module 'no_such_pkg.mod'"),
    ("tests.rewards.test_registry:missing", "has no attribute 'missing'"),
    ("tests.rewards.test_registry:NOT_CALLABLE", "is not callable"),
    ("", "name_or_path must be a reward name or dotted path"),
])
def test_unknown_rewards(name, message):
    with pytest.raises(ValueError, match=message):
        get_reward_fn(name)


def test_to_reward_result_errors():
    with pytest.raises(ValueError, match="must have a 'score' key"):
        to_reward_result({"acc": True})
    with pytest.raises(ValueError, match="must return a RewardResult, number or dict"):
        to_reward_result("1")
    with pytest.raises(ValueError, match="must be finite"):
        to_reward_result(float("nan"))
    assert to_reward_result({"score": 1, "acc": False}) == RewardResult(1.0, False, None)
