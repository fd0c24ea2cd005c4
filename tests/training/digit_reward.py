"""A reward a tiny random model learns within a few RL steps, for the tests that need the reward
to rise: the share of digits in the response, mapped to [-1, 1] (a random model of the CPU
example's character vocabulary writes about one digit in nine). Loaded by dotted path
(``reward.reward_fn=tests.training.digit_reward:score``)."""


def score(solution_str: str, ground_truth: str) -> float:
    if not solution_str:
        return -1.0
    return 2.0 * sum(c.isdigit() for c in solution_str) / len(solution_str) - 1.0
