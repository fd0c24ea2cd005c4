"""Rewards: the math-verification reward and a registry for custom rewards."""

from hapo_megatron.rewards.math import (
    RewardResult,
    answers_equivalent,
    compute_score,
    extract_answer_line,
    extract_boxed,
    extract_final_answer,
)
from hapo_megatron.rewards.registry import get_reward_fn, register_reward, registered_rewards, to_reward_result

__all__ = [
    "RewardResult", "compute_score", "extract_boxed", "extract_answer_line", "extract_final_answer",
    "answers_equivalent", "get_reward_fn", "register_reward", "registered_rewards", "to_reward_result",
]
