"""A reward for the dynamic-sampling tests that decides which groups survive, whatever the model.

Prompts with an even answer get the same score for every response (dynamic sampling drops their
group); prompts with an odd answer get a score from the response text's parity, which differs
between the responses of one group almost always. Loaded by dotted path
(``reward.reward_fn=tests.training.parity_reward:score``)."""


def score(solution_str: str, ground_truth: str) -> float:
    if int(ground_truth) % 2 == 0:
        return -1.0
    return 1.0 if sum(map(ord, solution_str)) % 2 else -1.0
